"""Where the roles run: the train mesh and the rollout engine's mesh.

A :class:`Placement` is built once per run from the config (:func:`placement_from_config`); ``None`` means no
mesh: every role on one device, the single-device run. With a placement:

* the actor, the reference and the critic share ``train_mesh`` (axes ``data, fsdp, tensor``): parameters and
  optimizer state are sharded by the logical-axis ``rules`` (:data:`sharding.rules.DEFAULT_RULES` overridden by
  ``trainer.sharding_rules``), batch rows are split over the ``"batch"`` rule's axes (``data x fsdp``);
* the embedded sampler runs on ``rollout_mesh``: ``(data=R/tp, fsdp=1, tensor=tp)`` over its ``R`` devices with
  ``tp = actor_rollout_ref.rollout.tensor_model_parallel_size``; weights laid out by
  :data:`sharding.rules.TENSOR_PARALLEL_RULES` (tensor-parallel, replicated over ``data``), generated rows split
  over ``data``;
* ``kind="colocated"``: both meshes over the same devices, in the same order (the weight sync's translator
  reshards with one jitted collective program); ``kind="split"``: the rollout engine gets the last
  ``trainer.rollout_devices`` devices of ``jax.devices()`` and the train mesh the rest (the translator copies shard
  pieces device to device). The weights cross from one mesh to the other only through
  :class:`jaxrl.rollout.weight_sync.WeightSync`, which picks its translator from the engine's declared format.

Device counts are checked here, not in the config loader (which never imports jax). Multi-process
(:mod:`jaxrl.distributed`): ``jax.devices()`` lists every process's devices, so the meshes span all hosts; split
placement is refused there (its weight sync reshards between different device sets, which multi-controller JAX
refuses across hosts).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from jaxrl.config.loader import ConfigError, check_mesh_batch_sizes, mesh_enabled, mesh_sizes
from jaxrl.distributed import process_count, to_global
from sharding import (
    DEFAULT_RULES,
    TENSOR_PARALLEL_RULES,
    logical_to_pspec,
    make_mesh,
    param_shardings,
    rules_from_dict,
    shard_state,
    split_devices,
)
from sharding.rules import Rules

__all__ = [
    "PLACEMENTS",
    "Placement",
    "batch_shards",
    "describe_mesh",
    "jit_sharded",
    "make_placement",
    "placement_from_config",
    "rows_sharding",
    "shard_tree",
]

PLACEMENTS: tuple[str, ...] = ("colocated", "split")

_XLA_HINT = ("on CPU, simulate {n} devices with XLA_FLAGS=--xla_force_host_platform_device_count={n} "
             "(set before jax starts)")


@dataclasses.dataclass(frozen=True)
class Placement:
    """The device layout of a run.

    Attributes:
      kind: ``"colocated"`` or ``"split"``.
      train_mesh: the ``(data, fsdp, tensor)`` mesh of the actor, reference and critic.
      rollout_mesh: the ``(data, fsdp=1, tensor)`` mesh of the embedded sampler.
      rules: the training logical-axis rules.
      rollout_rules: the sampler's rules (tensor-parallel only).
    """

    kind: str
    train_mesh: Mesh
    rollout_mesh: Mesh
    rules: Rules = DEFAULT_RULES
    rollout_rules: Rules = TENSOR_PARALLEL_RULES

    def __post_init__(self) -> None:
        if self.kind not in PLACEMENTS:
            raise ValueError(f"placement kind={self.kind!r}; valid: {list(PLACEMENTS)}")

    @property
    def batch_shards(self) -> int:
        """How many ways the train mesh splits batch rows (``data x fsdp`` with the default rules)."""
        return batch_shards(self.train_mesh, self.rules)

    def describe(self) -> str:
        """One line for the run log, e.g. ``colocated: train data=2 x fsdp=2 x tensor=2 on devices [0..7]; ...``."""
        return f"{self.kind}: train {describe_mesh(self.train_mesh)}; rollout {describe_mesh(self.rollout_mesh)}"


def describe_mesh(mesh: Mesh) -> str:
    """``data=1 x fsdp=2 x tensor=1 on devices [0, 1]``: a mesh's axes and device ids, for logs."""
    axes = " x ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
    return f"{axes} on devices {[d.id for d in mesh.devices.flat]}"


