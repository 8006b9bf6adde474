"""Meshes, logical-axis rules and the train -> inference weight translator.

``sharding`` depends only on jax, flax and numpy (never on ``jaxrl``), so inference engines can use it alone.

* :mod:`sharding.mesh`: :func:`make_mesh` (``("data", "fsdp", "tensor")``), :func:`split_devices`.
* :mod:`sharding.rules`: :data:`DEFAULT_RULES`, :func:`logical_to_pspec`, :func:`param_shardings`,
  :func:`shard_state`, :func:`batch_sharding`.
* :mod:`sharding.ops`: the small layout operations (transpose, fuse q|k|v per TP rank, stack layers, ...).
* :mod:`sharding.plan`: the plan model (:class:`Plan`, :class:`Rule`, :class:`Step`, :class:`TargetSpec`,
  :func:`validate_plan`); :mod:`sharding.targets`: :func:`build_plan`, one table per target (jax / hf / vllm /
  jetstream); :mod:`sharding.hf_layout`: the one Hugging Face name/layout table (:func:`hf_table`, also read by
  ``jaxrl.models.hf``); :mod:`sharding.translator`: :class:`Translator` (runs a plan, :class:`SyncReport`),
  with :mod:`sharding.transfer` (device-to-device piece copies). All public names are re-exported here.

Typical use (train mesh -> embedded sampler on a tensor-parallel mesh)::

    mesh = make_mesh(data=1, fsdp=4, tensor=2)
    state = shard_state(state, param_shardings(state, mesh, DEFAULT_RULES))
    plan = build_plan(state, TargetSpec("jax", mesh=make_mesh(1, 1, 8)))
    translator = Translator(plan)
    rollout_params, report = translator.sync(state)   # report.bytes_moved, report.seconds
"""

from sharding.hf_layout import HFTensor, hf_table
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
    "HFTensor",
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
    "hf_table",
    "logical_to_pspec",
    "make_mesh",
    "param_shardings",
    "rank_shards",
    "rules_from_dict",
    "shard_state",
    "split_devices",
    "validate_plan",
]
