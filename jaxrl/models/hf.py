"""Hugging Face checkpoint import/export for :class:`~jaxrl.models.decoder.Decoder`.

Tensors use Hugging Face names and torch layouts (``nn.Linear.weight`` is ``[out, in]``), e.g.
``model.layers.0.self_attn.q_proj.weight`` ``[nH*D, H]``. The mapping to the Decoder's layouts (documented in
``decoder.py``) is a pure transpose/reshape, so ``to_hf_tensors(from_hf_tensors(cfg, t))`` reproduces ``t``
exactly (float32) or bit-exactly in the stored dtype. The name/layout table is :func:`sharding.hf_table`, the
one the weight translator's ``"hf"`` target (what vLLM loads) reads as well.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder
from jaxrl.models.files import ModelFileError, read_json_file
from sharding.hf_layout import HFTensor, hf_table
from sharding.plan import ModelInfo, run_steps

# Present in some older checkpoints; carry no learned information.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------------------------- reading
def load_hf_dir(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """Read a Hugging Face model directory.

    Args:
        path: directory holding ``config.json`` and either ``model.safetensors`` or a sharded
            ``model.safetensors.index.json`` (+ its shard files).

    Returns:
        ``(config_dict, tensors)``: the parsed ``config.json`` and ``{hf_name: np.ndarray}`` in the stored dtype
        (bfloat16 arrives as ``ml_dtypes.bfloat16``).

    Raises:
        FileNotFoundError: the directory, ``config.json``, the weights or a shard listed in the index is missing
            (the message names the directory and the missing file).
        ModelFileError: ``config.json`` or the index is not a JSON object, the index has no ``weight_map``, or a
            safetensors file is truncated or corrupt (the message names the file).
    """
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"model directory {str(d)!r} does not exist or is not a directory")
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"model directory {str(d)!r} has no config.json")
    config = read_json_file(cfg_path, "model config")
    single = d / "model.safetensors"
    index = d / "model.safetensors.index.json"
    tensors: dict[str, np.ndarray] = {}
    if single.is_file():
        tensors.update(_load_safetensors(single))
    elif index.is_file():
        weight_map = read_json_file(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelFileError(f"{index}: no 'weight_map' object (tensor name -> shard file); restore the file "
                                 "from the model's source")
        for shard in sorted(set(weight_map.values())):
            shard_path = d / shard
            if not shard_path.is_file():
                raise FileNotFoundError(
                    f"model directory {str(d)!r} is missing shard {shard!r} listed in model.safetensors.index.json"
                )
            tensors.update(_load_safetensors(shard_path))
        absent = sorted(set(weight_map) - set(tensors))
        if absent:
            raise FileNotFoundError(
                f"model directory {str(d)!r}: tensors listed in the index are absent from the shards: {absent[:10]}"
            )
    else:
        raise FileNotFoundError(
            f"model directory {str(d)!r} has neither model.safetensors nor model.safetensors.index.json"
        )
    return config, tensors


def _load_safetensors(path: Path) -> dict[str, np.ndarray]:
    """``safetensors.numpy.load_file`` whose errors on a truncated or corrupt file name the file."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return load_file(str(path))
    except SafetensorError as e:
        size = path.stat().st_size
        raise ModelFileError(
            f"{path}: not a readable safetensors file ({size} bytes; {' '.join(str(e).split())}): it is truncated "
            "or corrupt; copy or download it again"
        ) from e


# ----------------------------------------------------------------------------------------------- mapping
def _entries(cfg: ModelConfig, *, lm_head: bool = True) -> tuple[HFTensor, ...]:
    """The weight table of ``cfg``'s decoder, from the one HF name/layout table (:func:`sharding.hf_table`, which
    the translator's ``"hf"`` target reads too); ``lm_head=False`` leaves out an untied ``lm_head.weight`` (a
    ``*ForSequenceClassification`` checkpoint has a ``score`` head instead)."""
    return hf_table(ModelInfo.from_config(cfg), vocab_size=cfg.vocab_size, attention_bias=cfg.attention_bias,
                    qk_norm=cfg.qk_norm, lm_head=lm_head)


def _get_variable(model: Decoder, source: str) -> nnx.Variable:
    """The Variable at a dotted ``nnx.State`` path (``"layers.0.self_attn.q_proj"``)."""
    obj: Any = model
    for key in source.split("."):
        obj = obj[int(key)] if key.isdigit() else getattr(obj, key)
    if not isinstance(obj, nnx.Variable):
        raise TypeError(f"internal error: {source} is {type(obj).__name__}, not an nnx.Variable")
    return obj


def _allowed_extra(cfg: ModelConfig, name: str, lm_head: bool = True) -> bool:
    if name.endswith(_IGNORED_SUFFIXES):
        return True
    # Tied checkpoints sometimes also store the (identical) lm_head.
    return lm_head and cfg.tie_word_embeddings and name == "lm_head.weight"


