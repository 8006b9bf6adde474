"""Model definitions and loaders: the Flax NNX :class:`Decoder` and :func:`load_pretrained`.

``load_pretrained`` accepts a Hugging Face model directory, a ``*.gguf`` file or a llama2.c ``*.bin`` checkpoint
(after :func:`jaxrl.models.resolve.resolve_model_path` expands the spec).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder, KVCache, init_cache
from jaxrl.models.files import ModelFileError, read_model_config

__all__ = [
    "Decoder",
    "KVCache",
    "ModelConfig",
    "ModelFileError",
    "Pretrained",
    "init_cache",
    "load_pretrained",
    "parse_dtype",
    "read_model_config",
    "remat_setting",
]

_DTYPES = {
    "float32": jnp.float32,
    "fp32": jnp.float32,
    "f32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
}


def parse_dtype(name: Any) -> jnp.dtype:
    """Map ``"float32"|"fp32"|"f32"|"bfloat16"|"bf16"`` (or a float32/bfloat16 dtype) to a ``jnp.dtype``.

    Raises:
        ValueError: any other value (the message lists the accepted names).
    """
    if isinstance(name, str):
        key = name.strip().lower()
        if key in _DTYPES:
            return jnp.dtype(_DTYPES[key])
    else:
        try:
            dt = jnp.dtype(name)
        except TypeError:
            dt = None
        if dt is not None and dt in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            return dt
    raise ValueError(f"unsupported dtype {name!r}; use one of {sorted(_DTYPES)}")


@dataclass
class Pretrained:
    """A loaded model: its config, the NNX :class:`Decoder`, and the tokenizer (or None)."""

    config: ModelConfig
    model: Decoder
    tokenizer: Any


def remat_setting(model_cfg) -> bool | str:
    """The decoder's ``remat=`` for a config's model section (``actor_rollout_ref.model`` / ``critic.model`` of the RL
    trainer, ``model`` of SFT / DPO): False when its ``enable_gradient_checkpointing`` is off, else its
    ``recompute_granularity`` (``"full"`` / ``"selective"``)."""
    return model_cfg.recompute_granularity if model_cfg.enable_gradient_checkpointing else False


def load_pretrained(
    path: str,
    *,
    param_dtype: str = "float32",
    dtype: str = "float32",
    remat: bool | str = False,
    load_tokenizer: bool = True,
) -> Pretrained:
    """Load a pretrained decoder (and tokenizer) from a model spec.

    Args:
        path: anything :func:`jaxrl.models.resolve.resolve_model_path` accepts; it resolves to a Hugging Face
            directory (with ``config.json``), a ``*.gguf`` file, or a llama2.c ``*.bin`` checkpoint.
        param_dtype: storage dtype name for parameters (``"float32"``/``"fp32"``/``"bfloat16"``/``"bf16"``).
        dtype: compute dtype name (same choices).
        remat: rematerialise each block in the backward pass: False, True / ``"full"`` or ``"selective"``
            (:data:`jaxrl.models.decoder.REMAT_POLICIES`).
        load_tokenizer: also load the tokenizer via ``jaxrl.models.tokenizer.load_tokenizer``.

    Returns:
        :class:`Pretrained` with ``tokenizer=None`` when ``load_tokenizer`` is False.

    Raises:
        ValueError: bad dtype name.
        ModelFileError (a ValueError): a file that exists but cannot be used: truncated or corrupt weights
            (safetensors / GGUF / llama2.c), a ``config.json`` that is not JSON, an unsupported architecture, a
            checkpoint that does not match its config, unreadable tokenizer files. The message names the file.
        FileNotFoundError: the resolved path does not exist or is not a recognised checkpoint.
    """
    pdt, cdt = parse_dtype(param_dtype), parse_dtype(dtype)
    from jaxrl.models import hf
    from jaxrl.models.resolve import resolve_model_path

    resolved = resolve_model_path(path)
    if os.path.isdir(resolved):
        if not os.path.isfile(os.path.join(resolved, "config.json")):
            raise FileNotFoundError(f"model directory {resolved!r} has no config.json")
        hf_config, tensors = hf.load_hf_dir(resolved)
        config_file = os.path.join(resolved, "config.json")
    elif os.path.isfile(resolved) and resolved.endswith(".gguf"):
        from jaxrl.models.gguf import read_gguf

        hf_config, tensors = read_gguf(resolved)
        config_file = resolved
    elif os.path.isfile(resolved) and resolved.endswith(".bin"):
        from jaxrl.models.llama2c import read_llama2c

        hf_config, tensors = read_llama2c(resolved)
        config_file = resolved
    else:
        raise FileNotFoundError(
            f"model path {resolved!r} (from {path!r}) is not a directory with config.json, a .gguf file "
            "or a llama2.c .bin file"
        )
    try:
        cfg = ModelConfig.from_hf_config(hf_config)
    except ValueError as e:  # a config jaxrl cannot build (unsupported model_type, missing field, ...)
        raise ModelFileError(f"{config_file}: {e}") from e
    try:
        model = hf.from_hf_tensors(cfg, tensors, param_dtype=pdt, dtype=cdt, remat=remat)
    except ValueError as e:  # missing / unexpected / wrongly shaped tensors
        raise ModelFileError(f"{resolved}: {e}") from e
    tokenizer = None
    if load_tokenizer:
        from jaxrl.models.tokenizer import load_tokenizer as _load_tokenizer

        tokenizer = _load_tokenizer(resolved)
    return Pretrained(config=cfg, model=model, tokenizer=tokenizer)
