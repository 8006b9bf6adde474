"""``python -m jaxrl.export CHECKPOINT --output DIR [--step N] [--format merged|peft]``: a training checkpoint as a
Hugging Face model (or, for a LoRA run, as a PEFT adapter).

``CHECKPOINT`` is a run's checkpoint directory (``trainer.default_local_dir``; its newest restorable step is
used, or ``--step N``) or one step folder ``<run>/global_step_<N>``. Only the actor's parameters are read (no
optimizer state); the decoder is rebuilt from the HF config stored in the checkpoint's meta
(``meta["model"]``, see :func:`jaxrl.checkpoint.model_meta`), and the output folder gets ``config.json``,
``model.safetensors`` and the tokenizer (``<run>/tokenizer``, else the one of the run's model path), loadable
with ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` and ``python -m jaxrl.generate --model DIR``.
Arrays are restored into host (CPU) memory, so no accelerator memory is needed.

A LoRA run's checkpoint (``meta["model"]["lora"]``) holds the adapters only: ``--format merged`` (the default)
loads the base model from the run's ``actor_rollout_ref.model.path`` and writes ``W + (alpha / r) A B``;
``--format peft`` writes the adapters alone as ``adapter_config.json`` + ``adapter_model.safetensors``, what
``peft.PeftModel.from_pretrained(base_model, DIR)`` loads.

Exit status: 0 on success, 2 on bad input (a missing or incomplete checkpoint, a checkpoint without model
meta, an output folder that is not empty); the message on stderr names the path.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from pathlib import Path

__all__ = ["FORMATS", "build_parser", "export_checkpoint", "main", "resolve_checkpoint_arg"]

FORMATS = ("merged", "peft")

log = logging.getLogger("jaxrl.export")


class ExportError(ValueError):
    """Bad input for the export (the message names the path and what is wrong)."""


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m jaxrl.export", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a run's checkpoint directory, or one of its global_step_<N> folders")
    p.add_argument("--output", required=True, help="folder to write the Hugging Face model to (new or empty)")
    p.add_argument("--step", type=int, default=None, help="step to export (default: the newest restorable one)")
    p.add_argument("--format", choices=FORMATS, default="merged",
                   help="merged: a Hugging Face model (LoRA merged into the base); peft: a LoRA run's adapter as a "
                        "PEFT adapter directory")
    return p


def resolve_checkpoint_arg(checkpoint: str | os.PathLike, step: int | None) -> tuple[Path, int | None]:
    """``(run_root, step)`` for a CLI ``CHECKPOINT`` argument.

    Args:
      checkpoint: a run root, or a ``.../global_step_<N>`` folder (then ``step`` is ``N``).
      step: an explicit ``--step`` (must agree with a step folder's number).

    Raises:
      ExportError: the path does not exist, or ``--step`` contradicts the step folder.
    """
    from jaxrl.checkpoint import parse_step_dir

    path = Path(checkpoint).expanduser().absolute()
    if not path.is_dir():
        raise ExportError(f"checkpoint path {str(path)!r} does not exist or is not a directory")
    folder_step = parse_step_dir(path)
    if folder_step is None:
        return path, step
    if step is not None and step != folder_step:
        raise ExportError(f"--step {step} contradicts the step folder {str(path)!r} (step {folder_step})")
    return path.parent, folder_step


def _model_meta(meta: dict, where: str) -> dict:
    model = meta.get("model") if isinstance(meta, dict) else None
    if not isinstance(model, dict) or not isinstance(model.get("hf_config"), dict) or "param_dtype" not in model:
        raise ExportError(
            f"checkpoint {where!r} has no model description (meta['model'] with 'hf_config' and 'param_dtype', "
            "written by jaxrl's trainer via jaxrl.checkpoint.model_meta)"
        )
    return model


def _load_export_tokenizer(store, model: dict):
    """The run's saved tokenizer, else the one that ships with the run's model path."""
    from jaxrl.models.tokenizer import load_tokenizer

    saved = store.tokenizer_path()
    if saved is not None:
        return load_tokenizer(str(saved))
    path = model.get("path")
    if path:
        from jaxrl.models.resolve import resolve_model_path

        try:
            tok = load_tokenizer(resolve_model_path(path))
        except (OSError, ValueError) as e:
            raise ExportError(
                f"no tokenizer: {str(store.directory / 'tokenizer')!r} is missing and the run's model path "
                f"{path!r} gave none ({e})"
            ) from e
        log.warning("%s has no tokenizer/ folder; using the tokenizer of the model path %r", store.directory, path)
        return tok
    raise ExportError(f"no tokenizer: {str(store.directory / 'tokenizer')!r} is missing and meta['model'] has no path")


def is_checkpoint_path(path: str | os.PathLike) -> bool:
    """True if ``path`` is a run's checkpoint directory (has ``global_step_<N>`` folders) or one step folder."""
    from jaxrl.checkpoint import parse_step_dir

    p = Path(path).expanduser()
    if not p.is_dir():
        return False
    return parse_step_dir(p) is not None or any(parse_step_dir(c) is not None for c in p.iterdir() if c.is_dir())


def _restore_actor(checkpoint: str | os.PathLike, step: int | None):
    """``(step, built, params, store)``: the actor's saved params (the whole policy, or a LoRA run's adapters)
    restored on the CPU; ``built`` holds ``cfg``, ``graphdef``, ``model`` (the meta entry) and, for LoRA, ``lora``
    (a :class:`jaxrl.models.lora.LoraInfo`)."""
    import jax
    from flax import nnx

    from jaxrl.checkpoint import CheckpointRestoreError, CheckpointStore
    from jaxrl.models import parse_dtype
    from jaxrl.models.config import ModelConfig
    from jaxrl.models.decoder import Decoder

    root, step = resolve_checkpoint_arg(checkpoint, step)
    store = CheckpointStore(root, max_to_keep=None, read_only=True)
    if not store.steps():
        raise ExportError(f"checkpoint directory {str(root)!r} holds no complete global_step_<N> checkpoint")
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    built: dict = {}

    def like(meta: dict) -> dict:
        try:
            model = _model_meta(meta, str(root))
        except ExportError as e:
            built["meta_error"] = e
            raise
        cfg = ModelConfig.from_hf_config(model["hf_config"])
        dtype = parse_dtype(model["param_dtype"])
        abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0), param_dtype=dtype, dtype=dtype))
        graphdef, params = nnx.split(abstract)
        built.update(cfg=cfg, graphdef=graphdef, model=model)
        if model.get("lora"):  # a LoRA run: the checkpoint holds the adapters (their tree from the recorded targets)
            from jaxrl.models.lora import LoraSpec, apply_lora

            lora = model["lora"]
            spec = LoraSpec(rank=int(lora["rank"]), alpha=float(lora["alpha"]), target_modules=list(lora["targets"]))
            params, info = apply_lora(abstract, spec)
            built["lora"] = info
        elif model.get("scan_layout"):  # saved with the layers stacked (jaxrl.models.scan_layout): that tree
            from jaxrl.models.scan_layout import stack_layers

            training = nnx.eval_shape(
                lambda: Decoder(cfg, rngs=nnx.Rngs(0), param_dtype=dtype, dtype=dtype, remat=True))
            train_graphdef = nnx.graphdef(training)
            params = jax.eval_shape(lambda p: stack_layers(train_graphdef, p)[1], nnx.state(training))
            built["scan_layout"] = True
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu), params)
        return {"actor": {"params": target}}

    try:
        step, arrays, _ = store.restore(step, like=like)
    except CheckpointRestoreError as e:
        if "meta_error" in built:  # readable, but not a jaxrl training checkpoint: say that, not "corrupt"
            raise built["meta_error"] from e
        raise
    finally:
        store.close()
    params = arrays["actor"]["params"]
    if built.get("scan_layout"):  # back to the per-layer tree of built["graphdef"]
        from jaxrl.models.scan_layout import unstack_layers

        params = jax.jit(unstack_layers)(params)
    return step, built, params, store


