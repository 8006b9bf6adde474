"""LoRA adapters on the decoder's projections (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models").

A targeted projection ``y = x @ W`` becomes ``y = x @ W + (alpha / r) * (x @ A) @ B`` with ``A`` ``[in, r]`` and
``B`` ``[r, out]``; ``B`` starts at zero, so a freshly adapted model computes exactly what the base model does. The
adapter module is Flax NNX's own :class:`flax.nnx.LoRA` (its ``nnx.LoRAParam`` variable type is what separates the
trainable adapters from the frozen base in ``nnx.split(model, nnx.LoRAParam, ...)``; ``A`` is He-uniform, ``B``
zeros), scaled by PEFT's ``lora_alpha / r`` (``peft.tuners.lora.layer.LoraLayer.update_layer``, no rsLoRA).

Adapted projections and their adapter shapes (``in`` / ``out`` flatten the kernel's input / output axes, in the
order Hugging Face's ``nn.Linear`` features use, so the adapters are PEFT's ``lora_A.weight.T`` / ``lora_B.weight.T``)::

    self_attn.q_proj   A [H, r]       B [r, nH*D]      (k_proj / v_proj: nKV*D)
    self_attn.o_proj   A [nH*D, r]    B [r, H]
    mlp.gate_proj      A [H, r]       B [r, I]         (up_proj likewise)
    mlp.down_proj      A [I, r]       B [r, H]

They live at ``layers.<i>.self_attn.lora.<name>.lora_{a,b}`` / ``layers.<i>.mlp.lora.<name>.lora_{a,b}`` of the
model's state. The embedding and the LM head are never adapted.

Which projections (verl's ``actor_rollout_ref.model.target_modules`` / ``exclude_modules``, PEFT's ``LoraConfig``
semantics, matched against the Hugging Face module names ``model.layers.<i>.self_attn.q_proj``, ...): ``"all-linear"``
is every projection above; any other string is a regular expression that must match a whole name; a list matches a
name equal to an entry or ending with ``"." + entry``. ``exclude_modules`` (a regex or a list, same rules) removes
names again.

The merged weights (:func:`merge_lora`: ``W + (alpha / r) * A @ B`` per adapted kernel, float32 then cast to the
kernel's dtype) are what the rollout engine and the Hugging Face export get; :func:`peft_adapter_tensors` /
:func:`save_peft_adapter` write the adapters as a PEFT adapter directory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = [
    "ALL_LINEAR",
    "PROJECTIONS",
    "LoraInfo",
    "adapter_bytes",
    "LoraSpec",
    "apply_lora",
    "lora_module_names",
    "merge_lora",
    "peft_adapter_config",
    "peft_adapter_tensors",
    "resolve_targets",
    "save_peft_adapter",
]

ALL_LINEAR = "all-linear"
#: The adaptable projections: (Hugging Face module suffix, the decoder submodule that holds it).
PROJECTIONS: tuple[tuple[str, str], ...] = (
    ("q_proj", "self_attn"), ("k_proj", "self_attn"), ("v_proj", "self_attn"), ("o_proj", "self_attn"),
    ("gate_proj", "mlp"), ("up_proj", "mlp"), ("down_proj", "mlp"),
)
_UNSUPPORTED = ("model.embed_tokens", "lm_head")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """LoRA settings as verl names them (``actor_rollout_ref.model.*`` / ``critic.model.*``).

    Attributes:
      rank: ``lora_rank`` ``r`` (> 0).
      alpha: ``lora_alpha``; the adapter output is scaled by ``alpha / rank``.
      target_modules: ``"all-linear"``, a regex (whole-name match), or a list of names / name suffixes.
      exclude_modules: None, a regex or a list (same matching), removed from the targets.
    """

    rank: int
    alpha: float
    target_modules: Any = ALL_LINEAR
    exclude_modules: Any = None

    @property
    def scale(self) -> float:
        """``alpha / rank`` (PEFT's ``scaling``)."""
        return float(self.alpha) / int(self.rank)


@dataclasses.dataclass(frozen=True)
class LoraInfo:
    """What a role with adapters needs beyond its states.

    Attributes:
      spec: the settings.
      targets: the adapted Hugging Face module names, in model order (``model.layers.0.self_attn.q_proj``, ...).
      base_graphdef: the model's ``nnx.GraphDef`` without adapters (the base state merges into it: the reference
        policy, the merged weights' tree).
    """

    spec: LoraSpec
    targets: tuple[str, ...]
    base_graphdef: Any


def lora_module_names(num_layers: int) -> list[str]:
    """Every adaptable Hugging Face module name of a ``num_layers`` decoder, in model order."""
    return [f"model.layers.{i}.{sub}.{name}" for i in range(num_layers) for name, sub in PROJECTIONS]


def _matches(pattern: Any, name: str) -> bool:
    """PEFT's matching (``peft.tuners.tuners_utils.check_target_module_exists``): a string is a whole-name regex,
    a list matches an equal name or a ``"." + entry`` suffix."""
    if isinstance(pattern, str):
        return re.fullmatch(pattern, name) is not None
    return any(name == p or name.endswith("." + p) for p in pattern)


def resolve_targets(spec: LoraSpec, num_layers: int, *, key: str = "actor_rollout_ref.model") -> tuple[str, ...]:
    """The Hugging Face module names ``spec`` adapts in a ``num_layers`` decoder.

    Raises:
      ValueError: one line naming ``<key>.target_modules`` / ``exclude_modules`` when the targets include the
        embedding or the LM head (not supported), or when nothing is left to adapt (lists the adaptable names).
    """
    names = lora_module_names(num_layers)
    tm, ex = spec.target_modules, spec.exclude_modules
    if tm == ALL_LINEAR:
        chosen = list(names)
    else:
        bad = [n for n in _UNSUPPORTED if _matches(tm, n)]
        if bad:
            raise ValueError(
                f"{key}.target_modules={tm!r} selects {', '.join(bad)}: LoRA on the embedding / LM head is not "
                f"supported; valid targets: {', '.join(p for p, _ in PROJECTIONS)} (or 'all-linear')")
        chosen = [n for n in names if _matches(tm, n)]
    if ex is not None:
        chosen = [n for n in chosen if not _matches(ex, n)]
    if not chosen:
        raise ValueError(
            f"{key}.target_modules={tm!r} (exclude_modules={ex!r}) selects no module of this model; adaptable "
            f"modules are model.layers.<0..{num_layers - 1}>.self_attn.{{q,k,v,o}}_proj and "
            "model.layers.<i>.mlp.{gate,up,down}_proj (or 'all-linear')")
    return tuple(chosen)


def _shapes(cfg, name: str) -> tuple[int, int, tuple, tuple]:
    """``(in, out, A names, B names)`` of projection ``name`` (logical axis names for the sharding rules)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {
        "q_proj": (h, q, ("embed", None), (None, "heads")),
        "k_proj": (h, kv, ("embed", None), (None, "kv_heads")),
        "v_proj": (h, kv, ("embed", None), (None, "kv_heads")),
        "o_proj": (q, h, ("heads", None), (None, "embed")),
        "gate_proj": (h, i, ("embed", None), (None, "mlp")),
        "up_proj": (h, i, ("embed", None), (None, "mlp")),
        "down_proj": (i, h, ("mlp", None), (None, "embed")),
    }[name]


class ScaledLoRA(nnx.LoRA):
    """:class:`flax.nnx.LoRA` (``x @ A @ B``) times PEFT's ``scaling = alpha / r``; ``x`` ``[..., in]`` ->
    ``[..., out]`` in the compute dtype."""

    def __init__(self, in_features: int, rank: int, out_features: int, *, scale: float, **kwargs):
        super().__init__(in_features, rank, out_features, **kwargs)
        self.scale = float(scale)

    def __call__(self, x: jax.Array) -> jax.Array:
        return super().__call__(x) * self.scale


def _add_adapters(model, spec: LoraSpec, targets: tuple[str, ...], rngs: nnx.Rngs) -> None:
    """Attach a :class:`ScaledLoRA` to every targeted projection of ``model`` (a Decoder), in place."""
    cfg = model.cfg
    wanted = set(targets)
    for li, block in enumerate(model.layers):
        for sub_name in ("self_attn", "mlp"):
            sub = getattr(block, sub_name)
            adapters = {}
            for name, owner in PROJECTIONS:
                if owner != sub_name or f"model.layers.{li}.{sub_name}.{name}" not in wanted:
                    continue
                fan_in, fan_out, a_names, b_names = _shapes(cfg, name)
                adapters[name] = ScaledLoRA(
                    fan_in, spec.rank, fan_out, scale=spec.scale, dtype=model.dtype, param_dtype=model.param_dtype,
                    rngs=rngs, a_metadata={"out_sharding": a_names, "eager_sharding": False},
                    b_metadata={"out_sharding": b_names, "eager_sharding": False})
            sub.lora = nnx.Dict(adapters) if adapters else None


def apply_lora(model, spec: LoraSpec, *, seed: int = 0, key: str = "actor_rollout_ref.model"):
    """Add adapters to ``model`` (a :class:`~jaxrl.models.decoder.Decoder`, changed in place) and split it.

    Args:
      model: the decoder (for a value model, its ``backbone``).
      spec: the LoRA settings; ``spec.rank`` must be > 0.
      seed: the ``A`` initialisation seed (``B`` is zero).
      key: the config section, for messages.

    Returns:
      ``(adapters, info)``: the adapter state (every ``nnx.LoRAParam``, float ``param_dtype``) and a
      :class:`LoraInfo` whose ``base_graphdef`` is ``model``'s graph before the adapters were added.

    Raises:
      ValueError: ``rank <= 0``, ``alpha <= 0``, or targets :func:`resolve_targets` refuses.
    """
    if int(spec.rank) <= 0:
        raise ValueError(f"{key}.lora_rank={spec.rank!r} must be > 0 to add adapters")
    if not float(spec.alpha) > 0:
        raise ValueError(f"{key}.lora_alpha={spec.alpha!r} must be > 0")
    targets = resolve_targets(spec, model.cfg.num_hidden_layers, key=key)
    base_graphdef = nnx.graphdef(model)
    _add_adapters(model, spec, targets, nnx.Rngs(params=seed))
    adapters = nnx.state(model, nnx.LoRAParam)
    return adapters, LoraInfo(spec=spec, targets=targets, base_graphdef=base_graphdef)


def _adapter_pairs(adapters) -> dict[tuple, tuple[jax.Array, jax.Array]]:
    """``{kernel path in the base state: (A, B)}`` from an adapter state (``.../lora/<name>/lora_{a,b}``)."""
    flat = {tuple(str(getattr(k, "key", k)) for k in path): var for path, var in nnx.to_flat_state(adapters)}
    pairs = {}
    for path, var in flat.items():
        if path[-1] != "lora_a":
            continue
        module = path[:-1]  # (..., <sub>, "lora", <name>)
        pairs[module[:-2] + (module[-1],)] = (var.get_value(), flat[module + ("lora_b",)].get_value())
    return pairs


def merge_lora(adapters, base, scale: float):
    """The base state with every adapted kernel replaced by ``W + scale * (A @ B)`` (reshaped to ``W``'s layout).

    Args:
      adapters: the adapter state (``nnx.State`` of ``nnx.LoRAParam``; ``A`` ``[in, r]``, ``B`` ``[r, out]``).
      base: the base state (``nnx.State``, the decoder's tree without adapters).
      scale: ``alpha / rank``.

    Returns:
      An ``nnx.State`` with ``base``'s tree, dtypes and metadata; the product and the sum are float32, cast back to
      each kernel's dtype. Pure: usable under ``jax.jit`` (the trainer's ``merged_params``).

    Raises:
      KeyError: an adapter whose kernel is not in ``base``.
    """
    pairs = _adapter_pairs(adapters)
    flat = []
    found = set()
    for path, var in nnx.to_flat_state(base):
        key = tuple(str(getattr(k, "key", k)) for k in path)
        if key in pairs:
            a, b = pairs[key]
            w = var.get_value()
            delta = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32)) * jnp.float32(scale)
            var = var.replace(value=(w.astype(jnp.float32) + delta.reshape(w.shape)).astype(w.dtype))
            found.add(key)
        flat.append((path, var))
    missing = sorted(set(pairs) - found)
    if missing:
        raise KeyError(f"adapters without a base kernel: {['.'.join(m) for m in missing[:5]]}")
    return nnx.from_flat_state(flat)


# ------------------------------------------------------------------------------------------------ PEFT format
def peft_adapter_tensors(adapters, targets: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The adapters under PEFT's names and layouts: ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and
    ``...lora_B.weight`` ``[out, r]`` (``A.T`` / ``B.T``), in the adapters' dtype, in ``targets`` order.

    Raises:
      ValueError: ``targets`` and the adapter state name different modules.
    """
    pairs = _adapter_pairs(adapters)
    by_name = {}
    for path, (a, b) in pairs.items():  # path = ("layers", i, sub, name)
        by_name[f"model.{path[0]}.{path[1]}.{path[2]}.{path[3]}"] = (a, b)
    if set(by_name) != set(targets):
        raise ValueError(f"adapter state and targets differ: {sorted(set(by_name) ^ set(targets))[:5]}")
    out: dict[str, np.ndarray] = {}
    for name in targets:
        a, b = (np.asarray(jax.device_get(x)) for x in by_name[name])
        out[f"base_model.model.{name}.lora_A.weight"] = np.ascontiguousarray(a.T)
        out[f"base_model.model.{name}.lora_B.weight"] = np.ascontiguousarray(b.T)
    return out


def _short_targets(targets: tuple[str, ...], num_layers: int) -> list[str]:
    """``target_modules`` for the adapter config: projection names when every layer has the same set, else the
    full module names (PEFT matches both)."""
    per_layer = {i: {t.rsplit(".", 1)[1] for t in targets if t.startswith(f"model.layers.{i}.")}
                 for i in range(num_layers)}
    first = per_layer[0]
    if first and all(s == first for s in per_layer.values()):
        return [p for p, _ in PROJECTIONS if p in first]
    return list(targets)


def peft_adapter_config(spec: LoraSpec, targets: tuple[str, ...], *, num_layers: int,
                        base_model_name_or_path: str | None) -> dict:
    """``adapter_config.json`` of a LoRA adapter as PEFT's ``LoraConfig`` writes it (``CAUSAL_LM``, no dropout,
    no bias, no rsLoRA / DoRA; ``target_modules`` the adapted projections)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(spec.rank), "lora_alpha": float(spec.alpha),
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "target_modules": _short_targets(targets, num_layers), "exclude_modules": None,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
        "base_model_name_or_path": base_model_name_or_path, "revision": None,
    }


def save_peft_adapter(adapters, info: LoraInfo, out_dir, *, num_layers: int,
                      base_model_name_or_path: str | None = None) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` to ``out_dir`` (created): what
    ``peft.PeftModel.from_pretrained(base_model, out_dir)`` loads onto the base model in ``transformers``.

    Returns:
      ``out_dir`` as a Path.
    """
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = peft_adapter_tensors(adapters, info.targets)
    config = peft_adapter_config(info.spec, info.targets, num_layers=num_layers,
                                 base_model_name_or_path=base_model_name_or_path)
    with open(out / "adapter_config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


def adapter_bytes(adapters) -> int:
    """Bytes of an adapter state's arrays."""
    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(adapters)))
