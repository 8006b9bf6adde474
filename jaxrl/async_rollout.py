"""Generation ahead of training: the bounded-staleness rollout pipeline (``async_training.staleness`` = k >= 1).

Version u names the actor's weights after training step u (u = 0: the initial weights). The batch that step b trains
on (its *index* b) is generated with version ``v(b) = max(0, b - 1 - k)``, so it is at most k versions older than the
weights the step updates (verl's one-step-off-policy recipe is k = 1; AReaL and verl's fully-async trainer bound
staleness the same way). One generation runs at a time, on a thread of its own, while the trainer works::

    start (engine at version u)   batches u+1 .. u+k generated now (a fresh start; a resume has them saved), then
                                  batch u+k+1 launched on the generation thread with version u
    step b (trainer)              take batch b (ready) -> old_log_prob -> ... -> update_actor   | thread: batch b+k
    end of step b (advance)       wait for the thread (timing_s/wait_prev_gen: the only wait), version b -> engine,
                                  launch batch b+k+1 with version b

Exactness. A batch depends only on its weights' version, its prompts (the data iterator's position) and its seed (the
step index: the sampler seeds every row from it), never on thread timing. A checkpoint after step u holds the k
finished batches u+1 .. u+k (arrays, metrics, timings, version tags) and the data position before batch u+k+1's
prompts; batch u+k+1 is generated again after a resume, from the checkpoint's weights, which are the version it was
launched with. So a run killed at any moment and resumed logs what the uninterrupted run logs.

The trainer hands in what to do (a generator: :class:`WholeBatches` over ``produce``, phases gen + reward for a step
index, or with partial rollouts :class:`jaxrl.partial_rollout.StagedRollout`; ``sync_weights``: the actor's current
weights into the engine); this module only orders the calls and keeps the buffer (no jax here). With partial rollouts
the unit of work launched at the end of step b advances every batch in flight by one stage and begins batch b + k + 1;
the checkpoint then also holds the batches between stages.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import numpy as np

from jaxrl.batch import RLBatch

log = logging.getLogger("jaxrl")

__all__ = ["AsyncRollout", "ReadyBatch", "batch_from_json", "batch_to_json"]


@dataclasses.dataclass
class ReadyBatch:
    """A generated and scored batch waiting for its training step.

    Attributes:
      index: the training step that consumes it (1-based).
      version: the policy version of the weights that generated it (``batch.policy_version`` holds it per row).
      batch: the rows after phases gen + reward (``token_level_scores`` set).
      metrics: the round's metrics (``reward/*``, DAPO's counts, ...).
      timings: seconds of the round's phases (``gen``, ``reward``, ...).
      epoch: the data epoch its prompts came from.
    """

    index: int
    version: int
    batch: RLBatch
    metrics: dict
    timings: dict
    epoch: int


# A step index -> (batch, metrics, timings, epoch): phases gen + reward for that step (jaxrl.trainer supplies it).
Produce = Callable[[int], "tuple[RLBatch, dict, dict, int]"]


class WholeBatches:
    """The pipeline's generation without partial rollouts: a unit of work generates one whole batch with one version of
    the weights (``produce``: phases gen + reward of a step index)."""

    pending = False  # nothing stays between units

    def __init__(self, produce: Produce):
        self._produce = produce

    def work(self, index: int | None, version: int) -> list[ReadyBatch]:
        if index is None:
            return []
        batch, metrics, timings, epoch = self._produce(index)
        batch.policy_version = np.full(batch.response_ids.shape, version, np.int32)
        return [ReadyBatch(index=index, version=version, batch=batch, metrics=dict(metrics), timings=dict(timings),
                           epoch=int(epoch))]

    def state(self) -> list:
        return []

    def load_state(self, state: list) -> None:
        if state:
            raise ValueError("the checkpoint holds partial rollouts but async_training.partial_rollout is off")


class AsyncRollout:
    """The pipeline between the rollout engine and the trainer (see the module docstring for the schedule).

    Args:
      staleness: k >= 1, the most versions a trained batch may lag.
      total_steps: the run's last step; no batch beyond it is begun.
      generator: one step's generation, ``work(index | None, version) -> [ReadyBatch]`` (begin batch ``index`` and
        return the batches that finished), with ``pending`` (batches left unfinished between units) and
        ``state()`` / ``load_state()``: :class:`WholeBatches`, or :class:`jaxrl.partial_rollout.StagedRollout`. Its
        ``work`` runs on the generation thread, the only user of the rollout engine and the data iterator meanwhile.
      sync_weights: puts the actor's current weights into the engine (called only while the engine is idle); returns
        the bytes moved.
      data: the prompt pipeline (``get_state``); read only while no generation is in flight.

    Raises:
      ValueError: ``staleness`` < 1.
    """

    def __init__(self, *, staleness: int, total_steps: int, generator: Any, sync_weights: Callable[[], int],
                 data: Any):
        if int(staleness) < 1:
            raise ValueError(f"staleness={staleness!r}; the pipeline needs k >= 1 (0 is the synchronous trainer)")
        self.k = int(staleness)
        self.total = int(total_steps)
        self._gen = generator
        self._sync_weights = sync_weights
        self._data = data
        self._ready: dict[int, ReadyBatch] = {}
        self._next_index = 1  # the next batch to begin
        self._version: int | None = None  # the engine's weights; None until start()
        self._thread: threading.Thread | None = None
        self._outcome: list[ReadyBatch] | BaseException | None = None
        self._snapshot: dict | None = None  # the state before the last launch (what a checkpoint holds)
        self._step_started = 0.0
        # perf_counter() when the unit launched last began and ended (None: no unit, or still running)
        self._unit_started: float | None = None
        self._unit_finished: float | None = None

    # -- the schedule ---------------------------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._version is not None

    def start(self, version: int) -> None:
        """Begin with the engine holding ``version`` (the steps trained so far): run the units of work that bring the
        buffer to the state after step ``version`` (a fresh start: the k units that begin batches 1 .. k; a resume:
        none, the checkpoint had them), then launch the next unit on the generation thread."""
        self._version = int(version)
        self._next_index = max(self._next_index, self._version + 1)
        log.info("async rollout (staleness %d): batches %s ready from the checkpoint, generating from batch %d with the "
                 "weights of step %d", self.k, sorted(self._ready), self._next_index, self._version)
        while self._next_index <= min(self._version + self.k, self.total):
            index = self._next_index
            self._next_index += 1
            self._add(self._gen.work(index, self._version))
        self._launch()

    def take(self, index: int) -> ReadyBatch:
        """The batch of step ``index`` (ready by the schedule; waits if the unit finishing it is still running).

        Raises:
          RuntimeError: the schedule never generated it (a bug).
          whatever the generation raised (e.g. ``RewardError``).
        """
        self._step_started = time.perf_counter()
        if index not in self._ready:
            self._wait()
        if index not in self._ready:
            raise RuntimeError(f"async rollout: batch {index} was not generated (buffer {sorted(self._ready)})")
        return self._ready.pop(index)

    def advance(self, version: int, sync: bool) -> dict[str, float]:
        """End of step ``version``: wait for the generation in flight, give the engine the weights of ``version``
        (``sync``: the actor changed this step), launch the next unit.

        Returns:
          the step's ``sync/bytes`` (moved by the sync; 0 without one), ``timing_s/wait_prev_gen`` (seconds waited for
          the generation in flight: the pipeline's only wait) and ``timing_s/gen_overlap`` (seconds that generation ran
          while the trainer worked on this step, from :meth:`take` to this call).
        """
        busy_until = time.perf_counter()
        waited = self._wait()
        started, finished = self._unit_started, self._unit_finished  # the unit launched at the last advance
        overlap = 0.0
        if started is not None and finished is not None and finished >= self._step_started:
            overlap = max(0.0, min(finished, busy_until) - max(started, self._step_started))
        moved = int(self._sync_weights()) if sync else 0
        self._version = int(version)
        self._launch()
        return {"sync/bytes": moved, "timing_s/wait_prev_gen": waited, "timing_s/gen_overlap": overlap}

    @staticmethod
    def staleness_metrics(ready: ReadyBatch, trained_version: int) -> dict[str, float]:
        """``async/staleness/{mean,max}``: ``trained_version`` (the weights the step starts from) minus the version of
        each generated token (valid tokens; every token of a row shares it without partial rollouts), i.e. how many
        updates older the generating weights were; ``async/version``: ``trained_version``."""
        b = ready.batch
        mask = b.response_mask.astype(bool)
        versions = b.policy_version[mask] if mask.any() else b.policy_version.reshape(-1)
        lag = trained_version - versions.astype(np.int64)
        return {"async/staleness/mean": float(lag.mean()), "async/staleness/max": float(lag.max()),
                "async/version": float(trained_version)}

    def wait_idle(self) -> None:
        """Let the generation in flight finish (its batches stay buffered): before anything else uses the engine
        (validation)."""
        self._wait()

    def close(self) -> None:
        """Wait for the generation thread to end, discarding its outcome (the run is ending)."""
        if self._thread is not None:
            self._thread.join()
        self._thread, self._outcome = None, None

    # -- checkpoint state -----------------------------------------------------------------------------------------

    def state(self) -> dict:
        """JSON state for the checkpoint after step ``version``: the pipeline as it was before the unit of work launched
        at the end of that step (which a resume runs again, with the same weights): the finished batches, the batches
        in flight between stages (partial rollouts), the next index and ``data_state``, the data position then
        (:class:`jaxrl.run_checkpoint.RunCheckpoints` stores it as the run's data position)."""
        if self._snapshot is None:
            raise RuntimeError("async rollout: state() before start()")
        snap = self._snapshot
        saved = [snap["ready"][i] for i in sorted(snap["ready"])]
        return {"staleness": self.k, "version": self._version, "next_index": snap["next_index"],
                "data_state": snap["data_state"], "buffer": [_ready_to_json(r) for r in saved],
                "in_flight": snap["in_flight"]}

    def load_state(self, state: dict) -> None:
        """Restore :meth:`state` (before :meth:`start`; the data position is restored by the checkpoint itself).

        Raises:
          ValueError: the state was saved with another staleness, or with partial rollouts and this run has none.
        """
        if int(state["staleness"]) != self.k:
            raise ValueError(f"the checkpoint's async_training.staleness={state['staleness']} differs from this run's "
                             f"{self.k}")
        self._ready = {r.index: r for r in (_ready_from_json(x) for x in state["buffer"])}
        self._gen.load_state(state.get("in_flight", []))
        self._next_index = int(state["next_index"])

    # -- the thread -----------------------------------------------------------------------------------------------

    def _add(self, batches: list[ReadyBatch]) -> None:
        for r in batches:
            self._ready[r.index] = r

    def _launch(self) -> None:
        """Snapshot the state (for a checkpoint), then start the next unit of work with the engine's version: it
        begins batch ``next_index`` if the run still needs it and advances the batches in flight."""
        self._snapshot = {"ready": dict(self._ready), "next_index": self._next_index,
                          "data_state": self._data.get_state(), "in_flight": self._gen.state()}
        index = self._next_index if self._next_index <= self.total else None
        self._unit_started = self._unit_finished = None
        if index is None and not self._gen.pending:
            return
        if index is not None:
            self._next_index += 1
        self._outcome = None
        self._unit_started = time.perf_counter()

        def work(index=index, version=self._version):
            try:
                self._outcome = self._gen.work(index, version)
            except BaseException as e:  # noqa: BLE001 - re-raised on the trainer's thread by _wait
                self._outcome = e
            self._unit_finished = time.perf_counter()

        self._thread = threading.Thread(target=work, name=f"jaxrl-rollout-{index}", daemon=True)
        self._thread.start()

    def _wait(self) -> float:
        """Join the unit in flight (if any), buffer its batches; returns the seconds waited. Re-raises its error."""
        if self._thread is None:
            return 0.0
        t0 = time.perf_counter()
        self._thread.join()
        waited = time.perf_counter() - t0
        outcome, self._thread, self._outcome = self._outcome, None, None
        if isinstance(outcome, BaseException):
            raise outcome
        self._add(outcome)
        return waited


# -- JSON encoding of buffered batches (exact: raw bytes, base64) ------------------------------------------------

def batch_to_json(batch: RLBatch) -> dict:
    """An :class:`RLBatch` as JSON: every set field's dtype, shape and raw bytes (base64), so it round-trips bit for
    bit."""
    out = {}
    for f in dataclasses.fields(RLBatch):
        v = getattr(batch, f.name)
        if v is not None:
            a = np.ascontiguousarray(v)
            out[f.name] = {"dtype": a.dtype.str, "shape": list(a.shape),
                           "data": base64.b64encode(a.tobytes()).decode("ascii")}
    return out


def batch_from_json(d: dict) -> RLBatch:
    """The inverse of :func:`batch_to_json`."""
    arrays = {name: np.frombuffer(base64.b64decode(x["data"]), dtype=np.dtype(x["dtype"])).reshape(x["shape"]).copy()
              for name, x in d.items()}
    return RLBatch(**arrays)


def _ready_to_json(r: ReadyBatch) -> dict:
    return {"index": r.index, "version": r.version, "epoch": r.epoch, "batch": batch_to_json(r.batch),
            "metrics": {k: float(v) for k, v in r.metrics.items()},
            "timings": {k: float(v) for k, v in r.timings.items()}}


def _ready_from_json(d: dict) -> ReadyBatch:
    return ReadyBatch(index=int(d["index"]), version=int(d["version"]), batch=batch_from_json(d["batch"]),
                      metrics=dict(d["metrics"]), timings=dict(d["timings"]), epoch=int(d["epoch"]))