def batch_shards(mesh: Mesh, rules: Rules) -> int:
    """The product of the mesh axes the ``"batch"`` rule maps rows to (1 when rows are replicated)."""
    entry = logical_to_pspec(("batch",), rules, mesh)[0]
    axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
    return math.prod(mesh.shape[a] for a in axes)


def activation_sharding(mesh: Mesh | None, rules: Rules) -> NamedSharding | None:
    """The ``[B, T, H]`` residual stream on ``mesh`` at block boundaries: rows over the rules' ``batch`` axes,
    sequence and hidden replicated (the FSDP/TP-sharded weights are gathered per layer). None off-mesh."""
    return None if mesh is None else rows_sharding(mesh, rules)


def rows_sharding(mesh: Mesh, rules: Rules, *, row_dim: int = 0) -> NamedSharding:
    """Sharding of batch arrays whose dimension ``row_dim`` holds rows: rows over the ``"batch"`` rule's axes,
    every other dimension replicated (the spec covers dims ``0..row_dim``; later dims are replicated implicitly,
    so one sharding serves ``[rows, ...]`` or ``[num_micro, rows, ...]`` arrays of any rank).

    Raises:
      ValueError: ``row_dim < 0``, or the batch axes are not in ``mesh``.
    """
    if row_dim < 0:
        raise ValueError(f"row_dim={row_dim} must be >= 0")
    return NamedSharding(mesh, logical_to_pspec((None,) * row_dim + ("batch",), rules, mesh))


def jit_sharded(fn, *, in_shardings: tuple, out_shardings: Any, static_kwarg: str, donate_argnums: tuple = ()):
    """``jax.jit(fn)`` with explicit shardings for a function of positional arrays plus one static keyword.

    ``jax.jit`` accepts no keyword arguments once ``in_shardings`` is given, so the static keyword (e.g. the
    prompt width) is passed positionally after the arrays; the returned callable keeps ``fn``'s signature:
    ``call(*arrays, **{static_kwarg: value})``.

    Args:
      fn: ``fn(*arrays, **{static_kwarg: value})``.
      in_shardings: one sharding (tree prefix) per positional array argument; host (numpy) arguments are placed on
        it by :func:`jaxrl.distributed.to_global` (the same on every process of a multi-process run).
      out_shardings: shardings (tree prefix) of the outputs.
      static_kwarg: the keyword argument that is static (hashable, one program per value).
      donate_argnums: positional arrays whose buffers the program may reuse.

    Returns:
      the callable; it raises TypeError for a missing or extra keyword argument.
    """
    n = len(in_shardings)

    def positional(*args):
        return fn(*args[:n], **{static_kwarg: args[n]})

    jitted = jax.jit(positional, static_argnums=(n,), in_shardings=in_shardings, out_shardings=out_shardings,
                     donate_argnums=donate_argnums)

    def call(*args, **kwargs):
        if set(kwargs) != {static_kwarg}:
            raise TypeError(f"expected exactly the keyword argument {static_kwarg!r}; got {sorted(kwargs)}")
        # host (numpy) inputs become global arrays on their shardings (jit refuses numpy with a sharding that
        # spans several processes); arrays already on devices pass as they are
        return jitted(*to_global(tuple(args), tuple(in_shardings)), kwargs[static_kwarg])

    return call


def shard_tree(tree: Any, mesh: Mesh, rules: Rules) -> tuple[Any, Any]:
    """Place an ``nnx.State`` (or an optax state over one) by the logical names its Variables carry.

    Returns:
      ``(placed tree, shardings tree)``; the shardings are usable as ``jax.jit`` in/out shardings.

    Raises:
      ValueError: an unknown logical name or mesh axis (from :func:`sharding.rules.param_shardings`).
    """
    shardings = param_shardings(tree, mesh, rules)
    return shard_state(tree, shardings), shardings


def _device_error(what: str, n_needed: int | None, err: Exception | str) -> ConfigError:
    hint = _XLA_HINT.format(n=n_needed) if n_needed else _XLA_HINT.format(n="N")
    return ConfigError(f"{what} does not fit the devices: {err} (jax.device_count()={jax.device_count()}, "
                       f"platform {jax.default_backend()}); {hint}")


