"""Partial rollouts for the async pipeline (``async_training.partial_rollout=True``, staleness k >= 2).

Without them a batch is generated whole by one version of the weights during one training step. With them each
batch is generated in k *stages* of ``ceil(R / k)`` new tokens, one stage per training step, and every stage uses the
weights of the step before it: a response unfinished at a weight sync continues under the new weights (AReaL's and
verl's fully-async "partial rollout"), so its tokens carry per-token version tags (``RLBatch.policy_version``
``[N, R]``). The pipeline's unit of work per step is :meth:`StagedRollout.work`: every batch in flight advances one
stage (k batches, each at another stage), a new batch begins, the batch whose last stage ran is scored.

The stage boundaries are fixed in tokens, not in time, so a run is reproducible and resumable: :meth:`state` is the
in-flight batches at a stage boundary (their tokens, masks, log-probs, versions and which prompts they answer).
A stage continues a response by prompting the engine with the prompt followed by the response so far (the engine
recomputes that prefix's KV cache under the new weights, as AReaL's interruptible generation does on resume); rows
that ended (a stop token, or R tokens) take no part.

No jax here: the engine, the sampling settings, the prompt source and the scoring come in as callables.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import numpy as np

from jaxrl.async_rollout import ReadyBatch, batch_from_json, batch_to_json
from jaxrl.batch import RLBatch
from jaxrl.rollout.base import RolloutOutput

__all__ = ["StagedRollout", "stage_lengths"]


def stage_lengths(response_width: int, stages: int) -> list[int]:
    """New tokens of each stage: ``ceil(R / stages)`` each, the last one what is left (R >= stages).

    Raises:
      ValueError: ``response_width`` < ``stages`` or ``stages`` < 1.
    """
    if stages < 1 or response_width < stages:
        raise ValueError(f"cannot cut {response_width} response tokens into {stages} stages (needs R >= stages >= 1)")
    size = math.ceil(response_width / stages)
    lengths = [min(size, response_width - s * size) for s in range(stages)]
    return [n for n in lengths if n > 0]


@dataclasses.dataclass
class _InFlight:
    """A batch between its first and last stage (host arrays, ``N`` rows, ``R`` response tokens)."""

    index: int
    prompt_rows: list[int]  # the prompt batch's dataset row indices (PromptBatch.indices)
    epoch: int
    stage: int  # stages done
    out: RolloutOutput  # prompt arrays of the first stage, the responses so far in [N, R]
    version: np.ndarray  # int32 [N, R]: the weights' version of each generated token (-1: none)
    length: np.ndarray  # int32 [N]: tokens generated so far
    done: np.ndarray  # bool [N]: the row ended (a stop token or R tokens)
    gen_s: float  # seconds of generation so far


class StagedRollout:
    """Batches generated in stages across training steps (see the module docstring).

    Args:
      stages: k >= 2, the stages of a batch (the pipeline's staleness).
      response_width: R, the response tokens of a batch (``rollout.max_new_tokens``).
      generate: the rollout engine's ``generate(prompts, SamplingParams)`` -> RolloutOutput.
      sampling: ``(index, stage, max_new_tokens, n) -> SamplingParams`` of a stage of batch ``index``.
      draw: the next prompt batch (:class:`jaxrl.data.pipeline.PromptBatch`).
      prompts_of: ``(row indices, epoch) -> PromptBatch``: a saved batch's prompts again (after a resume).
      finish: ``(index, prompt batch, output, timings) -> (batch, metrics, epoch)``: scores a finished batch (phase
        reward) given its generation output.
      stop_ids: the ids that end a response (the engine's eos ids unless ``ignore_eos``, and the stop tokens).
    """

    def __init__(self, *, stages: int, response_width: int, generate: Callable, sampling: Callable, draw: Callable,
                 prompts_of: Callable, finish: Callable, stop_ids: tuple[int, ...]):
        self.lengths = stage_lengths(response_width, stages)
        self.r = int(response_width)
        self._generate, self._sampling, self._draw = generate, sampling, draw
        self._prompts_of, self._finish = prompts_of, finish
        self._stops = np.asarray(sorted(set(stop_ids)), np.int64)
        self._inflight: list[_InFlight] = []
        self._prompts: dict[int, Any] = {}  # index -> PromptBatch of the batches in flight

    @property
    def pending(self) -> bool:
        """True while a batch is between its first and last stage."""
        return bool(self._inflight)

    def work(self, index: int | None, version: int) -> list[ReadyBatch]:
        """One training step's generation with the weights of ``version``: every batch in flight runs its next stage,
        batch ``index`` (None: no new batch) runs its first; returns the batches whose last stage ran, scored."""
        finished = []
        for b in list(self._inflight):
            self._stage(b, version)
            if b.stage == len(self.lengths):
                self._inflight.remove(b)
                finished.append(self._score(b))
        if index is not None:
            b = self._begin(index, version)
            if b.stage == len(self.lengths):  # (one stage: never, stages >= 2; kept for the general case)
                finished.append(self._score(b))
            else:
                self._inflight.append(b)
        return finished

    # -- stages -----------------------------------------------------------------------------------------------------

    def _begin(self, index: int, version: int) -> _InFlight:
        t0 = time.perf_counter()
        prompts = self._draw()
        n_new = self.lengths[0]
        sp = self._sampling(index, 0, n_new, None)
        first = self._generate(prompts.prompt_ids, sp)
        rows = first.response_ids.shape[0]
        out = RolloutOutput(
            prompt_ids=first.prompt_ids, prompt_mask=first.prompt_mask,
            response_ids=np.zeros((rows, self.r), np.int32), response_mask=np.zeros((rows, self.r), np.int32),
            rollout_log_probs=np.zeros((rows, self.r), np.float32), prompt_index=first.prompt_index)
        b = _InFlight(index=index, prompt_rows=list(prompts.indices), epoch=int(prompts.epoch), stage=0, out=out,
                      version=np.full((rows, self.r), -1, np.int32), length=np.zeros(rows, np.int32),
                      done=np.zeros(rows, bool), gen_s=0.0)
        self._prompts[index] = prompts
        self._write(b, np.arange(rows), first, n_new, version)
        b.gen_s += time.perf_counter() - t0
        return b

    def _stage(self, b: _InFlight, version: int) -> None:
        t0 = time.perf_counter()
        n_new = self.lengths[b.stage]
        active = np.flatnonzero(~b.done)
        if active.size:
            prompts = self._prompts_for(b)
            contexts = [prompts.prompt_ids[b.out.prompt_index[i]] + b.out.response_ids[i, : b.length[i]].tolist()
                        for i in active]
            sp = self._sampling(b.index, b.stage, n_new, 1)
            self._write(b, active, self._generate(contexts, sp), n_new, version)
        else:
            b.stage += 1
        b.gen_s += time.perf_counter() - t0

    def _write(self, b: _InFlight, rows: np.ndarray, got: RolloutOutput, n_new: int, version: int) -> None:
        """Append a stage's tokens of ``rows`` (its output rows, in order) to the batch."""
        valid = got.response_mask.sum(-1).astype(np.int32)
        for j, i in enumerate(rows):
            start, m = int(b.length[i]), int(valid[j])
            b.out.response_ids[i, start : start + m] = got.response_ids[j, :m]
            b.out.response_mask[i, start : start + m] = 1
            b.out.rollout_log_probs[i, start : start + m] = got.rollout_log_probs[j, :m]
            b.version[i, start : start + m] = version
            b.length[i] = start + m
            stopped = m < n_new or (m > 0 and np.isin(got.response_ids[j, m - 1], self._stops))
            b.done[i] = bool(stopped or b.length[i] >= self.r)
        b.stage += 1

    def _score(self, b: _InFlight) -> ReadyBatch:
        prompts = self._prompts_for(b)
        del self._prompts[b.index]
        timings = {"gen": b.gen_s}
        batch, metrics, epoch = self._finish(b.index, prompts, b.out, timings)
        batch.policy_version = b.version.copy()
        return ReadyBatch(index=b.index, version=int(b.version[b.version >= 0].min(initial=0)), batch=batch,
                          metrics=dict(metrics), timings=dict(timings), epoch=int(epoch))

    def _prompts_for(self, b: _InFlight):
        if b.index not in self._prompts:
            self._prompts[b.index] = self._prompts_of(b.prompt_rows, b.epoch)
        return self._prompts[b.index]

    # -- checkpoint state ---------------------------------------------------------------------------------------------

    def state(self) -> list[dict]:
        """The batches in flight, JSON (at a stage boundary: call it while no :meth:`work` runs)."""
        out = []
        for b in self._inflight:
            arrays = RLBatch(prompt_ids=b.out.prompt_ids, prompt_mask=b.out.prompt_mask,
                             response_ids=b.out.response_ids, response_mask=b.out.response_mask,
                             group_ids=b.out.prompt_index, rollout_log_probs=b.out.rollout_log_probs,
                             policy_version=b.version)
            out.append({"index": b.index, "prompt_rows": b.prompt_rows, "epoch": b.epoch, "stage": b.stage,
                        "length": b.length.tolist(), "done": b.done.tolist(), "gen_s": b.gen_s,
                        "arrays": batch_to_json(arrays)})
        return out

    def load_state(self, state: list[dict]) -> None:
        """Restore :meth:`state` (the prompts are read again from the data by their row indices)."""
        self._inflight, self._prompts = [], {}
        for d in state:
            a = batch_from_json(d["arrays"])
            out = RolloutOutput(prompt_ids=a.prompt_ids, prompt_mask=a.prompt_mask, response_ids=a.response_ids,
                                response_mask=a.response_mask, rollout_log_probs=a.rollout_log_probs,
                                prompt_index=a.group_ids)
            self._inflight.append(_InFlight(
                index=int(d["index"]), prompt_rows=[int(i) for i in d["prompt_rows"]], epoch=int(d["epoch"]),
                stage=int(d["stage"]), out=out, version=a.policy_version, length=np.asarray(d["length"], np.int32),
                done=np.asarray(d["done"], bool), gen_s=float(d["gen_s"])))
