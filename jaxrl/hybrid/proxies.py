"""The driver's stand-ins for the roles, the rollout engine and the weight sync of a hybrid run.

:class:`jaxrl.trainer.Trainer` runs unchanged in the Ray driver: where a single-process run's
:class:`~jaxrl.build.Components` hold the roles themselves, a hybrid run's hold these objects, whose methods are
calls to a worker group (:class:`~jaxrl.hybrid.groups.WorkerGroup.call`). A batch goes to the group as
:class:`~jaxrl.batch.RLBatch` of numpy arrays through Ray's object store; results come back the same way.

=====================  ====================================================  =============================
stand-in               Trainer calls                                          group method
=====================  ====================================================  =============================
RemoteActor            compute_log_probs, update, merged_params, state,      TrainWorker.*("actor", ...)
                       load_state
RemoteReference        compute_log_probs                                      TrainWorker.compute_log_probs("ref")
RemoteCritic           compute_values, update, state, load_state              TrainWorker.*("critic", ...)
RemoteRollout          generate                                               RolloutWorker.generate
RemoteWeightSync       sync(actor.merged_params())                            TrainWorker.weights ->
                                                                              RolloutWorker.update_weights
=====================  ====================================================  =============================
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

log = logging.getLogger("jaxrl")

__all__ = ["GroupMemory", "HybridPlacement", "RemoteActor", "RemoteCritic", "RemoteReference", "RemoteRollout",
           "RemoteWeightSync", "WeightCopy"]


def _to_numpy(tree: Any) -> Any:
    """A checkpoint's restored arrays (on the driver's CPU device) as numpy, for the trip to the group."""
    import jax
    import numpy as np

    return jax.tree.map(np.asarray, tree)


class _RemoteRole:
    """A trained role living in the train group, named ``role`` there."""

    def __init__(self, group, role: str):
        self.group, self.role = group, role

    def update(self, batch) -> dict[str, float]:
        """One update on ``batch`` in the train group; the role's metrics."""
        return self.group.call("update", self.role, batch)

    def state(self) -> tuple[Any, dict]:
        """``(arrays, meta)`` as :meth:`TrainedRole.state`, the arrays copied to the driver's host memory."""
        return self.group.call("state", self.role)

    def load_state(self, arrays: Any, meta: dict) -> None:
        """Restore the role in the train group (placed there on its live shardings)."""
        self.group.call("load_state", self.role, _to_numpy(arrays), meta)


class RemoteActor(_RemoteRole):
    """The actor (:class:`jaxrl.workers.actor.ActorWorker`) in the train group."""

    def __init__(self, group, *, lora: bool = False):
        super().__init__(group, "actor")
        self.has_lora = lora

    def compute_log_probs(self, batch):
        """``(old_log_probs, entropy)`` float32 ``[N, R]``."""
        return self.group.call("compute_log_probs", "actor", batch)

    def merged_params(self) -> "WeightCopy":
        """The policy's current weights as a host copy in Ray's object store (:meth:`TrainWorker.weights`)."""
        return WeightCopy(**self.group.call("weights"))

    rollout_params = merged_params  # what Trainer.sync_rollout hands the engine: a host copy either way


class RemoteReference:
    """The frozen reference policy in the train group."""

    def __init__(self, group):
        self.group = group

    def compute_log_probs(self, batch):
        return self.group.call("compute_log_probs", "ref", batch)


class RemoteCritic(_RemoteRole):
    """The critic (:class:`jaxrl.workers.critic.CriticWorker`) in the train group."""

    def __init__(self, group):
        super().__init__(group, "critic")

    def compute_values(self, batch):
        """Values float32 ``[N, R]``."""
        return self.group.call("compute_values", batch)


@dataclasses.dataclass(frozen=True)
class WeightCopy:
    """One host copy of the policy's weights in Ray's object store, put there by the train group.

    Attributes:
      ref: ``[ObjectRef]`` of the ``nnx.State`` with numpy leaves (in a list, so Ray passes it on unresolved).
      bytes: its size; tensors: its leaf count; gather_s: seconds the train group took to gather and put it.
    """

    ref: list
    bytes: int
    tensors: int
    gather_s: float


class RemoteRollout:
    """The rollout engine in the rollout group: ``generate`` as :class:`jaxrl.rollout.base.RolloutEngine`.

    A group that is one JAX world gets each call whole (one-to-all: the mesh shards the rows). A group of independent
    engines (vLLM per host, ``group.own_world`` False) gets each call split by data-parallel rank: member ``k`` samples
    a contiguous share of the prompts, with the seeds of its rows in the whole batch, and the shares are merged back
    in order (:mod:`jaxrl.hybrid.dispatch`).
    """

    def __init__(self, group, info: dict):
        self.group = group
        self.engine_name = f"{info['engine']} in the rollout group ({info['mesh']})"
        self.eos_token_ids = tuple(info.get("eos_token_ids", ()))
        self.pad_token_id = int(info.get("pad_token_id", 0))
        self.split = not getattr(group, "own_world", True) and len(getattr(group, "members", ())) > 1

    def generate(self, prompt_ids, sampling_params):
        if not self.split:
            return self.group.call("generate", prompt_ids, sampling_params)
        from jaxrl.hybrid.dispatch import merge_outputs, split_prompts

        ranges = [(a, b) for a, b in split_prompts(len(prompt_ids), len(self.group.members)) if b > a]
        outs = self.group.call_each("generate", [(list(prompt_ids[a:b]), sampling_params, a * sampling_params.n)
                                                 for a, b in ranges])
        return merge_outputs(outs, first_prompts=[a for a, _ in ranges], pad_token_id=self.pad_token_id)


