"""Logical-axis rules: map the logical names parameters carry to mesh axes, and build shardings from them.

Parameters of the decoder carry one logical name per dimension (NNX ``out_sharding`` metadata, e.g.
``("embed", "heads", "head_dim")`` for the q kernel). A *rules table* maps each logical name to a mesh axis, a
tuple of mesh axes, or ``None`` (replicated). :func:`logical_to_pspec` turns names into a
:class:`~jax.sharding.PartitionSpec`; :func:`param_shardings` does it for a whole ``nnx.State`` (or any pytree
whose leaves are NNX Variables, e.g. an optax state built over one).

Resolution of one array's names, dimension by dimension:

1. ``None`` (or a name mapped to ``None``) -> the dimension is replicated.
2. A mesh axis already used by an earlier dimension of the same array is dropped (an axis can split only one
   dimension).
3. With ``mesh`` and ``shape`` given, a dimension whose size is not divisible by the product of its axis sizes
   keeps only the longest prefix of its axes that divides it - for a single axis that means it is replicated
   (e.g. ``kv_heads=2`` with ``tensor=4``). This is the fallback a model with few kv heads needs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = [
    "DEFAULT_RULES",
    "TENSOR_PARALLEL_RULES",
    "Rules",
    "batch_sharding",
    "logical_to_pspec",
    "param_shardings",
    "rules_from_dict",
    "shard_state",
    "variable_names",
]

AxisSpec = str | tuple[str, ...] | None
Rules = tuple[tuple[str, AxisSpec], ...]

#: Training layout: batch over (data, fsdp); weights FSDP-sharded on ``embed`` and tensor-parallel on
#: vocab / heads / mlp.
DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("layers", None),
)

#: Inference layout: tensor parallelism only (what a rollout engine wants), everything else replicated.
TENSOR_PARALLEL_RULES: Rules = (
    ("batch", None),
    ("vocab", "tensor"),
    ("embed", None),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("layers", None),
)


def _normalise_axes(name: str, value: Any) -> AxisSpec:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value) if value else None
    raise ValueError(
        f"rule for logical axis {name!r} maps to {value!r}; use a mesh axis name, a list/tuple of names, or None"
    )


def rules_from_dict(d: Mapping[str, Any], *, base: Rules | None = DEFAULT_RULES) -> Rules:
    """Build a rules table from a mapping ``{logical_name: mesh_axis | [mesh_axes] | None}`` (e.g. from YAML).

    Args:
        d: the overrides / entries.
        base: a table to start from; entries of ``d`` replace base entries of the same name and new names are
            appended. ``None`` or ``()`` builds a table from ``d`` alone.

    Returns:
        a rules table (tuple of ``(name, axes)`` pairs; lists become tuples).

    Raises:
        ValueError: a non-string logical name or a value that is not a string, a sequence of strings or None.
    """
    if not isinstance(d, Mapping):
        raise ValueError(f"rules must be a mapping of logical name -> mesh axes; got {type(d).__name__}")
    table: dict[str, AxisSpec] = dict(base or ())
    for name, value in d.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"logical axis names must be non-empty strings; got {name!r}")
        table[name] = _normalise_axes(name, value)
    return tuple(table.items())


def _rules_dict(rules: Rules) -> dict[str, AxisSpec]:
    out: dict[str, AxisSpec] = {}
    for entry in rules:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str)):
            raise ValueError(f"each rule must be a (logical_name, mesh_axes) pair; got {entry!r}")
        out[entry[0]] = _normalise_axes(entry[0], entry[1])
    return out


def logical_to_pspec(
    names: Sequence[str | None],
    rules: Rules,
    mesh: Mesh | None = None,
    shape: Sequence[int] | None = None,
) -> PartitionSpec:
    """Map one array's logical dimension names to a :class:`PartitionSpec` (see the module docstring).

    Args:
        names: one logical name (or None) per dimension, e.g. ``("embed", "heads", "head_dim")``.
        rules: the rules table (:data:`DEFAULT_RULES`, :data:`TENSOR_PARALLEL_RULES`, :func:`rules_from_dict`).
        mesh: when given, every mesh axis the rules produce must exist in it.
        shape: when given together with ``mesh``, the array's shape (same length as ``names``); dimensions not
            divisible by their mesh-axis sizes fall back to the longest dividing prefix of their axes
            (replicated if none divides).

    Returns:
        a ``PartitionSpec`` with one entry per dimension (``None``, an axis name, or a tuple of axis names).

    Raises:
        ValueError: a logical name missing from ``rules`` (the message lists the known names), an axis not in
            ``mesh``, or ``shape`` whose length differs from ``names``.
    """
    table = _rules_dict(rules)
    names = tuple(names)
    if shape is not None and len(tuple(shape)) != len(names):
        raise ValueError(f"shape {tuple(shape)} has {len(tuple(shape))} dims but names {names} has {len(names)}")
    used: set[str] = set()
    entries: list[AxisSpec] = []
    for dim, name in enumerate(names):
        if name is None:
            entries.append(None)
            continue
        if name not in table:
            raise ValueError(f"logical axis {name!r} has no rule; known logical axes: {sorted(table)}")
        axes = table[name]
        axes = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
        if mesh is not None:
            unknown = [a for a in axes if a not in mesh.axis_names]
            if unknown:
                raise ValueError(
                    f"logical axis {name!r} maps to mesh axes {unknown} that the mesh {tuple(mesh.axis_names)} "
                    "does not have"
                )
        axes = tuple(a for a in axes if a not in used)
        if mesh is not None and shape is not None:
            size = int(tuple(shape)[dim])
            while axes and size % math.prod(mesh.shape[a] for a in axes):
                axes = axes[:-1]
        used.update(axes)
        entries.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
    return PartitionSpec(*entries)


def variable_names(var: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical dimension names an NNX Variable carries (``out_sharding`` metadata; flax 0.12 also accepts the
    deprecated ``sharding_names`` / ``sharding`` keys), or None when it has none."""
    meta = var.get_metadata()
    for key in ("out_sharding", "sharding_names", "sharding"):
        names = meta.get(key)
        if names:
            return tuple(names)
    return None