def make_placement(
    kind: str,
    sizes: dict[str, int],
    *,
    rollout_devices: int | None = None,
    rollout_tp: int = 1,
    rules: Rules = DEFAULT_RULES,
    devices: Sequence | None = None,
) -> Placement:
    """Build the meshes of a placement.

    Args:
      kind: ``"colocated"`` (train and rollout share every device) or ``"split"`` (disjoint sets).
      sizes: train mesh sizes ``{"data", "fsdp", "tensor"}``; at most one may be -1 (fill).
      rollout_devices: split only: devices for the rollout engine, taken from the end of ``devices``.
      rollout_tp: the sampler's tensor-parallel degree; must divide its device count.
      rules: training logical-axis rules.
      devices: the device pool; ``None`` = ``jax.devices()`` (all processes).

    Returns:
      a :class:`Placement`.

    Raises:
      ConfigError: an unknown kind; ``"split"`` in a world of several processes; mesh sizes whose product does not match the train device count (names the
        sizes, ``jax.device_count()`` and the XLA_FLAGS way to simulate devices on CPU); ``rollout_devices`` that
        leaves no train device; a ``rollout_tp`` that does not divide the rollout devices.
    """
    if kind not in PLACEMENTS:
        raise ConfigError(f"trainer.placement={kind!r} is invalid; expected one of {', '.join(map(repr, PLACEMENTS))}")
    if kind == "split" and process_count() > 1:
        raise ConfigError(f"trainer.placement='split' is not supported with {process_count()} processes: the split "
                          "weight sync reshards between two different device sets, which multi-controller JAX "
                          "refuses across hosts; use trainer.placement=colocated")
    pool = list(jax.devices()) if devices is None else list(devices)
    sizes_s = " x ".join(f"{a}={v}" for a, v in sizes.items())
    fixed = math.prod(sizes.values()) if -1 not in sizes.values() else None
    if kind == "colocated":
        try:
            train_mesh = make_mesh(**sizes, devices=devices)
        except ValueError as e:
            raise _device_error(f"trainer.mesh {sizes_s} (colocated, over all {len(pool)} devices)", fixed, e) from None
        rollout_pool = list(train_mesh.devices.flat)  # same devices, same order: the collective reshard path
    else:
        if rollout_devices is None or rollout_devices < 1 or rollout_devices >= len(pool):
            need = (fixed or 1) + (rollout_devices or 1)
            raise _device_error(f"trainer.rollout_devices={rollout_devices} with trainer.placement='split'", need,
                                f"split placement needs 1 <= rollout_devices < the {len(pool)} devices available")
        train_pool, rollout_pool = split_devices(len(pool) - rollout_devices, rollout_devices, pool)
        try:
            train_mesh = make_mesh(**sizes, devices=train_pool)
        except ValueError as e:
            need = fixed + rollout_devices if fixed else None
            raise _device_error(f"trainer.mesh {sizes_s} (split: {len(train_pool)} train devices = "
                                f"{len(pool)} - trainer.rollout_devices={rollout_devices})", need, e) from None
    if rollout_tp < 1 or len(rollout_pool) % rollout_tp:
        raise ConfigError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp} must divide the {len(rollout_pool)} "
            f"rollout devices ({kind} placement); valid: a divisor of {len(rollout_pool)}"
        )
    rollout_mesh = make_mesh(len(rollout_pool) // rollout_tp, 1, rollout_tp, devices=rollout_pool)
    return Placement(kind, train_mesh, rollout_mesh, rules=rules)


def placement_from_config(cfg, devices: Sequence | None = None) -> Placement | None:
    """The run's placement from ``trainer.{mesh, placement, rollout_devices, sharding_rules}`` and
    ``actor_rollout_ref.rollout.tensor_model_parallel_size``; ``None`` when no mesh is configured (all
    ``trainer.mesh`` axes null and colocated placement).

    Also checks verl's per-device batch arithmetic on the mesh's batch shards (``*_micro_batch_size_per_gpu`` are
    rows per device; :func:`jaxrl.config.loader.check_mesh_batch_sizes`; the loader does this only when the sizes
    need no device count).

    Raises:
      ConfigError: see :func:`make_placement` and :func:`jaxrl.config.loader.check_mesh_batch_sizes`.
    """
    if not mesh_enabled(cfg):
        return None
    t = cfg.trainer
    rules = rules_from_dict(t.sharding_rules or {}, base=DEFAULT_RULES)
    placement = make_placement(
        t.placement, mesh_sizes(cfg), rollout_devices=t.rollout_devices,
        rollout_tp=cfg.actor_rollout_ref.rollout.tensor_model_parallel_size, rules=rules, devices=devices,
    )
    check_mesh_batch_sizes(cfg, dict(placement.train_mesh.shape))
    return placement
