"""Decoder architecture description (:class:`ModelConfig`) and conversion to/from Hugging Face ``config.json``.

One frozen dataclass covers the three supported families, which differ only in small switches:

* ``llama``  - plain Llama / Llama-3 (optionally ``rope_scaling`` of type ``llama3``), tied or untied head.
* ``qwen2``  - Llama + bias on the q/k/v projections (``attention_bias=True``; HF hard-codes it for Qwen2).
* ``qwen3``  - Llama + per-head RMSNorm on q and k before RoPE (``qk_norm=True``), explicit ``head_dim``.

Field meanings follow Hugging Face ``transformers`` (``LlamaConfig`` / ``Qwen2Config`` / ``Qwen3Config``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def _as_eos_tuple(eos: Any) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (int(eos),)
    if isinstance(eos, (list, tuple)):
        return tuple(int(e) for e in eos)
    raise ValueError(f"eos_token_id must be an int, a list of ints or None; got {eos!r}")


def _normalise_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Return ``(rope_theta, rope_scaling)`` from either HF field style.

    Accepts the legacy ``rope_theta`` + ``rope_scaling`` fields and the transformers-5 ``rope_parameters`` dict
    (which also carries ``rope_theta``). ``rope_scaling`` is ``None`` for plain (``default``) RoPE.
    """
    params = d.get("rope_parameters") or d.get("rope_scaling")
    params = dict(params) if params else {}
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        # Per-layer-type nested form (transformers 5); all supported models use full attention only.
        params = dict(params["full_attention"])
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = d.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    params.pop("type", None)
    partial = params.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial!r} is not supported; only full rotary (1.0)")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return float(theta), None
    params["rope_type"] = rope_type
    if "factor" not in params:
        raise ValueError(f"rope_scaling of type {rope_type!r} needs a 'factor'; got {params!r}")
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if key not in params:
                raise ValueError(f"rope_scaling of type 'llama3' needs {key!r}; got {params!r}")
        params.setdefault("original_max_position_embeddings", d.get("max_position_embeddings", 2048))
    return float(theta), params


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (Llama / Qwen2 / Qwen3 family).

    Attributes:
        model_type: ``"llama"``, ``"qwen2"`` or ``"qwen3"``.
        vocab_size: number of token ids (rows of the embedding).
        hidden_size: residual-stream width ``H``.
        intermediate_size: SwiGLU inner width ``I``.
        num_hidden_layers: number of decoder blocks ``L``.
        num_attention_heads: query heads ``nH``.
        num_key_value_heads: key/value heads ``nKV`` (grouped-query attention; ``nH % nKV == 0``).
        head_dim: per-head width ``D`` (need not equal ``H / nH``, e.g. Qwen3).
        rms_norm_eps: epsilon inside every RMSNorm.
        rope_theta: RoPE base wavelength.
        rope_scaling: ``None`` for plain RoPE, else an HF-style dict with ``rope_type`` in
            ``{"linear", "llama3"}`` and its parameters (``factor``; for llama3 also ``low_freq_factor``,
            ``high_freq_factor``, ``original_max_position_embeddings``).
        max_position_embeddings: longest position the model was trained for (informational; not enforced).
        tie_word_embeddings: the LM head reuses the token embedding matrix.
        attention_bias: q/k/v projections carry a bias (Qwen2: True).
        qk_norm: per-head RMSNorm over ``head_dim`` on q and k before RoPE (Qwen3).
        bos_token_id, eos_token_id, pad_token_id: special ids (``eos_token_id`` is a tuple, maybe empty).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: {list(SUPPORTED_MODEL_TYPES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int; got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.model_type == "qwen2" and not self.attention_bias:
            raise ValueError("model_type 'qwen2' always has q/k/v bias (transformers hard-codes it); "
                             "set attention_bias=True")
        if self.qk_norm != (self.model_type == "qwen3"):
            raise ValueError(
                f"qk_norm={self.qk_norm} does not match model_type {self.model_type!r}: "
                "qk_norm must be True exactly for 'qwen3' (the only supported family with q/k RMSNorm)"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE; got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ValueError(f"rms_norm_eps must be a positive finite float; got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0; got {self.rope_theta!r}")
        if self.rope_scaling is not None:
            # Validates and normalises (raises ValueError on unsupported types / missing keys).
            _, rs = _normalise_rope(
                {"rope_scaling": dict(self.rope_scaling), "max_position_embeddings": self.max_position_embeddings}
            )
            object.__setattr__(self, "rope_scaling", rs)
        object.__setattr__(self, "eos_token_id", _as_eos_tuple(self.eos_token_id))

    def __hash__(self) -> int:
        # rope_scaling is a dict; hash a canonical tuple so the config can be a static (jit/NNX graph) attribute.
        fields = tuple(
            tuple(sorted(v.items())) if isinstance(v, dict) else v
            for v in (getattr(self, f.name) for f in dataclasses.fields(self))
        )
        return hash(fields)

    # ------------------------------------------------------------------ HF conversion
    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x field style).

        ``head_dim`` defaults to ``hidden_size // num_attention_heads`` (for ``qwen3`` to 128, as transformers'
        ``Qwen3Config`` does); ``num_key_value_heads`` defaults to ``num_attention_heads``. RoPE parameters are
        read from ``rope_scaling`` or ``rope_parameters``.

        Raises:
            ValueError: unsupported ``model_type`` (the message names the supported ones), unsupported activation,
                MLP bias, sliding-window attention, rope type, or a missing required field.
        """
        if not isinstance(d, dict):
            raise ValueError(f"expected a config dict, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {list(SUPPORTED_MODEL_TYPES)}"
            )
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is supported")
        if d.get("mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported (no supported checkpoint uses it)")
        if d.get("use_sliding_window", False):
            raise ValueError("use_sliding_window=True is not supported; only full attention is implemented")
        missing = [
            k
            for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
            if d.get(k) is None
        ]
        if missing:
            raise ValueError(f"config is missing required field(s) {missing}")
        heads = int(d["num_attention_heads"])
        kv_heads = d.get("num_key_value_heads")
        kv_heads = heads if kv_heads is None else int(kv_heads)
        head_dim = d.get("head_dim")
        if head_dim is None:
            head_dim = 128 if model_type == "qwen3" else int(d["hidden_size"]) // heads
        theta, scaling = _normalise_rope(d)
        if model_type == "qwen2":
            attention_bias = True  # transformers' Qwen2Attention hard-codes bias=True on q/k/v
        else:
            attention_bias = bool(d.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=model_type == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=_as_eos_tuple(d.get("eos_token_id")),
            pad_token_id=d.get("pad_token_id"),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """Return a ``config.json`` dict that ``transformers.AutoConfig`` (4.x and 5.x) loads.

        RoPE is written as ``rope_theta`` + ``rope_scaling`` (the legacy form; transformers 5 converts it to
        ``rope_parameters``). ``eos_token_id`` is written as an int when it has one element.
        """
        eos: Any
        if len(self.eos_token_id) == 0:
            eos = None
        elif len(self.eos_token_id) == 1:
            eos = self.eos_token_id[0]
        else:
            eos = list(self.eos_token_id)
        d: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type in ("llama", "qwen3"):
            d["attention_bias"] = self.attention_bias
        if self.model_type == "llama":
            d["mlp_bias"] = False
        if self.model_type in ("qwen2", "qwen3"):
            d["use_sliding_window"] = False
        return d

    def replace(self, **changes: Any) -> "ModelConfig":
        """Return a copy with ``changes`` applied (validated like the constructor)."""
        return dataclasses.replace(self, **changes)
