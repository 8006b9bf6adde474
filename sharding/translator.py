"""Running a translation plan: :class:`Translator` reshards the trainer's params into the target layout.

The plan model lives in :mod:`sharding.plan` (:class:`Plan`, :class:`Rule`, :class:`Step`, :class:`TargetSpec`,
:func:`validate_plan`), the per-target tables in :mod:`sharding.targets` (:func:`build_plan`; the ``"jax"``,
``"hf"``, ``"vllm"`` and ``"jetstream"`` targets are described there), the Hugging Face name/layout table in
:mod:`sharding.hf_layout`, the piecewise device-to-device transfer in :mod:`sharding.transfer`. Their public
names are re-exported here and from :mod:`sharding`.

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

import math
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from sharding.plan import (
    KINDS,
    ModelInfo,
    Plan,
    Rule,
    SourceParam,
    Step,
    TargetSpec,
    _flat_state,
    describe_source,
    validate_plan,
)
from sharding.targets import build_plan
from sharding.transfer import PieceTransfer, is_replicated, peak_elements, stage_spec

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


class _Program(NamedTuple):
    fn: Callable | None  # jitted layout program (None when every rule is a plain copy)
    direct: bool  # one jit straight to the target shardings (colocated)
    stage: dict[str, NamedSharding]  # where each computed target sits before the transfer
    passthrough: tuple[Rule, ...]  # rules without steps: their source is transferred as is
    transfer: PieceTransfer | None  # built on the first sync (needs the stage outputs' layouts)


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
                    stage[r.target] = NamedSharding(src_mesh, stage_spec(shape, r.sharding, src_mesh))

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
                    transfer=PieceTransfer(out, {r.target: r.sharding for r in self.plan.rules}))
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
                peak = max(peak, peak_elements(compiled.as_text()))
            checks.append(RuleCheck(r.target, math.prod(shape), peak, is_replicated(r.sharding), stage))
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

