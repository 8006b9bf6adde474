"""Train layout -> inference layout: a table of rules built from small operations, and the resharding itself.

A :class:`Plan` is a list of :class:`Rule` s. Each rule names one target tensor, the source tensors it is made
from, the :class:`Step` s (small operations from :mod:`sharding.ops`: transpose, reshape, fuse q|k|v or gate|up
per tensor-parallel rank, stack layers, pad, cast, ...) that turn the sources into it, and the target's
sharding. :func:`build_plan` writes the table for a target engine (:class:`TargetSpec`); :func:`validate_plan`
rejects a table that leaves a source unused or a target unproduced. :class:`Translator` runs it.

Source names are the dotted paths of the trainer's ``nnx.State`` (``"embed_tokens"``,
``"layers.3.self_attn.q_proj"``, ``"layers.3.input_layernorm.scale"``, ``"norm.scale"``, ``"lm_head"``); layouts
are those of ``jaxrl.models.decoder`` (``q_proj [E, nH, D]``, ``o_proj [nH, D, E]``, ``gate_proj [E, I]``, ...).

Targets
-------
``"jax"``: the embedded sampler's parameters - the same tree and names as the source ``nnx.State`` (``sync``
returns an ``nnx.State`` when given one), re-laid-out by logical-axis rules (default
:data:`~sharding.rules.TENSOR_PARALLEL_RULES`) or explicit shardings, on the same devices (colocated) or on other
devices (split placement); optional dtype cast.

``"vllm"``: vLLM's parameter names and fused tensor-parallel layouts (``vllm/model_executor/layers/linear.py``,
``vocab_parallel_embedding.py``, ``models/llama.py``), torch ``[out, in]`` layout:

================================================  ========================  ===========================
name                                              global shape              sharded (rank r = device r)
================================================  ========================  ===========================
``model.embed_tokens.weight``                     ``[Vp, E]``               rows (vocab)
``lm_head.weight`` (untied models only)           ``[Vp, E]``               rows (vocab)
``model.norm.weight``                             ``[E]``                   replicated
``model.layers.{i}.input_layernorm.weight``       ``[E]``                   replicated
``model.layers.{i}.post_attention_layernorm.weight`` ``[E]``                replicated
``model.layers.{i}.self_attn.qkv_proj.weight``    ``[tp*(qh+2kh)*D, E]``    rows: rank r's q|k|v block
``model.layers.{i}.self_attn.qkv_proj.bias``      ``[tp*(qh+2kh)*D]``       (Qwen2) as the weight
``model.layers.{i}.self_attn.o_proj.weight``      ``[E, nH*D]``             columns (row-parallel)
``model.layers.{i}.self_attn.{q,k}_norm.weight``  ``[D]``                   (Qwen3) replicated
``model.layers.{i}.mlp.gate_up_proj.weight``      ``[2I, E]``               rows: rank r's gate|up block
``model.layers.{i}.mlp.down_proj.weight``         ``[E, I]``                columns (row-parallel)
================================================  ========================  ===========================

Each value is one global ``jax.Array`` on a ``("tensor",)`` mesh of ``tp`` devices, sharded so that device ``r``
of the mesh holds exactly rank ``r``'s shard (:func:`rank_shards` lists them in rank order). ``qh, kh`` are
vLLM's per-rank head counts (:func:`sharding.ops.kv_layout`); when ``tp > nKV`` each rank holds a copy of kv head
``r // (tp/nKV)``, so the fused global tensor is larger than q+k+v. ``Vp`` is the vocabulary padded with zero
rows to a multiple of ``vocab_pad_multiple`` (vLLM's ``DEFAULT_VOCAB_PADDING_SIZE`` = 64). Tied models have no
``lm_head.weight`` (vLLM ties it to the embedding).

``"hf"``: Hugging Face checkpoint format - what ``transformers`` state dicts hold and what vLLM's
``model.load_weights`` / ``Worker.reload_weights(is_checkpoint_format=True)`` consume: unfused, unpadded, torch
``[out, in]`` layout, every tensor whole (``model.embed_tokens.weight [V, E]``,
``model.layers.{i}.self_attn.{q,k,v}_proj.weight [n*D, E]`` (+ ``.bias [n*D]`` for Qwen2),
``model.layers.{i}.self_attn.o_proj.weight [E, nH*D]``, ``model.layers.{i}.self_attn.{q,k}_norm.weight [D]``
(Qwen3), ``model.layers.{i}.mlp.{gate,up}_proj.weight [I, E]``, ``model.layers.{i}.mlp.down_proj.weight [E, I]``,
the layer norms, ``model.norm.weight``, ``lm_head.weight [V, E]`` (untied only)), replicated over the target
mesh - normally one device, the inference engine's rank-0 device, from which the engine's own weight loaders cut
their tensor-parallel shards (``stacked_params_mapping`` in vLLM's ``models/{llama,qwen2,qwen3}.py``). The names
equal ``jaxrl.models.hf.to_hf_tensors``'. Consumed zero-copy through DLPack by ``jaxrl.rollout.vllm_engine``.

``"jetstream"``: a MaxText parameter tree (what JetStream's MaxText engine serves), scanned layers with the
layer axis at position 1 (``param_scan_axis=1``), as written by MaxText's ``llama_or_mistral_ckpt.py`` and read
by ``integration/tunix/weight_mapping/{llama3,qwen3}.py`` (AI-Hypercomputer/maxtext)::

    params.token_embedder.embedding                              [V, E]       (vocab, embed)
    params.decoder.decoder_norm.scale                            [E]          (embed,)
    params.decoder.logits_dense.kernel        (untied only)      [E, V]       (embed, vocab)
    params.decoder.layers.pre_self_attention_layer_norm.scale    [E, L]       (embed, layers)
    params.decoder.layers.post_self_attention_layer_norm.scale   [E, L]
    params.decoder.layers.self_attention.query.kernel            [E, L, nH, D] (embed, layers, heads, head_dim)
    params.decoder.layers.self_attention.{key,value}.kernel      [E, L, nKV, D]
    params.decoder.layers.self_attention.out.kernel              [nH, L, D, E] (heads, layers, head_dim, embed)
    params.decoder.layers.self_attention.{query,key,value}.bias  [n, L, D]    (Qwen2)
    params.decoder.layers.self_attention.{query,key}_norm.scale  [D, L]       (Qwen3)
    params.decoder.layers.mlp.wi_0.kernel / wi_1.kernel          [E, L, I]    (embed, layers, mlp)  gate / up
    params.decoder.layers.mlp.wo.kernel                          [I, L, E]    (mlp, layers, embed)

``sync`` returns it as nested dicts. MaxText's Llama conversion also divides the query kernel by
``sqrt(head_dim)`` and may permute q/k to the interleaved RoPE layout; ``TargetSpec(scale_query=True,
interleave_rope=True)`` does the same (off by default).

Resharding and bytes
--------------------
``Translator.sync`` has two ways to move data (``Translator(plan, transfer=...)``):

* ``"collective"`` - colocated placement (the target mesh lists the source devices in the same order): all rules
  in one ``jax.jit`` over the source arrays with the target ``out_shardings``; XLA moves the shards with its
  collectives (the fast path on GPU/TPU interconnects).
* ``"pieces"`` - any placement, including disjoint device sets (split placement): rules that change the layout run
  in one ``jax.jit`` on the source devices into a *stage* sharding that spreads each target tensor over them
  (no full copy per device unless no mesh axis divides any of its dims; elementwise casts stay in place; plain
  copies skip this step), then every target
  shard is assembled on its device from device-to-device copies of exactly the pieces it needs (cut on the source
  devices, one batched ``jax.device_put``, concatenated on the target device). Nothing passes through the host.
  The pieces path moves the shards addressable by this process (single-controller, or split placement within a
  host); across hosts use colocated placement (collectives).
  ``jax.device_put`` alone is not used for this because it gathers the whole array through the host whenever the
  target slices do not coincide with source shards.
* ``"auto"`` (default) picks ``"collective"`` when colocated with the same device order, else ``"pieces"``.

So no device ever holds a full copy of a tensor unless its target sharding is replicated;
:meth:`Translator.check_placement` verifies it from the compiled (SPMD-partitioned) programs.

``bytes_moved`` is the net movement: for every target tensor and every target device, the bytes of its shard whose
source elements were not on that device before the sync (replicated targets count once per device; zero padding is
created in place and not counted; bytes at the target dtype). It is computed exactly by tracing element indices
through the rule's steps (all steps but cast/scale only move elements), once per source layout. Intermediate hops
inside XLA's collectives are not counted, so it is a lower bound of the wire traffic and exact for one-hop
reshards.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding import ops
from sharding.rules import TENSOR_PARALLEL_RULES, Rules, logical_to_pspec, variable_names

__all__ = [
    "KINDS",
    "ModelInfo",
    "Plan",
    "Rule",
    "RuleCheck",
    "SourceParam",
    "Step",
    "SyncReport",
    "TargetSpec",
    "Translator",
    "build_plan",
    "describe_source",
    "rank_shards",
    "validate_plan",
]

KINDS: tuple[str, ...] = ("jax", "hf", "vllm", "jetstream")


# ----------------------------------------------------------------------------------------------- descriptions
@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """The architecture numbers a translation needs.

    Attributes:
        num_heads, num_kv_heads, head_dim: ``nH``, ``nKV``, ``D``.
        hidden, intermediate: ``E``, ``I``.
        num_layers: ``L``.
        tie_word_embeddings: the LM head is the embedding (no ``lm_head`` source).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    num_layers: int
    tie_word_embeddings: bool

    def __post_init__(self) -> None:
        for f in ("num_heads", "num_kv_heads", "head_dim", "hidden", "intermediate", "num_layers"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"ModelInfo.{f}={v!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")

    @classmethod
    def from_config(cls, cfg: Any) -> "ModelInfo":
        """From an object or dict with Hugging Face field names (``num_attention_heads``, ``num_key_value_heads``,
        ``head_dim``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``tie_word_embeddings``),
        e.g. ``jaxrl.models.ModelConfig`` or a ``config.json`` dict.

        Raises:
            ValueError: a required field is missing.
        """
        get = (lambda k: cfg.get(k)) if isinstance(cfg, Mapping) else (lambda k: getattr(cfg, k, None))
        keys = ("num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size", "num_hidden_layers")
        missing = [k for k in keys if get(k) is None]
        if missing:
            raise ValueError(f"model config lacks {missing}")
        heads = int(get("num_attention_heads"))
        head_dim = get("head_dim") or int(get("hidden_size")) // heads
        return cls(
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads")),
            head_dim=int(head_dim),
            hidden=int(get("hidden_size")),
            intermediate=int(get("intermediate_size")),
            num_layers=int(get("num_hidden_layers")),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
        )