def param_shardings(state: Any, mesh: Mesh, rules: Rules) -> Any:
    """A tree of :class:`NamedSharding` shaped like ``state``, from the logical names its Variables carry.

    Args:
        state: an ``nnx.State`` (``nnx.state(model)`` / ``nnx.split(model)[1]``) or any pytree whose array leaves
            sit in NNX Variables - e.g. an optax state built over such a State, whose moments keep the Variables'
            metadata. Variables without names and bare array leaves (step counters) are replicated.
        mesh: the mesh to shard over.
        rules: the rules table.

    Returns:
        the same tree with each Variable's value replaced by its ``NamedSharding`` (and bare array leaves by a
        replicated one), usable as ``jax.jit`` in/out shardings and by :func:`shard_state`.

    Raises:
        ValueError: from :func:`logical_to_pspec` (unknown logical name or mesh axis), or a Variable whose names
            do not match its rank.
    """

    def one(leaf):
        if isinstance(leaf, nnx.Variable):
            names = variable_names(leaf)
            shape = tuple(leaf.shape) if hasattr(leaf, "shape") else None
            if names is None or shape is None:
                return leaf.replace(NamedSharding(mesh, PartitionSpec()))
            if len(names) != len(shape):
                raise ValueError(f"variable with logical names {names} has shape {shape}: ranks differ")
            return leaf.replace(NamedSharding(mesh, logical_to_pspec(names, rules, mesh, shape)))
        if hasattr(leaf, "shape"):
            return NamedSharding(mesh, PartitionSpec())
        return leaf

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_state(state: Any, shardings: Any) -> Any:
    """Place ``state`` with ``shardings`` (:func:`param_shardings` output) via ``jax.device_put``.

    Raises:
        ValueError: the two trees differ in structure (names both structures).
    """
    s1 = jax.tree_util.tree_structure(state)
    s2 = jax.tree_util.tree_structure(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if s1 != s2:
        raise ValueError(f"state and shardings have different tree structures:\n  state     {s1}\n  shardings {s2}")
    return jax.device_put(state, shardings)


def batch_sharding(mesh: Mesh, ndim: int, rules: Rules = DEFAULT_RULES) -> NamedSharding:
    """Sharding for a ``[B, ...]`` batch array of rank ``ndim``: the leading dim over the ``"batch"`` rule's
    axes (``("data", "fsdp")`` by default), the rest replicated. ``B`` must be divisible by their product.

    Raises:
        ValueError: ``ndim < 1``, or the batch axes are not in ``mesh``.
    """
    if isinstance(ndim, bool) or not isinstance(ndim, int) or ndim < 1:
        raise ValueError(f"ndim={ndim!r} must be an int >= 1 (a [batch, ...] array)")
    return NamedSharding(mesh, logical_to_pspec(("batch",) + (None,) * (ndim - 1), rules, mesh))