class GroupMemory:
    """The hybrid run's per-step memory metrics (``Components.memory_metrics``), read from the groups' members.

    verl logs ``perf/max_memory_allocated_gb``, ``perf/max_memory_reserved_gb`` and ``perf/cpu_memory_used_gb`` from
    its actor workers; here they are the **train group's** (the max over its members), the rollout group's the same
    under ``perf/rollout_group/``, and the driver's RSS as ``perf/driver/cpu_memory_used_gb``. All in GiB. The
    members' ``perf/compile_time_s`` and ``perf/num_compiles`` (since their previous report) come the same way: the
    driver compiles nothing, the groups' members do.
    """

    def __init__(self, train, rollout):
        self.train, self.rollout = train, rollout

    @staticmethod
    def _max(group) -> dict[str, float]:
        out: dict[str, float] = {}
        for member in group.call_each("memory", [()] * len(group.members)):
            for key, value in member.items():
                out[key] = max(out.get(key, value), value)
        return out

    def __call__(self) -> dict[str, float]:
        from jaxrl.metrics import memory_metrics

        out = self._max(self.train)
        out.update({k.replace("perf/", "perf/rollout_group/", 1): v for k, v in self._max(self.rollout).items()})
        out["perf/driver/cpu_memory_used_gb"] = memory_metrics()["perf/cpu_memory_used_gb"]
        return out


@dataclasses.dataclass(frozen=True)
class HybridSyncReport:
    """One weight sync across worlds (the fields :class:`jaxrl.rollout.weight_sync.WeightSyncReport` has, and the
    split of its time).

    Attributes:
      bytes_moved: bytes of the host copy that crossed through the object store (the ``sync/bytes`` metric).
      seconds: the whole sync, as the driver saw it; gather_s: the train group's gather and put; load_s: the
        rollout group's load through its translator (the object-store transfer is the rest).
      num_tensors: tensors moved.
    """

    bytes_moved: int
    seconds: float
    num_tensors: int
    gather_s: float
    load_s: float


class RemoteWeightSync:
    """The train group's weights -> the rollout group's engine.

    The train group gathers its (sharded) weights into one host copy and puts it into Ray's object store; the
    rollout group's ``update_weights`` receives it (Ray moves the object between the nodes) and loads it through
    its translator onto its mesh. Any failure there is the rollout group's ``WeightSyncError`` (the engine keeps
    its previous weights); a member lost meanwhile is a :class:`~jaxrl.hybrid.groups.GroupFailure`.
    """

    def __init__(self, group, engine: RemoteRollout, timeout_s: float | None = None):
        self.group, self.engine, self.timeout_s = group, engine, timeout_s
        self.num_syncs = 0
        self.reports: list[HybridSyncReport] = []

    def sync(self, weights: WeightCopy) -> HybridSyncReport:
        """Move ``weights`` into the rollout group's engine.

        Raises:
          WeightSyncError: the rollout group's load failed (its own error) or did not finish within ``timeout_s``
            (``actor_rollout_ref.rollout.update_weights_timeout_s``); the engine then keeps (or, timed out, may still
            be loading) the previous weights, and the run stops: never a rollout on stale weights.
          GroupFailure: a member of a group was lost meanwhile.
        """
        from jaxrl.hybrid.groups import GroupTimeout
        from jaxrl.rollout.base import WeightSyncError

        t0 = time.perf_counter()
        try:  # a top-level ref: Ray resolves it in each member (the copy moves node to node)
            loaded = self.group.call("update_weights", weights.ref[0], timeout_s=self.timeout_s)
        except GroupTimeout as e:
            raise WeightSyncError(f"weight sync #{self.num_syncs + 1} across worlds into {self.engine.engine_name}: "
                                  f"{e} (actor_rollout_ref.rollout.update_weights_timeout_s); the run stops rather "
                                  "than generate with stale weights") from None
        self.num_syncs += 1
        report = HybridSyncReport(bytes_moved=weights.bytes, seconds=weights.gather_s + time.perf_counter() - t0,
                                  num_tensors=weights.tensors, gather_s=weights.gather_s, load_s=loaded["load_s"])
        self.reports.append(report)
        log.info("weight sync #%d across worlds: %.2f MB in %.3f s (train group gather %.3f s, rollout group load "
                 "%.3f s)", self.num_syncs, report.bytes_moved / 1e6, report.seconds, report.gather_s, report.load_s)
        return report


@dataclasses.dataclass(frozen=True)
class HybridPlacement:
    """``Components.placement`` of a hybrid run: the two groups, for the log (kind ``"hybrid"``: the engine never
    shares the train group's buffers, so the async pipeline needs no weight copy)."""

    train: str
    rollout: str
    kind: str = "hybrid"

    def describe(self) -> str:
        return f"hybrid: train group {self.train}; rollout group {self.rollout}"