class SourceParam(NamedTuple):
    """Shape, dtype and logical dimension names (or None) of one source tensor."""

    shape: tuple[int, ...]
    dtype: np.dtype
    names: tuple[str | None, ...] | None = None


def _path_name(path: tuple) -> str:
    return ".".join(str(getattr(k, "key", k)) for k in path)


def _flat_state(state: nnx.State) -> list[tuple[str, tuple, Any]]:
    return [(_path_name(path), path, leaf) for path, leaf in nnx.to_flat_state(state)]


def describe_source(source: Any) -> dict[str, SourceParam]:
    """``{dotted name: SourceParam}`` for an ``nnx.State`` (names from the Variables' ``out_sharding`` metadata) or
    a dict of arrays / ``jax.ShapeDtypeStruct`` / :class:`SourceParam`.

    Raises:
        ValueError: an unsupported source type or value.
    """
    out: dict[str, SourceParam] = {}
    if isinstance(source, nnx.State):
        for name, _, leaf in _flat_state(source):
            names = variable_names(leaf) if isinstance(leaf, nnx.Variable) else None
            out[name] = SourceParam(tuple(leaf.shape), np.dtype(leaf.dtype), names)
        return out
    if isinstance(source, Mapping):
        for name, v in source.items():
            if isinstance(v, SourceParam):
                out[str(name)] = SourceParam(tuple(v.shape), np.dtype(v.dtype), v.names)
            elif hasattr(v, "shape") and hasattr(v, "dtype"):
                out[str(name)] = SourceParam(tuple(v.shape), np.dtype(v.dtype), None)
            else:
                raise ValueError(f"source entry {name!r} is a {type(v).__name__}; expected an array, "
                                 "jax.ShapeDtypeStruct or SourceParam")
        return out
    raise ValueError(f"source must be an nnx.State or a dict name -> array; got {type(source).__name__}")


# ----------------------------------------------------------------------------------------------- steps and rules
@dataclasses.dataclass(frozen=True)
class Step:
    """One operation of a rule: ``fn(*arrays, **kwargs)`` over the current tuple of arrays (or, with ``each``,
    ``fn(x, **kwargs)`` on every array). ``moves_only=False`` marks value changes (cast, scale), which element
    tracing skips; ``trace_kwargs`` override kwargs while tracing (padding fills with -1 = "no source")."""

    name: str
    fn: Callable
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    each: bool = False
    moves_only: bool = True
    trace_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def _run(self, xs: tuple, kwargs: Mapping[str, Any]) -> tuple:
        if self.each:
            return tuple(self.fn(x, **kwargs) for x in xs)
        out = self.fn(*xs, **kwargs)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def __call__(self, xs: tuple) -> tuple:
        return self._run(xs, self.kwargs)

    def trace(self, xs: tuple) -> tuple:
        """Apply to integer element-id arrays (numpy): value changes are skipped."""
        if not self.moves_only:
            return xs
        return self._run(xs, {**self.kwargs, **self.trace_kwargs})

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.kwargs.items())
        return f"{'each ' if self.each else ''}{self.name}({args})"


def _transpose(perm, each=True):
    return Step("transpose", ops.transpose, {"perm": tuple(perm)}, each=each)


def _reshape(shape, each=True):
    return Step("reshape", ops.reshape, {"shape": tuple(shape)}, each=each)


def _cast(dtype):
    return Step("cast", ops.cast, {"dtype": np.dtype(dtype)}, each=True, moves_only=False)


def _stack_layers(*xs, axis):
    return ops.stack_layers(xs, axis=axis)


def _pad(new_size, axis):
    return Step("pad_axis", ops.pad_axis, {"new_size": int(new_size), "axis": axis}, each=True,
                trace_kwargs={"fill": -1})