def from_hf_tensors(
    cfg: ModelConfig,
    tensors: dict[str, np.ndarray],
    *,
    param_dtype=jnp.float32,
    dtype=jnp.float32,
    remat: bool | str = False,
    lm_head: bool = True,
) -> Decoder:
    """Build a :class:`Decoder` holding ``tensors`` (HF names, torch layouts), cast to ``param_dtype``.

    The model skeleton is created abstractly (``nnx.eval_shape``), so no random initialisation is computed.
    ``lm_head=False`` builds the body only (``model.lm_head is None``; no ``lm_head.weight`` expected or allowed):
    the backbone of a ``*ForSequenceClassification`` reward model, whose head the caller adds.

    Raises:
        ValueError: listing every missing tensor, unexpected tensor and tensor with a wrong shape (with the
            expected shape). When ``cfg.tie_word_embeddings``, ``lm_head.weight`` may be absent, or present and
            equal to ``model.embed_tokens.weight`` (a differing one is reported as unexpected).
    """
    entries = _entries(cfg, lm_head=lm_head)
    expected_names = {e.name for e in entries}
    missing = [e.name for e in entries if e.name not in tensors]
    unexpected = sorted(n for n in tensors if n not in expected_names and not _allowed_extra(cfg, n, lm_head))
    wrong = [
        f"{e.name}: expected {e.shape}, got {tuple(np.shape(tensors[e.name]))}"
        for e in entries
        if e.name in tensors and tuple(np.shape(tensors[e.name])) != e.shape
    ]
    if (
        lm_head
        and cfg.tie_word_embeddings
        and "lm_head.weight" in tensors
        and "model.embed_tokens.weight" in tensors
        and not np.array_equal(np.asarray(tensors["lm_head.weight"]), np.asarray(tensors["model.embed_tokens.weight"]))
    ):
        unexpected.append("lm_head.weight (differs from model.embed_tokens.weight but tie_word_embeddings=True)")
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing tensors: {missing}")
        if unexpected:
            parts.append(f"unexpected tensors: {unexpected}")
        if wrong:
            parts.append(f"wrong shapes: {wrong}")
        raise ValueError(f"checkpoint does not match the {cfg.model_type} config: " + "; ".join(parts))

    model = nnx.eval_shape(
        lambda: Decoder(cfg, rngs=nnx.Rngs(0), param_dtype=param_dtype, dtype=dtype, remat=remat)
    )
    if not lm_head:
        model.lm_head = None
    target = jnp.dtype(param_dtype)
    for e in entries:
        arr = np.ascontiguousarray(run_steps(e.from_hf, np.asarray(tensors[e.name]), what=e.name))
        var = _get_variable(model, e.source)
        if tuple(var.shape) != arr.shape:
            raise ValueError(f"internal layout error for {e.name}: {arr.shape} vs parameter {tuple(var.shape)}")
        var.set_value(jnp.asarray(arr, dtype=target))
    return model


def to_hf_tensors(model: Decoder) -> dict[str, np.ndarray]:
    """Export ``model`` as ``{hf_name: np.ndarray}`` in HF names/torch layouts and the parameter dtype.

    Exact inverse of :func:`from_hf_tensors` (a tied model, or a body built with ``lm_head=False``, has no
    ``lm_head.weight``).
    """
    out: dict[str, np.ndarray] = {}
    for e in _entries(model.cfg, lm_head=model.lm_head is not None):
        arr = np.asarray(jax.device_get(_get_variable(model, e.source).get_value()))
        arr = np.ascontiguousarray(run_steps(e.to_hf, arr, what=e.name))
        assert arr.shape == e.shape, (e.name, arr.shape, e.shape)
        out[e.name] = arr
    return out


def save_hf(model: Decoder, cfg: ModelConfig, out_dir: str | os.PathLike, tokenizer=None) -> None:
    """Write ``config.json`` + ``model.safetensors`` (+ ``tokenizer.save_pretrained``) to ``out_dir``.

    The result loads with ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)``. Tensors are saved in
    the model's parameter dtype, which is also recorded as ``torch_dtype``/``dtype`` in the config.

    Raises:
        ValueError: ``cfg`` differs from ``model.cfg``.
    """
    from safetensors.numpy import save_file

    if cfg != model.cfg:
        raise ValueError(f"cfg does not match the model's config:\n  given {cfg}\n  model {model.cfg}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = to_hf_tensors(model)
    dtype_name = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(
        jnp.dtype(model.param_dtype).name, "float32"
    )
    config = cfg.to_hf_config()
    config["torch_dtype"] = dtype_name
    config["dtype"] = dtype_name
    with open(out / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