def _base_model(built: dict):
    """A LoRA run's base model (``meta["model"]["path"]``, in the run's parameter dtype) on the CPU.

    Raises:
      ExportError: no path, or the model there does not have the checkpoint's config.
    """
    import jax

    from jaxrl.models import load_pretrained

    model = built["model"]
    path = model.get("path")
    if not path:
        raise ExportError("a LoRA checkpoint needs its base model, but meta['model'] has no path")
    with jax.default_device(jax.devices("cpu")[0]):
        base = load_pretrained(path, param_dtype=model["param_dtype"], dtype=model["param_dtype"],
                               load_tokenizer=False)
    if base.config != built["cfg"]:
        raise ExportError(f"the base model at {path!r} is not the one the LoRA checkpoint was trained on (its config "
                          "differs from meta['model']['hf_config'])")
    return base.model


def load_checkpoint_policy(checkpoint: str | os.PathLike, *, step: int | None = None):
    """The actor of a training checkpoint as ``(step, Pretrained)`` (params on the CPU, tokenizer included); a LoRA
    run's adapters merged into its base model (``W + (alpha / r) A B``).

    Args:
      checkpoint: a run's checkpoint directory or one ``global_step_<N>`` folder (see the module docstring).
      step: the step to load; None = the step folder's, or the newest restorable step of the run.

    Raises:
      ExportError: bad input (missing/incomplete checkpoint, no model meta, no tokenizer, a LoRA run's base model
        missing or different).
      jaxrl.checkpoint.CheckpointRestoreError: no restorable checkpoint (message names the folder and steps).
    """
    from flax import nnx

    from jaxrl.models import Pretrained

    step, built, params, store = _restore_actor(checkpoint, step)
    if "lora" in built:
        from jaxrl.models.lora import merge_lora

        base = _base_model(built)
        model_graphdef, base_params = nnx.split(base)
        model = nnx.merge(model_graphdef, merge_lora(params, base_params, built["lora"].spec.scale))
    else:
        model = nnx.merge(built["graphdef"], params)
    tokenizer = _load_export_tokenizer(store, built["model"])
    log.info("loaded step %d of %s", step, store.directory)
    return step, Pretrained(config=built["cfg"], model=model, tokenizer=tokenizer)


