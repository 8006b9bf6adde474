"""``python -m jaxrl.export CHECKPOINT --output DIR [--step N]``: a training checkpoint as a Hugging Face model.

``CHECKPOINT`` is a run's checkpoint directory (``trainer.default_local_dir``; its newest restorable step is
used, or ``--step N``) or one step folder ``<run>/global_step_<N>``. Only the actor's parameters are read (no
optimizer state); the decoder is rebuilt from the HF config stored in the checkpoint's meta
(``meta["model"]``, see :func:`jaxrl.checkpoint.model_meta`), and the output folder gets ``config.json``,
``model.safetensors`` and the tokenizer (``<run>/tokenizer``, else the one of the run's model path), loadable
with ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` and ``python -m jaxrl.generate --model DIR``.
Arrays are restored into host (CPU) memory, so no accelerator memory is needed.

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

__all__ = ["build_parser", "export_checkpoint", "main", "resolve_checkpoint_arg"]

log = logging.getLogger("jaxrl.export")


class ExportError(ValueError):
    """Bad input for the export (the message names the path and what is wrong)."""


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m jaxrl.export", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a run's checkpoint directory, or one of its global_step_<N> folders")
    p.add_argument("--output", required=True, help="folder to write the Hugging Face model to (new or empty)")
    p.add_argument("--step", type=int, default=None, help="step to export (default: the newest restorable one)")
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


def load_checkpoint_policy(checkpoint: str | os.PathLike, *, step: int | None = None):
    """The actor of a training checkpoint as ``(step, Pretrained)`` (params on the CPU, tokenizer included).

    Args:
      checkpoint: a run's checkpoint directory or one ``global_step_<N>`` folder (see the module docstring).
      step: the step to load; None = the step folder's, or the newest restorable step of the run.

    Raises:
      ExportError: bad input (missing/incomplete checkpoint, no model meta, no tokenizer).
      jaxrl.checkpoint.CheckpointRestoreError: no restorable checkpoint (message names the folder and steps).
    """
    import jax
    from flax import nnx

    from jaxrl.checkpoint import CheckpointRestoreError, CheckpointStore
    from jaxrl.models import Pretrained, parse_dtype
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
    model = nnx.merge(built["graphdef"], arrays["actor"]["params"])
    tokenizer = _load_export_tokenizer(store, built["model"])
    log.info("loaded step %d of %s", step, root)
    return step, Pretrained(config=built["cfg"], model=model, tokenizer=tokenizer)


def export_checkpoint(checkpoint: str | os.PathLike, output: str | os.PathLike, *, step: int | None = None) -> Path:
    """Write the actor of a training checkpoint as a Hugging Face model folder.

    Args:
      checkpoint: a run's checkpoint directory or one ``global_step_<N>`` folder (see the module docstring).
      output: the folder to create (it may exist if empty); written to a temporary sibling and renamed, so a
        failed export leaves no half-written model.
      step: the step to export; None = the step folder's, or the newest restorable step of the run.

    Returns:
      The output folder.

    Raises:
      ExportError: bad input (missing/incomplete checkpoint, no model meta, no tokenizer, output not empty).
      jaxrl.checkpoint.CheckpointRestoreError: no restorable checkpoint (message names the folder and steps).
    """
    from jaxrl.models.hf import save_hf

    out = Path(output).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"output {str(out)!r} already exists and is not an empty folder")
    step, pre = load_checkpoint_policy(checkpoint, step=step)
    tmp = out.parent / f".{out.name}.export-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_hf(pre.model, pre.config, tmp, tokenizer=pre.tokenizer)
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
        out = export_checkpoint(args.checkpoint, args.output, step=args.step)
    except (ExportError, CheckpointRestoreError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