@dataclasses.dataclass(frozen=True)
class Rule:
    """One target tensor: ``target <- steps(sources)`` placed with ``sharding``."""

    target: str
    sources: tuple[str, ...]
    steps: tuple[Step, ...]
    sharding: NamedSharding

    def apply(self, *arrays):
        """Run the steps on the source arrays (jax or numpy); returns the single target array.

        Raises:
            ValueError: the steps do not end in exactly one array.
        """
        xs = tuple(arrays)
        for s in self.steps:
            xs = s(xs)
        if len(xs) != 1:
            raise ValueError(f"rule for {self.target!r} ends with {len(xs)} arrays; its steps must combine to one")
        return xs[0]

    def trace(self, *ids):
        """:meth:`apply` on numpy element-id arrays (value changes skipped)."""
        xs = tuple(ids)
        for s in self.steps:
            xs = s.trace(xs)
        return xs[0]

    def __str__(self) -> str:
        steps = " | ".join(str(s) for s in self.steps) or "copy"
        return f"{self.target} <- {', '.join(self.sources)} : {steps} @ {self.sharding.spec}"


# ----------------------------------------------------------------------------------------------- target spec
@dataclasses.dataclass(frozen=True)
class TargetSpec:
    """Where and how the inference side wants the weights.

    Attributes:
        kind: ``"jax"`` | ``"hf"`` | ``"vllm"`` | ``"jetstream"``.
        mesh: the target mesh. For ``"vllm"`` it must have a ``"tensor"`` axis of size ``tensor_parallel`` and
            no other axis larger than 1.
        devices: instead of ``mesh``: the target devices; a ``("tensor",)`` mesh over them is built.
        tensor_parallel: TP size; defaults to the mesh's ``"tensor"`` size (vLLM: the number of devices).
        dtype: target dtype (e.g. ``jnp.bfloat16``); None keeps each source dtype.
        rules: logical-axis rules for ``"jax"`` / ``"jetstream"`` shardings (default
            :data:`~sharding.rules.TENSOR_PARALLEL_RULES`); dims not divisible by their axes are replicated.
        shardings: ``"jax"`` only: explicit target shardings, either ``{source name: Sharding}`` or a tree like
            the source state (e.g. :func:`sharding.rules.param_shardings` output); overrides ``rules``.
        vocab_pad_multiple: ``"vllm"``: pad the vocabulary rows to a multiple of this (vLLM pads to 64).
        scale_query: ``"jetstream"``: multiply the query kernel (and bias) by ``1/sqrt(head_dim)``.
        interleave_rope: ``"jetstream"``: permute q/k head_dim from rotate-half to interleaved RoPE order.

    Raises:
        ValueError: unknown kind, bad sizes, or neither/both of ``mesh`` and ``devices``.
    """

    kind: str
    mesh: Mesh | None = None
    devices: Sequence | None = None
    tensor_parallel: int | None = None
    dtype: Any = None
    rules: Rules | None = None
    shardings: Any = None
    vocab_pad_multiple: int = 64
    scale_query: bool = False
    interleave_rope: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"TargetSpec.kind={self.kind!r}; valid kinds: {list(KINDS)}")
        if (self.mesh is None) == (self.devices is None):
            raise ValueError("TargetSpec needs exactly one of mesh= or devices=")
        tp = self.tensor_parallel
        if tp is not None and (isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or tp < 1):
            raise ValueError(f"TargetSpec.tensor_parallel={tp!r} must be a positive int or None")
        vp = self.vocab_pad_multiple
        if isinstance(vp, bool) or not isinstance(vp, (int, np.integer)) or vp < 1:
            raise ValueError(f"TargetSpec.vocab_pad_multiple={vp!r} must be a positive int")
        if self.shardings is not None and self.kind != "jax":
            raise ValueError("TargetSpec.shardings is only meaningful for kind='jax'")
        if (self.scale_query or self.interleave_rope) and self.kind != "jetstream":
            raise ValueError("scale_query / interleave_rope only apply to kind='jetstream'")

    def resolve_mesh(self) -> tuple[Mesh, int]:
        """``(target mesh, tensor-parallel size)``.

        Raises:
            ValueError: inconsistent ``tensor_parallel`` / mesh / devices.
        """
        if self.mesh is not None:
            mesh = self.mesh
        else:
            devs = list(np.asarray(self.devices, dtype=object).ravel())
            if not devs:
                raise ValueError("TargetSpec.devices is empty")
            mesh = Mesh(np.array(devs, dtype=object), ("tensor",))
        mesh_tp = mesh.shape.get("tensor", 1)
        tp = self.tensor_parallel if self.tensor_parallel is not None else mesh_tp
        if tp != mesh_tp:
            raise ValueError(f"tensor_parallel={tp} but the target mesh's 'tensor' axis has size {mesh_tp} "
                             f"(mesh {dict(mesh.shape)})")
        if self.kind == "vllm" and mesh.devices.size != tp:
            raise ValueError(f"a vllm target needs one device per tensor-parallel rank: tp={tp} but the mesh has "
                             f"{mesh.devices.size} devices ({dict(mesh.shape)})")
        return mesh, int(tp)


# ----------------------------------------------------------------------------------------------- plan
@dataclasses.dataclass(frozen=True)
class Plan:
    """The translation table for one source layout and one target.

    Attributes:
        kind: the target kind.
        rules: the rules, one per target tensor.
        expected: target name -> ``jax.ShapeDtypeStruct`` the target engine expects (derived from the model
            numbers independently of the rules; :func:`validate_plan` checks the rules against it).
        source: source name -> :class:`SourceParam` the plan was built for.
        target: the :class:`TargetSpec`.
        mesh: the resolved target mesh.
    """

    kind: str
    rules: tuple[Rule, ...]
    expected: Mapping[str, jax.ShapeDtypeStruct]
    source: Mapping[str, SourceParam]
    target: TargetSpec
    mesh: Mesh

    def __str__(self) -> str:
        return "\n".join([f"Plan[{self.kind}] {len(self.rules)} rules on mesh {dict(self.mesh.shape)}"]
                         + [f"  {r}" for r in self.rules])


def validate_plan(plan: Plan, source: Any = None) -> None:
    """Check that ``plan`` turns exactly ``source`` into exactly the expected targets.

    Args:
        plan: from :func:`build_plan` (or hand-edited).
        source: a state / dict / description to check against; default ``plan.source``.

    Raises:
        ValueError: listing every problem: an empty rule set; a rule reading a source that does not exist; a
            source no rule reads; a target produced twice, not expected, or expected but not produced; a rule
            whose output shape/dtype differs from the expected one; a sharding whose rank exceeds the target's.
    """
    src = plan.source if source is None else (source if _is_description(source) else describe_source(source))
    problems: list[str] = []
    if not plan.rules:
        problems.append("the plan has no rules (an empty translation is never valid)")
    read = {s for r in plan.rules for s in r.sources}
    missing = sorted(read - set(src))
    if missing:
        problems.append(f"rules read sources that do not exist: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    unused = sorted(set(src) - read)
    if unused:
        problems.append(f"source tensors no rule uses: {unused[:8]}{' ...' if len(unused) > 8 else ''}")
    targets = [r.target for r in plan.rules]
    dupes = sorted({t for t in targets if targets.count(t) > 1})
    if dupes:
        problems.append(f"targets produced more than once: {dupes}")
    unproduced = sorted(set(plan.expected) - set(targets))
    if unproduced:
        problems.append(f"expected targets no rule produces: {unproduced[:8]}{' ...' if len(unproduced) > 8 else ''}")
    extra = sorted(set(targets) - set(plan.expected))
    if extra:
        problems.append(f"rules produce unexpected targets: {extra[:8]}")
    if not missing:
        for r in plan.rules:
            if r.target not in plan.expected:
                continue
            args = [jax.ShapeDtypeStruct(src[s].shape, src[s].dtype) for s in r.sources]
            try:
                out = jax.eval_shape(r.apply, *args)
            except Exception as e:  # noqa: BLE001 - reported with the rule
                problems.append(f"rule {r.target!r} fails on its sources' shapes: {e}")
                continue
            want = plan.expected[r.target]
            if (tuple(out.shape), np.dtype(out.dtype)) != (tuple(want.shape), np.dtype(want.dtype)):
                problems.append(f"rule {r.target!r} makes {tuple(out.shape)} {np.dtype(out.dtype)}, expected "
                                f"{tuple(want.shape)} {np.dtype(want.dtype)}")
            if len(r.sharding.spec) > len(want.shape):
                problems.append(f"rule {r.target!r}: sharding {r.sharding.spec} has more dims than {want.shape}")
    if problems:
        raise ValueError(f"invalid {plan.kind} translation plan:\n  - " + "\n  - ".join(problems))


def _is_description(x: Any) -> bool:
    return isinstance(x, Mapping) and all(isinstance(v, SourceParam) for v in x.values())


def _named(mesh: Mesh, *spec) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(*spec))