def export_checkpoint(checkpoint: str | os.PathLike, output: str | os.PathLike, *, step: int | None = None,
                      format: str = "merged") -> Path:
    """Write the actor of a training checkpoint as a Hugging Face model folder (or a LoRA run's PEFT adapter).

    Args:
      checkpoint: a run's checkpoint directory or one ``global_step_<N>`` folder (see the module docstring).
      output: the folder to create (it may exist if empty); written to a temporary sibling and renamed, so a
        failed export leaves no half-written model.
      step: the step to export; None = the step folder's, or the newest restorable step of the run.
      format: ``"merged"`` (a Hugging Face model; LoRA merged into the base) or ``"peft"`` (a LoRA run's adapters:
        ``adapter_config.json`` + ``adapter_model.safetensors``).

    Returns:
      The output folder.

    Raises:
      ExportError: bad input (missing/incomplete checkpoint, no model meta, no tokenizer, output not empty,
        ``format="peft"`` for a checkpoint without LoRA, an unknown format).
      jaxrl.checkpoint.CheckpointRestoreError: no restorable checkpoint (message names the folder and steps).
    """
    from jaxrl.models.hf import save_hf

    if format not in FORMATS:
        raise ExportError(f"format={format!r} is unknown; valid: {', '.join(FORMATS)}")
    out = Path(output).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"output {str(out)!r} already exists and is not an empty folder")
    if format == "peft":
        step, built, params, _ = _restore_actor(checkpoint, step)
        if "lora" not in built:
            raise ExportError(f"checkpoint {str(checkpoint)!r} was not trained with LoRA (no meta['model']['lora']); "
                              "--format peft needs a LoRA run, use --format merged")

        def write(tmp):
            from jaxrl.models.lora import save_peft_adapter

            save_peft_adapter(params, built["lora"], tmp, num_layers=built["cfg"].num_hidden_layers,
                              base_model_name_or_path=built["model"].get("path"))
    else:
        step, pre = load_checkpoint_policy(checkpoint, step=step)

        def write(tmp):
            save_hf(pre.model, pre.config, tmp, tokenizer=pre.tokenizer)
    tmp = out.parent / f".{out.name}.export-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported step %d of %s to %s", step, checkpoint, out)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 2 bad input)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from jaxrl.checkpoint import CheckpointRestoreError

    try:
        out = export_checkpoint(args.checkpoint, args.output, step=args.step, format=args.format)
    except (ExportError, CheckpointRestoreError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
