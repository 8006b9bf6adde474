"""The plan model of weight translation: what a translation table is made of, and its validation.

A :class:`Plan` is a list of :class:`Rule` s. Each rule names one target tensor, the source tensors it is made
from, the :class:`Step` s (small operations from :mod:`sharding.ops`: transpose, reshape, fuse q|k|v or gate|up
per tensor-parallel rank, stack layers, pad, cast, ...) that turn the sources into it, and the target's
sharding. :func:`sharding.targets.build_plan` writes the table for a target engine (:class:`TargetSpec`);
:func:`validate_plan` rejects a table that leaves a source unused or a target unproduced;
:class:`sharding.translator.Translator` runs it.

Source names are the dotted paths of the trainer's ``nnx.State`` (``"embed_tokens"``,
``"layers.3.self_attn.q_proj"``, ``"layers.3.input_layernorm.scale"``, ``"norm.scale"``, ``"lm_head"``); layouts
are those of ``jaxrl.models.decoder`` (``q_proj [E, nH, D]``, ``o_proj [nH, D, E]``, ``gate_proj [E, I]``, ...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding import ops
from sharding.rules import Rules, variable_names

__all__ = [
    "KINDS",
    "ModelInfo",
    "Plan",
    "Rule",
    "SourceParam",
    "Step",
    "TargetSpec",
    "describe_source",
    "run_steps",
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


def run_steps(steps: Sequence[Step], *arrays, what: str = "steps"):
    """Apply ``steps`` in order to ``arrays`` (numpy or jax, also inside ``jax.jit``); returns the one array they
    end in.

    Raises:
        ValueError: the steps do not end in exactly one array (``what`` names the caller in the message).
    """
    xs = tuple(arrays)
    for s in steps:
        xs = s(xs)
    if len(xs) != 1:
        raise ValueError(f"{what} ends with {len(xs)} arrays; its steps must combine to one")
    return xs[0]


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
        return run_steps(self.steps, *arrays, what=f"rule for {self.target!r}")

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

