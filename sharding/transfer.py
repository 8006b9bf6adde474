"""Moving translated tensors between device sets: the piecewise transfer and its placement helpers.

:class:`PieceTransfer` reshards arrays to target shardings by device-to-device copies of shard pieces (used by
:class:`sharding.translator.Translator` for split placement, where the target devices differ from the source
devices); :func:`stage_spec` spreads a computed tensor over the source mesh before that transfer;
:func:`peak_elements` reads the largest per-device buffer of a compiled (SPMD-partitioned) program, which
``Translator.check_placement`` reports.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["PieceTransfer", "is_replicated", "peak_elements", "stage_spec"]

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


def peak_elements(hlo_text: str) -> int:
    """Largest array (elements) in an SPMD-partitioned HLO module (per-device shapes)."""
    peak = 0
    for line in hlo_text.splitlines():
        typ = _result_type(line)
        if not typ:
            continue
        for dims in _SHAPE_RE.findall(typ):
            peak = max(peak, math.prod(int(x) for x in dims.split(",") if x) if dims else 1)
    return peak


def stage_spec(shape: tuple[int, ...], target: NamedSharding, mesh: Mesh) -> PartitionSpec:
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


def is_replicated(sh: NamedSharding) -> bool:
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


class PieceTransfer:
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