def _dtype(target: TargetSpec, src_dtype) -> np.dtype:
    return np.dtype(target.dtype) if target.dtype is not None else np.dtype(src_dtype)


def _with_cast(steps: list[Step], src_dtype, target: TargetSpec) -> tuple[Step, ...]:
    if target.dtype is not None and np.dtype(target.dtype) != np.dtype(src_dtype):
        steps = steps + [_cast(target.dtype)]
    return tuple(steps)


# ----------------------------------------------------------------------------------------------- builders
def _explicit_shardings(shardings: Any) -> dict[str, jax.sharding.Sharding]:
    if isinstance(shardings, nnx.State):
        out = {}
        for name, _, leaf in _flat_state(shardings):
            out[name] = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        return out
    if isinstance(shardings, Mapping):
        return {str(k): v for k, v in shardings.items()}
    raise ValueError(f"TargetSpec.shardings must be a dict name -> Sharding or an nnx.State of shardings; "
                     f"got {type(shardings).__name__}")


def _build_jax(src: Mapping[str, SourceParam], target: TargetSpec, mesh: Mesh) -> tuple[list[Rule], dict]:
    rules_table = target.rules if target.rules is not None else TENSOR_PARALLEL_RULES
    explicit = _explicit_shardings(target.shardings) if target.shardings is not None else None
    rules, expected = [], {}
    for name, p in src.items():
        if explicit is not None:
            if name not in explicit:
                raise ValueError(f"TargetSpec.shardings has no entry for source {name!r}")
            sh = explicit[name]
            if not isinstance(sh, NamedSharding):
                raise ValueError(f"TargetSpec.shardings[{name!r}] is a {type(sh).__name__}; use a NamedSharding")
        elif p.names is not None:
            sh = NamedSharding(mesh, logical_to_pspec(p.names, rules_table, mesh, p.shape))
        else:
            sh = _named(mesh)
        rules.append(Rule(name, (name,), _with_cast([], p.dtype, target), sh))
        expected[name] = jax.ShapeDtypeStruct(p.shape, _dtype(target, p.dtype))
    return rules, expected


def _src_dtype(src, name):
    return src[name].dtype if name in src else np.dtype(np.float32)


