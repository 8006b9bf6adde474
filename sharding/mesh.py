"""Device meshes for training and rollout.

The training mesh has three named axes (the same names the logical-axis rules in :mod:`sharding.rules` map to):

* ``"data"``   - pure data parallelism: parameters replicated, the batch split.
* ``"fsdp"``   - fully-sharded data parallelism: the batch split *and* parameters sharded (ZeRO-3 style).
* ``"tensor"`` - tensor (model) parallelism: heads / MLP columns / vocabulary split.

Multi-host: ``jax.devices()`` lists the devices of *every* process (``jax.process_count()`` hosts after
``jax.distributed.initialize()``), so a mesh built from it spans all hosts; each process then only holds the
shards of its own ``jax.local_devices()``. Every process must call these functions with the same arguments.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

__all__ = ["MESH_AXES", "make_mesh", "split_devices"]

MESH_AXES: tuple[str, str, str] = ("data", "fsdp", "tensor")


def _check_size(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or (value < 1 and value != -1):
        raise ValueError(f"mesh axis {name}={value!r} is invalid; use a positive int, or -1 to fill the rest")
    return int(value)


def _device_list(devices) -> list:
    devs = list(jax.devices()) if devices is None else list(np.asarray(devices, dtype=object).ravel())
    if not devs:
        raise ValueError("devices is empty; pass at least one device (or None for jax.devices())")
    if len({d.id for d in devs}) != len(devs):
        raise ValueError(f"devices contains duplicates: {[d.id for d in devs]}")
    return devs


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, *, devices: Sequence | None = None) -> Mesh:
    """Build a ``("data", "fsdp", "tensor")`` mesh over ``devices``.

    Args:
        data, fsdp, tensor: axis sizes (positive ints). At most one may be ``-1``: it becomes
            ``len(devices) // product(other sizes)``.
        devices: the devices to use, in order (e.g. one half of :func:`split_devices`). ``None`` means
            ``jax.devices()`` - all devices of all processes - arranged by ``jax.make_mesh``, which follows
            the physical topology on TPU/GPU. Explicit devices are laid out in the given order (row-major:
            ``tensor`` varies fastest, so tensor-parallel groups are adjacent devices).

    Returns:
        a :class:`jax.sharding.Mesh` with axis names ``("data", "fsdp", "tensor")`` and ``AxisType.Auto`` axes
        (sharding propagation by the compiler, as ``jax.jit`` with explicit in/out shardings expects).

    Raises:
        ValueError: a size that is not a positive int or -1, more than one -1, a product of sizes that does not
            equal the device count (or, with a -1, does not divide it); the message names the sizes and the
            device count.
    """
    sizes = {"data": _check_size("data", data), "fsdp": _check_size("fsdp", fsdp),
             "tensor": _check_size("tensor", tensor)}
    devs = _device_list(devices)
    n = len(devs)
    fill = [k for k, v in sizes.items() if v == -1]
    if len(fill) > 1:
        raise ValueError(f"at most one mesh axis may be -1; got {sizes} for {n} devices")
    if fill:
        known = math.prod(v for v in sizes.values() if v != -1)
        if n % known:
            raise ValueError(
                f"mesh sizes {sizes}: the fixed axes multiply to {known}, which does not divide the {n} devices"
            )
        sizes[fill[0]] = n // known
    shape = tuple(sizes[a] for a in MESH_AXES)
    if math.prod(shape) != n:
        raise ValueError(
            f"mesh sizes data={shape[0]} x fsdp={shape[1]} x tensor={shape[2]} = {math.prod(shape)} "
            f"do not match the {n} devices; make the product equal {n} or set one axis to -1"
        )
    axis_types = (AxisType.Auto,) * 3
    if devices is None:
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types)
    return Mesh(np.array(devs, dtype=object).reshape(shape), MESH_AXES, axis_types=axis_types)


def split_devices(n_train: int, n_rollout: int, devices: Sequence | None = None) -> tuple[list, list]:
    """Split devices into disjoint training and rollout sets (split placement).

    Devices are ordered by ``(process_index, id)`` first, so on several hosts each set is made of whole
    consecutive hosts where the counts allow it; the first ``n_train`` go to training, the next ``n_rollout``
    to rollout, any rest is unused.

    Args:
        n_train, n_rollout: how many devices each side gets (positive ints).
        devices: the pool; ``None`` means ``jax.devices()`` (every process's devices).

    Returns:
        ``(train_devices, rollout_devices)``: two disjoint lists.

    Raises:
        ValueError: a count that is not a positive int, or ``n_train + n_rollout`` larger than the pool
            (the message names both counts and the pool size).
    """
    for name, v in (("n_train", n_train), ("n_rollout", n_rollout)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive int")
    devs = sorted(_device_list(devices), key=lambda d: (d.process_index, d.id))
    if n_train + n_rollout > len(devs):
        raise ValueError(
            f"split placement needs n_train + n_rollout = {n_train} + {n_rollout} = {n_train + n_rollout} "
            f"devices, but only {len(devs)} are available"
        )
    return devs[:n_train], devs[n_train : n_train + n_rollout]
