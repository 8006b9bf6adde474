"""Meshes, logical-axis rules and the train -> inference weight translator.

``sharding`` depends only on jax, flax and numpy (never on ``jaxrl``), so inference engines can use it alone.

* :mod:`sharding.mesh`: :func:`make_mesh` (``("data", "fsdp", "tensor")``), :func:`split_devices`.
* :mod:`sharding.rules`: :data:`DEFAULT_RULES`, :func:`logical_to_pspec`, :func:`param_shardings`,
  :func:`shard_state`, :func:`batch_sharding`.
* :mod:`sharding.ops`: the small layout operations (transpose, fuse q|k|v per TP rank, stack layers, ...).
* :mod:`sharding.translator`: :class:`TargetSpec`, :func:`build_plan`, :func:`validate_plan`, :class:`Translator`.

Typical use (train mesh -> embedded sampler on a tensor-parallel mesh)::

    mesh = make_mesh(data=1, fsdp=4, tensor=2)
    state = shard_state(state, param_shardings(state, mesh, DEFAULT_RULES))
    plan = build_plan(state, TargetSpec("jax", mesh=make_mesh(1, 1, 8)))
    translator = Translator(plan)
    rollout_params, report = translator.sync(state)   # report.bytes_moved, report.seconds
"""

from sharding.mesh import MESH_AXES, make_mesh, split_devices
from sharding.rules import (
    DEFAULT_RULES,
    TENSOR_PARALLEL_RULES,
    batch_sharding,
    logical_to_pspec,
    param_shardings,
    rules_from_dict,
    shard_state,
)
from sharding.translator import (
    ModelInfo,
    Plan,
    Rule,
    SyncReport,
    TargetSpec,
    Translator,
    build_plan,
    rank_shards,
    validate_plan,
)

__all__ = [
    "DEFAULT_RULES",
    "MESH_AXES",
    "ModelInfo",
    "Plan",
    "Rule",
    "SyncReport",
    "TENSOR_PARALLEL_RULES",
    "TargetSpec",
    "Translator",
    "batch_sharding",
    "build_plan",
    "logical_to_pspec",
    "make_mesh",
    "param_shardings",
    "rank_shards",
    "rules_from_dict",
    "shard_state",
    "split_devices",
    "validate_plan",
]