def _build_vllm(src, target: TargetSpec, mesh: Mesh, tp: int, info: ModelInfo) -> tuple[list[Rule], dict]:
    e, i, d = info.hidden, info.intermediate, info.head_dim
    nh, nkv = info.num_heads, info.num_kv_heads
    qh, kh, _ = ops.kv_layout(nh, nkv, tp)
    if i % tp:
        raise ValueError(f"tensor-parallel size {tp} must divide intermediate_size={i}")
    if "embed_tokens" not in src:
        raise ValueError("source has no 'embed_tokens'; a vllm plan needs the decoder's parameter names")
    vocab = src["embed_tokens"].shape[0]
    m = int(target.vocab_pad_multiple)
    vp = -(-vocab // m) * m
    if vp % tp:
        raise ValueError(f"padded vocabulary {vp} (vocab {vocab}, vocab_pad_multiple {m}) is not divisible by "
                         f"tp={tp}; choose a vocab_pad_multiple that is a multiple of {tp}")
    rows, cols, rep = _named(mesh, "tensor", None), _named(mesh, None, "tensor"), _named(mesh)
    rvec = _named(mesh, "tensor")
    has_bias = "layers.0.self_attn.q_bias" in src
    has_qk_norm = "layers.0.self_attn.q_norm.scale" in src
    rules: list[Rule] = []
    expected: dict[str, jax.ShapeDtypeStruct] = {}

    def add(tname, sources, steps, sharding, shape):
        dt = _dtype(target, _src_dtype(src, sources[0]))
        rules.append(Rule(tname, tuple(sources), _with_cast(steps, _src_dtype(src, sources[0]), target), sharding))
        expected[tname] = jax.ShapeDtypeStruct(tuple(shape), dt)

    add("model.embed_tokens.weight", ["embed_tokens"], [_pad(vp, 0)], rows, (vp, e))
    if not info.tie_word_embeddings:
        add("lm_head.weight", ["lm_head"], [_transpose((1, 0)), _pad(vp, 0)], rows, (vp, e))
    add("model.norm.weight", ["norm.scale"], [], rep, (e,))
    fuse_qkv = Step("fuse_qkv_per_rank", ops.fuse_qkv_per_rank, {"num_heads": nh, "num_kv_heads": nkv, "tp": tp})
    fuse_gu = Step("fuse_gate_up_per_rank", ops.fuse_gate_up_per_rank, {"tp": tp})
    qkv_rows = tp * (qh + 2 * kh) * d
    for li in range(info.num_layers):
        s, t = f"layers.{li}.", f"model.layers.{li}."
        add(t + "input_layernorm.weight", [s + "input_layernorm.scale"], [], rep, (e,))
        add(t + "post_attention_layernorm.weight", [s + "post_attention_layernorm.scale"], [], rep, (e,))
        a = s + "self_attn."
        # [E, n, D] -> HF [n*D, E], then fuse per rank.
        add(t + "self_attn.qkv_proj.weight", [a + "q_proj", a + "k_proj", a + "v_proj"],
            [_reshape((e, -1)), _transpose((1, 0)), fuse_qkv], rows, (qkv_rows, e))
        if has_bias:
            add(t + "self_attn.qkv_proj.bias", [a + "q_bias", a + "k_bias", a + "v_bias"],
                [_reshape((-1,)), fuse_qkv], rvec, (qkv_rows,))
        # [nH, D, E] -> HF [E, nH*D]
        add(t + "self_attn.o_proj.weight", [a + "o_proj"], [_reshape((nh * d, e)), _transpose((1, 0))], cols,
            (e, nh * d))
        if has_qk_norm:
            add(t + "self_attn.q_norm.weight", [a + "q_norm.scale"], [], rep, (d,))
            add(t + "self_attn.k_norm.weight", [a + "k_norm.scale"], [], rep, (d,))
        mm = s + "mlp."
        add(t + "mlp.gate_up_proj.weight", [mm + "gate_proj", mm + "up_proj"], [_transpose((1, 0)), fuse_gu], rows,
            (2 * i, e))
        add(t + "mlp.down_proj.weight", [mm + "down_proj"], [_transpose((1, 0))], cols, (e, i))
    return rules, expected


def _build_hf(src, target: TargetSpec, mesh: Mesh, info: ModelInfo) -> tuple[list[Rule], dict]:
    e, i, d = info.hidden, info.intermediate, info.head_dim
    nh, nkv = info.num_heads, info.num_kv_heads
    if "embed_tokens" not in src:
        raise ValueError("source has no 'embed_tokens'; an hf plan needs the decoder's parameter names")
    vocab = src["embed_tokens"].shape[0]
    rep = _named(mesh)
    has_bias = "layers.0.self_attn.q_bias" in src
    has_qk_norm = "layers.0.self_attn.q_norm.scale" in src
    rules: list[Rule] = []
    expected: dict[str, jax.ShapeDtypeStruct] = {}

    def add(tname, source, steps, shape):
        dt = _dtype(target, _src_dtype(src, source))
        rules.append(Rule(tname, (source,), _with_cast(steps, _src_dtype(src, source), target), rep))
        expected[tname] = jax.ShapeDtypeStruct(tuple(shape), dt)

    add("model.embed_tokens.weight", "embed_tokens", [], (vocab, e))
    for li in range(info.num_layers):
        s, t = f"layers.{li}.", f"model.layers.{li}."
        add(t + "input_layernorm.weight", s + "input_layernorm.scale", [], (e,))
        add(t + "post_attention_layernorm.weight", s + "post_attention_layernorm.scale", [], (e,))
        for name, n in (("q", nh), ("k", nkv), ("v", nkv)):
            # ours [E, n, D] -> HF [n*D, E]
            add(t + f"self_attn.{name}_proj.weight", s + f"self_attn.{name}_proj",
                [_reshape((e, n * d)), _transpose((1, 0))], (n * d, e))
            if has_bias:
                add(t + f"self_attn.{name}_proj.bias", s + f"self_attn.{name}_bias", [_reshape((n * d,))], (n * d,))
        # ours [nH, D, E] -> HF [E, nH*D]
        add(t + "self_attn.o_proj.weight", s + "self_attn.o_proj", [_reshape((nh * d, e)), _transpose((1, 0))],
            (e, nh * d))
        if has_qk_norm:
            add(t + "self_attn.q_norm.weight", s + "self_attn.q_norm.scale", [], (d,))
            add(t + "self_attn.k_norm.weight", s + "self_attn.k_norm.scale", [], (d,))
        for name in ("gate", "up"):
            add(t + f"mlp.{name}_proj.weight", s + f"mlp.{name}_proj", [_transpose((1, 0))], (i, e))
        add(t + "mlp.down_proj.weight", s + "mlp.down_proj", [_transpose((1, 0))], (e, i))
    add("model.norm.weight", "norm.scale", [], (e,))
    if not info.tie_word_embeddings:
        add("lm_head.weight", "lm_head", [_transpose((1, 0))], (vocab, e))
    return rules, expected


def _build_jetstream(src, target: TargetSpec, mesh: Mesh, info: ModelInfo) -> tuple[list[Rule], dict]:
    rules_table = target.rules if target.rules is not None else TENSOR_PARALLEL_RULES
    e, i, d, n_l = info.hidden, info.intermediate, info.head_dim, info.num_layers
    nh, nkv = info.num_heads, info.num_kv_heads
    if "embed_tokens" not in src:
        raise ValueError("source has no 'embed_tokens'; a jetstream plan needs the decoder's parameter names")
    vocab = src["embed_tokens"].shape[0]
    has_bias = "layers.0.self_attn.q_bias" in src
    has_qk_norm = "layers.0.self_attn.q_norm.scale" in src
    if target.scale_query and has_qk_norm:
        raise ValueError("scale_query=True with q/k-norm (Qwen3) would be undone by the norm; MaxText does not "
                         "pre-scale Qwen3 queries - leave scale_query=False")
    rules: list[Rule] = []
    expected: dict[str, jax.ShapeDtypeStruct] = {}

    def add(tname, sources, steps, names, shape):
        dt = _dtype(target, _src_dtype(src, sources[0]))
        sh = NamedSharding(mesh, logical_to_pspec(names, rules_table, mesh, shape))
        rules.append(Rule(tname, tuple(sources), _with_cast(steps, _src_dtype(src, sources[0]), target), sh))
        expected[tname] = jax.ShapeDtypeStruct(tuple(shape), dt)

    def stack(axis=1):
        return Step("stack_layers", _stack_layers, {"axis": axis})

    def layers(suffix):
        return [f"layers.{li}.{suffix}" for li in range(n_l)]

    qscale = [Step("scale", ops.scale, {"factor": 1.0 / math.sqrt(d)}, each=True, moves_only=False)] \
        if target.scale_query else []

    def rope(axis=-1):
        return [Step("rope_halves_to_interleaved", ops.rope_halves_to_interleaved, {"axis": axis}, each=True)] \
            if target.interleave_rope else []

    p, dec, lay = "params.", "params.decoder.", "params.decoder.layers."
    add(p + "token_embedder.embedding", ["embed_tokens"], [], ("vocab", "embed"), (vocab, e))
    add(dec + "decoder_norm.scale", ["norm.scale"], [], ("embed",), (e,))
    if not info.tie_word_embeddings:
        add(dec + "logits_dense.kernel", ["lm_head"], [], ("embed", "vocab"), (e, vocab))
    add(lay + "pre_self_attention_layer_norm.scale", layers("input_layernorm.scale"), [stack()], ("embed", "layers"),
        (e, n_l))
    add(lay + "post_self_attention_layer_norm.scale", layers("post_attention_layernorm.scale"), [stack()],
        ("embed", "layers"), (e, n_l))
    sa = lay + "self_attention."
    add(sa + "query.kernel", layers("self_attn.q_proj"), rope() + qscale + [stack()],
        ("embed", "layers", "heads", "head_dim"), (e, n_l, nh, d))
    add(sa + "key.kernel", layers("self_attn.k_proj"), rope() + [stack()], ("embed", "layers", "kv_heads", "head_dim"),
        (e, n_l, nkv, d))
    add(sa + "value.kernel", layers("self_attn.v_proj"), [stack()], ("embed", "layers", "kv_heads", "head_dim"),
        (e, n_l, nkv, d))
    add(sa + "out.kernel", layers("self_attn.o_proj"), [stack()], ("heads", "layers", "head_dim", "embed"),
        (nh, n_l, d, e))
    if has_bias:
        add(sa + "query.bias", layers("self_attn.q_bias"), rope() + qscale + [stack()], ("heads", "layers", "head_dim"),
            (nh, n_l, d))
        add(sa + "key.bias", layers("self_attn.k_bias"), rope() + [stack()], ("kv_heads", "layers", "head_dim"),
            (nkv, n_l, d))
        add(sa + "value.bias", layers("self_attn.v_bias"), [stack()], ("kv_heads", "layers", "head_dim"), (nkv, n_l, d))
    if has_qk_norm:
        add(sa + "query_norm.scale", layers("self_attn.q_norm.scale"), rope() + [stack()], ("head_dim", "layers"),
            (d, n_l))
        add(sa + "key_norm.scale", layers("self_attn.k_norm.scale"), rope() + [stack()], ("head_dim", "layers"),
            (d, n_l))
    add(lay + "mlp.wi_0.kernel", layers("mlp.gate_proj"), [stack()], ("embed", "layers", "mlp"), (e, n_l, i))
    add(lay + "mlp.wi_1.kernel", layers("mlp.up_proj"), [stack()], ("embed", "layers", "mlp"), (e, n_l, i))
    add(lay + "mlp.wo.kernel", layers("mlp.down_proj"), [stack()], ("mlp", "layers", "embed"), (i, n_l, e))
    return rules, expected


def build_plan(source: Any, target: TargetSpec, model_info: ModelInfo | None = None) -> Plan:
    """Write the translation table from ``source`` to ``target`` and validate it.

    Args:
        source: the trainer's ``nnx.State`` (or its :func:`describe_source` / a dict name -> array or
            ``ShapeDtypeStruct``; the ``"jax"`` target needs logical names, i.e. a State, unless
            ``target.shardings`` is given).
        target: the :class:`TargetSpec`.
        model_info: required for ``"hf"``, ``"vllm"`` and ``"jetstream"`` (:meth:`ModelInfo.from_config`).

    Returns:
        a validated :class:`Plan`.

    Raises:
        ValueError: missing ``model_info``; a tensor-parallel size the model does not allow (names the sizes); or
            any :func:`validate_plan` problem (e.g. the source is not a decoder state of this architecture).
    """
    src = source if _is_description(source) else describe_source(source)
    mesh, tp = target.resolve_mesh()
    if target.kind == "jax":
        rules, expected = _build_jax(src, target, mesh)
    else:
        if not isinstance(model_info, ModelInfo):
            raise ValueError(f"a {target.kind!r} plan needs model_info=ModelInfo(...); got {model_info!r}")
        if target.kind == "vllm":
            rules, expected = _build_vllm(src, target, mesh, tp, model_info)
        elif target.kind == "hf":
            rules, expected = _build_hf(src, target, mesh, model_info)
        else:
            rules, expected = _build_jetstream(src, target, mesh, model_info)
    plan = Plan(target.kind, tuple(rules), dict(expected), dict(src), target, mesh)
    validate_plan(plan)
    return plan


# ----------------------------------------------------------------------------------------------- running
class SyncReport(NamedTuple):
    """What one :meth:`Translator.sync` did.

    Attributes:
        bytes_moved: net bytes that landed on a device that did not hold them before (see the module docstring).
        seconds: wall time of the sync until every target array is ready (the first call also compiles).
        num_tensors: target tensors produced.
    """

    bytes_moved: int
    seconds: float
    num_tensors: int


class RuleCheck(NamedTuple):
    """Placement facts for one rule (see :meth:`Translator.check_placement`).

    Attributes:
        target: target name.
        global_elements: elements of the whole target tensor.
        peak_elements: the largest buffer (elements) any one device holds in the rule's compiled program,
            including its inputs, outputs and every intermediate, and the final target shard.
        replicated_target: the target sharding is fully replicated (then a full copy per device is expected).
        stage_sharding: where the tensor sits before the piecewise transfer: the stage layout on the source
            devices for rules with layout steps, the source sharding for plain copies, the target sharding itself
            on the collective path.
    """

    target: str
    global_elements: int
    peak_elements: int
    replicated_target: bool
    stage_sharding: NamedSharding


def rank_shards(x: jax.Array) -> list[jax.Array]:
    """The per-rank pieces of a vllm-target array: the shard on each device of its mesh, in mesh (rank) order.

    Raises:
        ValueError: ``x`` is not on a NamedSharding.
    """
    if not isinstance(x.sharding, NamedSharding):
        raise ValueError(f"expected an array with a NamedSharding; got {type(x.sharding).__name__}")
    by_dev = {s.device: s.data for s in x.addressable_shards}
    return [by_dev[d] for d in x.sharding.mesh.devices.flat if d in by_dev]


_SHAPE_RE = re.compile(r"\b(?:pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f8\w*|f16|bf16|f32|f64|c64|c128)\[([\d,]*)\]")


def _result_type(line: str) -> str | None:
    if " = " not in line:
        return None
    rhs = line.split(" = ", 1)[1].lstrip()
    if rhs.startswith("("):
        depth = 0
        for j, ch in enumerate(rhs):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rhs[: j + 1]
        return rhs
    return rhs.split(" ", 1)[0]


def _peak_elements(hlo_text: str) -> int:
    """Largest array (elements) in an SPMD-partitioned HLO module (per-device shapes)."""
    peak = 0
    for line in hlo_text.splitlines():
        typ = _result_type(line)
        if not typ:
            continue
        for dims in _SHAPE_RE.findall(typ):
            peak = max(peak, math.prod(int(x) for x in dims.split(",") if x) if dims else 1)
    return peak


def _stage_spec(shape: tuple[int, ...], target: NamedSharding, mesh: Mesh) -> PartitionSpec:
    """Spread a tensor over the source mesh: target-sharded dims first, every mesh axis used once where it
    divides, so no device holds a full copy unless nothing divides."""
    sharded = [dim for dim, ent in enumerate(target.spec) if ent is not None]
    order = sharded + sorted((d for d in range(len(shape)) if d not in sharded), key=lambda d: -shape[d])
    assigned: list[list[str]] = [[] for _ in shape]
    prod = [1] * len(shape)
    for ax, size in sorted(mesh.shape.items(), key=lambda kv: -kv[1]):
        if size == 1:
            continue
        for dim in order:
            if shape[dim] % (prod[dim] * size) == 0:
                assigned[dim].append(ax)
                prod[dim] *= size
                break
    return PartitionSpec(*[None if not a else (a[0] if len(a) == 1 else tuple(a)) for a in assigned])


def _is_replicated(sh: NamedSharding) -> bool:
    return all(ent is None for ent in sh.spec)


def _bounds(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))


def _assemble(pieces: list[tuple[tuple[int, ...], Any]], dim: int = 0):
    """Concatenate a grid of pieces ``(offset, array)`` into one block (traced inside a per-device jit)."""
    if len(pieces) == 1:
        return pieces[0][1]
    groups: dict[int, list] = {}
    for off, arr in pieces:
        groups.setdefault(off[dim], []).append((off, arr))
    parts = [_assemble(groups[k], dim + 1) for k in sorted(groups)]
    return parts[0] if len(parts) == 1 else jax.numpy.concatenate(parts, axis=dim)


class _PieceTransfer:
    """Reshard arrays to target shardings by device-to-device copies of shard pieces (any two device sets).

    For each target device, the intersections of its slice with the source shards are cut on the source devices
    (one jitted program per source device; whole shards are sent as they are), copied to the target device in one
    batched ``jax.device_put``, and concatenated there (one jitted program per target device);
    ``jax.make_array_from_single_device_arrays`` assembles each result. Nothing passes through the host and no
    device receives more than its own target shard. Built once per source layout.
    """

    def __init__(self, arrays: Mapping[str, jax.Array], targets: Mapping[str, NamedSharding]):
        self.names = list(arrays)
        self.targets = {n: targets[n] for n in self.names}
        self.shapes = {n: tuple(arrays[n].shape) for n in self.names}
        # piece k: (name, source device, local slices or None for the whole shard, destination device)
        self.pieces: list[tuple[str, Any, tuple | None, Any]] = []
        self.blocks: dict[Any, list[tuple[str, list[tuple[tuple[int, ...], int]]]]] = {}
        for name in self.names:
            x, shape = arrays[name], self.shapes[name]
            by_index: dict[tuple, list] = {}
            for sh in x.addressable_shards:
                by_index.setdefault(_bounds(sh.index, shape), []).append(sh.device)
            for t_dev, t_idx in self.targets[name].addressable_devices_indices_map(shape).items():
                tb = _bounds(t_idx, shape)
                parts = []
                for k, (sb, devs) in enumerate(by_index.items()):
                    inter = [(max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(sb, tb)]
                    if any(lo >= hi for lo, hi in inter):
                        continue
                    src_dev = t_dev if t_dev in devs else devs[(t_dev.id + k) % len(devs)]
                    whole = all((lo, hi) == (a0, a1) for (lo, hi), (a0, a1) in zip(inter, sb))
                    local = None if whole and src_dev != t_dev else tuple(
                        slice(lo - a0, hi - a0) for (lo, hi), (a0, _) in zip(inter, sb))  # same device: copy
                    parts.append((tuple(lo - t0 for (lo, _), (t0, _) in zip(inter, tb)), len(self.pieces)))
                    self.pieces.append((name, src_dev, local, t_dev))
                self.blocks.setdefault(t_dev, []).append((name, parts))
        self.cut_jobs: dict[Any, list[int]] = {}
        for k, (_, src_dev, local, _) in enumerate(self.pieces):
            if local is not None:
                self.cut_jobs.setdefault(src_dev, []).append(k)
        self._cut_fns = {dev: jax.jit(self._cutter([self.pieces[k][2] for k in ks]))
                         for dev, ks in self.cut_jobs.items()}
        self._assemble_fns = {}
        for dev, jobs in self.blocks.items():
            fn, order = self._assembler(jobs)
            self._assemble_fns[dev] = (jax.jit(fn), order)

    @staticmethod
    def _cutter(slices: list[tuple]):
        def cut(*xs):
            return tuple(jax.numpy.array(x[sl], copy=True) for x, sl in zip(xs, slices))

        return cut

    @staticmethod
    def _assembler(jobs):
        layout = [[(off, i) for off, i in parts] for _, parts in jobs]
        order = sorted({i for parts in layout for _, i in parts})
        pos = {i: j for j, i in enumerate(order)}

        def assemble(*xs):
            return tuple(_assemble([(off, xs[pos[i]]) for off, i in parts]) for parts in layout)

        return assemble, order

    def __call__(self, arrays: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        data = {(n, sh.device): sh.data for n in self.names for sh in arrays[n].addressable_shards}
        got: list[Any] = [None] * len(self.pieces)
        for dev, ks in self.cut_jobs.items():
            outs = self._cut_fns[dev](*(data[(self.pieces[k][0], dev)] for k in ks))
            for k, o in zip(ks, outs):
                got[k] = o
        for k, (name, src_dev, local, _) in enumerate(self.pieces):
            if local is None:
                got[k] = data[(name, src_dev)]
        send = [k for k, (_, src_dev, _, t_dev) in enumerate(self.pieces) if src_dev != t_dev]
        if send:
            moved = jax.device_put([got[k] for k in send], [self.pieces[k][3] for k in send], may_alias=False)
            for k, m in zip(send, moved):
                got[k] = m
        per_dev: dict[str, dict] = {n: {} for n in self.names}
        for dev, jobs in self.blocks.items():
            fn, order = self._assemble_fns[dev]
            for (name, _), block in zip(jobs, fn(*(got[i] for i in order))):
                per_dev[name][dev] = block
        out = {}
        for name in self.names:
            sh, shape = self.targets[name], self.shapes[name]
            bufs = [per_dev[name][d] for d in sh.addressable_devices_indices_map(shape)]
            out[name] = jax.make_array_from_single_device_arrays(shape, sh, bufs)
        return out


class _Program(NamedTuple):
    fn: Callable | None  # jitted layout program (None when every rule is a plain copy)
    direct: bool  # one jit straight to the target shardings (colocated)
    stage: dict[str, NamedSharding]  # where each computed target sits before the transfer
    passthrough: tuple[Rule, ...]  # rules without steps: their source is transferred as is
    transfer: _PieceTransfer | None  # built on the first sync (needs the stage outputs' layouts)


TRANSFERS: tuple[str, ...] = ("auto", "collective", "pieces")


class Translator:
    """Runs a :class:`Plan`: ``Translator(plan).sync(train_state) -> (target_params, SyncReport)``.

    Args:
        plan: from :func:`build_plan`.
        transfer: how shards reach the target devices.
            ``"collective"``: one ``jax.jit`` with the target ``out_shardings`` (XLA collectives; needs the target
            mesh to list the source devices in the same order). ``"pieces"``: rules with steps run in one jit on the
            source devices into a spread *stage* layout, then every target shard is assembled from device-to-device
            copies of the pieces it needs (works across disjoint device sets).
            ``"auto"`` (default): collective when colocated with the same device order, else pieces.

    Compiled programs and byte counts are cached per source layout (the shardings of the source arrays), so
    repeated syncs of a training run compile once.

    Raises:
        ValueError: an invalid plan (:func:`validate_plan`) or ``transfer``.
    """

    def __init__(self, plan: Plan, *, transfer: str = "auto"):
        if not isinstance(plan, Plan):
            raise ValueError(f"Translator needs a Plan from build_plan; got {type(plan).__name__}")
        if transfer not in TRANSFERS:
            raise ValueError(f"transfer={transfer!r}; valid: {list(TRANSFERS)}")
        validate_plan(plan)
        self.plan = plan
        self.transfer = transfer
        self._cache: dict[Any, _Program] = {}
        self._bytes: dict[Any, int] = {}

    # -- source handling ----------------------------------------------------------------------------------------
    def _arrays(self, source: Any) -> dict[str, jax.Array]:
        if isinstance(source, nnx.State):
            arrays = {name: (leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf)
                      for name, _, leaf in _flat_state(source)}
        elif isinstance(source, Mapping):
            arrays = dict(source)
        else:
            raise ValueError(f"source must be an nnx.State or a dict name -> jax.Array; got {type(source).__name__}")
        want = self.plan.source
        missing, extra = sorted(set(want) - set(arrays)), sorted(set(arrays) - set(want))
        if missing or extra:
            raise ValueError(f"source does not match the plan: missing {missing[:8]}, unexpected {extra[:8]}")
        bad = [f"{n}: {tuple(a.shape)} {np.dtype(a.dtype)} (plan: {want[n].shape} {want[n].dtype})"
               for n, a in arrays.items()
               if (tuple(a.shape), np.dtype(a.dtype)) != (tuple(want[n].shape), np.dtype(want[n].dtype))]
        if bad:
            raise ValueError("source shapes/dtypes differ from the plan: " + "; ".join(bad[:5]))
        not_jax = [n for n, a in arrays.items() if not isinstance(a, jax.Array)]
        if not_jax:
            raise ValueError(f"source values must be jax.Arrays already placed on devices; not: {not_jax[:5]}")
        return arrays

    @staticmethod
    def _source_mesh(arrays: Mapping[str, jax.Array]) -> Mesh:
        sets = {frozenset(a.sharding.device_set) for a in arrays.values()}
        if len(sets) != 1:
            raise ValueError(f"source arrays live on {len(sets)} different device sets; the train state must be on "
                             "one mesh")
        devset = next(iter(sets))
        for a in arrays.values():
            sh = a.sharding
            if isinstance(sh, NamedSharding) and frozenset(sh.mesh.devices.flat) == devset:
                return sh.mesh
        return Mesh(np.array(sorted(devset, key=lambda d: d.id), dtype=object), ("source",))

    def _program(self, arrays: Mapping[str, jax.Array]) -> tuple[Any, _Program]:
        key = tuple(sorted((n, a.sharding) for n, a in arrays.items()))
        if key in self._cache:
            return key, self._cache[key]
        src_mesh = self._source_mesh(arrays)
        same_order = tuple(d.id for d in src_mesh.devices.flat) == tuple(d.id for d in self.plan.mesh.devices.flat)
        if self.transfer == "collective" and not same_order:
            raise ValueError("transfer='collective' needs the target mesh to list the source devices in the same "
                             f"order; source {[d.id for d in src_mesh.devices.flat]}, target "
                             f"{[d.id for d in self.plan.mesh.devices.flat]} (use 'pieces' or 'auto')")
        direct = same_order and self.transfer != "pieces"
        if direct:
            computed, passthrough = self.plan.rules, ()
            stage = {r.target: r.sharding for r in computed}
        else:
            computed = tuple(r for r in self.plan.rules if r.steps)
            passthrough = tuple(r for r in self.plan.rules if not r.steps)
            stage = {}
            for r in computed:
                shape = tuple(self.plan.expected[r.target].shape)
                if all(not s.moves_only for s in r.steps) and len(r.sources) == 1:
                    stage[r.target] = arrays[r.sources[0]].sharding  # elementwise (cast): stay in place
                else:
                    stage[r.target] = NamedSharding(src_mesh, _stage_spec(shape, r.sharding, src_mesh))

        def program(xs):
            return {r.target: r.apply(*(xs[s] for s in r.sources)) for r in computed}

        fn = jax.jit(program, out_shardings=stage) if computed else None
        self._cache[key] = _Program(fn, direct, stage, passthrough, None)
        return key, self._cache[key]

    # -- public ---------------------------------------------------------------------------------------------------
    def sync(self, source: Any) -> tuple[Any, SyncReport]:
        """Translate and reshard ``source`` (the trainer's params) to the target layout.

        Args:
            source: an ``nnx.State`` or dict name -> ``jax.Array`` with exactly the plan's names, shapes, dtypes,
                all on one device set. It is not modified, donated or aliased by the result.

        Returns:
            ``(target_params, report)``: for ``"jax"`` an ``nnx.State`` like ``source`` (or a dict when given a
            dict); for ``"vllm"`` a dict vLLM name -> global array (device r holds rank r's shard); for
            ``"jetstream"`` a nested dict ``{"params": {...}}``. Every array carries exactly its rule's sharding.

        Raises:
            ValueError: the source does not match the plan.
        """
        arrays = self._arrays(source)
        t0 = time.perf_counter()
        key, prog = self._program(arrays)
        if prog.fn is not None:
            needed = {s for r in self.plan.rules if r.target in prog.stage for s in r.sources}
            out = prog.fn({n: arrays[n] for n in needed})
        else:
            out = {}
        if not prog.direct:
            out.update({r.target: arrays[r.sources[0]] for r in prog.passthrough})
            if prog.transfer is None:
                prog = self._cache[key] = prog._replace(
                    transfer=_PieceTransfer(out, {r.target: r.sharding for r in self.plan.rules}))
            out = prog.transfer(out)
        out = jax.block_until_ready(out)
        seconds = time.perf_counter() - t0
        if key not in self._bytes:
            self._bytes[key] = sum(self._moved_bytes(r, arrays) for r in self.plan.rules)
        report = SyncReport(self._bytes[key], seconds, len(out))
        return self._assemble_output(out, source), report

    def check_placement(self, source: Any) -> list[RuleCheck]:
        """Per rule, the largest buffer any one device holds during :meth:`sync`.

        Computed rules are compiled on their own with the same in/out shardings as in :meth:`sync` and their
        SPMD-partitioned HLO (inputs, every intermediate, outputs) is scanned; the piecewise transfer never holds
        more than the source shards and the target shard, which are included. For a non-replicated target
        ``peak_elements < global_elements`` means no device ever held a full copy.

        Raises:
            ValueError: the source does not match the plan.
        """
        arrays = self._arrays(source)
        _, prog = self._program(arrays)
        checks = []
        for r in self.plan.rules:
            args = [arrays[s] for s in r.sources]
            shape = tuple(self.plan.expected[r.target].shape)
            peak = max(math.prod(r.sharding.shard_shape(shape)),
                       max(math.prod(a.sharding.shard_shape(a.shape)) for a in args))
            stage = prog.stage.get(r.target, args[0].sharding)
            if r.target in prog.stage:
                compiled = jax.jit(r.apply, out_shardings=stage).lower(*args).compile()
                peak = max(peak, _peak_elements(compiled.as_text()))
            checks.append(RuleCheck(r.target, math.prod(shape), peak, _is_replicated(r.sharding), stage))
        return checks

    # -- internals ------------------------------------------------------------------------------------------------
    def _assemble_output(self, out: dict[str, jax.Array], source: Any) -> Any:
        kind = self.plan.kind
        if kind == "jax" and isinstance(source, nnx.State):
            flat = [(path, leaf.replace(out[name]) if isinstance(leaf, nnx.Variable) else out[name])
                    for name, path, leaf in _flat_state(source)]
            return nnx.from_flat_state(flat)
        if kind == "jetstream":
            tree: dict = {}
            for name in sorted(out):
                node = tree
                *parents, last = name.split(".")
                for p in parents:
                    node = node.setdefault(p, {})
                node[last] = out[name]
            return tree
        return {r.target: out[r.target] for r in self.plan.rules}

    def _moved_bytes(self, rule: Rule, arrays: Mapping[str, jax.Array]) -> int:
        """Exact net bytes for one rule by tracing element ids (see the module docstring)."""
        srcs = [arrays[s] for s in rule.sources]
        shapes = [tuple(a.shape) for a in srcs]
        sizes = [math.prod(s) for s in shapes]
        offsets = np.cumsum([0] + sizes)
        idt = np.int32 if offsets[-1] < 2**31 - 1 else np.int64
        ids = [np.arange(offsets[k], offsets[k + 1], dtype=idt).reshape(shapes[k]) for k in range(len(srcs))]
        traced = np.asarray(rule.trace(*ids))
        itemsize = np.dtype(self.plan.expected[rule.target].dtype).itemsize
        src_maps = [a.sharding.devices_indices_map(shapes[k]) for k, a in enumerate(srcs)]
        moved = 0
        for dev, idx in rule.sharding.devices_indices_map(traced.shape).items():
            sub = traced[idx].ravel()
            sub = sub[sub >= 0]
            if sub.size == 0:
                continue
            held = np.zeros(sub.shape, bool)
            which = np.searchsorted(offsets, sub, side="right") - 1
            for k in range(len(srcs)):
                sl = src_maps[k].get(dev)
                if sl is None:
                    continue
                pos = np.flatnonzero(which == k)
                if pos.size == 0:
                    continue
                coords = np.unravel_index(sub[pos] - offsets[k], shapes[k])
                inside = np.ones(pos.size, bool)
                for c, s, n in zip(coords, sl, shapes[k]):
                    lo, hi, _ = s.indices(n)
                    inside &= (c >= lo) & (c < hi)
                held[pos[inside]] = True
            moved += int((~held).sum()) * itemsize
        return moved
