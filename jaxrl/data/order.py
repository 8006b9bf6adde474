"""Which examples each training batch holds: a seeded, epoch-wise, checkpointable order over ``N`` examples.

Epoch ``e`` visits every example exactly once, in the permutation
``grain.MapDataset.source(range(N)).shuffle(seed).repeat()[e*N:(e+1)*N]`` (grain reseeds its index shuffle per epoch
with ``seed + e``; without ``shuffle``: dataset order), cut into ``batch_size`` batches; with ``drop_last`` the last
``N % batch_size`` positions of each epoch's permutation are not served that epoch. The order is random-access, so
the state is just ``(epoch, step_in_epoch)`` and resuming reproduces an uninterrupted run exactly. Used by the prompt
pipeline of the RL trainer (:class:`jaxrl.data.pipeline.PromptPipeline`) and the offline trainers' example batches
(:mod:`jaxrl.data.offline`).

Note: ``grain`` imports ``jax`` on import.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import grain

_STATE_VERSION = 1

__all__ = ["EpochOrder"]


class EpochOrder:
    """The positions of each batch, epoch after epoch.

    Args:
      num_examples: ``N`` >= 1.
      batch_size: positions per batch, >= 1.
      shuffle: a seeded permutation per epoch (different each epoch); False -> dataset order.
      seed: an int in ``[0, 2**32)``.
      drop_last: drop each epoch's final partial batch (every batch then has ``batch_size`` positions; needs
        ``N >= batch_size``).

    Attributes:
      steps_per_epoch: ``N // batch_size`` with ``drop_last``, else ``ceil(N / batch_size)``.
      epoch: the epoch of the most recently returned batch (0 before the first).

    Raises:
      ValueError: ``N < 1``, a bad ``batch_size`` / ``seed``, or ``drop_last`` with ``N < batch_size``.
    """

    def __init__(self, num_examples: int, *, batch_size: int, shuffle: bool, seed: int, drop_last: bool):
        if not isinstance(num_examples, int) or num_examples < 1:
            raise ValueError(f"num_examples must be an int >= 1, got {num_examples!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
        if drop_last and num_examples < batch_size:
            raise ValueError(f"{num_examples} examples < batch_size={batch_size} with drop_last=True: an epoch would "
                             "have no batch")
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.steps_per_epoch = num_examples // batch_size if drop_last else math.ceil(num_examples / batch_size)
        source = grain.MapDataset.source(list(range(num_examples)))
        self._order = (source.shuffle(seed) if shuffle else source).repeat(None)
        self.epoch = 0
        self._step = 0  # batches of self.epoch already returned
        self._epoch_cache: tuple[int, grain.MapDataset] | None = None

    def _epoch_positions(self, epoch: int) -> grain.MapDataset:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            n = self.num_examples
            self._epoch_cache = (epoch, self._order[epoch * n : (epoch + 1) * n])
        return self._epoch_cache[1]

    def next_positions(self) -> list[int]:
        """The next batch's positions (``batch_size`` of them; fewer only for an epoch's last batch without
        ``drop_last``); rolls over to the next (reshuffled) epoch after ``steps_per_epoch`` batches."""
        if self._step >= self.steps_per_epoch:
            self.epoch += 1
            self._step = 0
        order = self._epoch_positions(self.epoch)
        start = self._step * self.batch_size
        stop = min(start + self.batch_size, self.num_examples)
        self._step += 1
        return [int(order[i]) for i in range(start, stop)]

    @property
    def step_in_epoch(self) -> int:
        """Batches of :attr:`epoch` already returned."""
        return self._step

    @property
    def global_step(self) -> int:
        """Batches returned so far over all epochs."""
        return self.epoch * self.steps_per_epoch + self._step

    def get_state(self) -> dict:
        """JSON-serialisable state: the position plus the settings the order depends on."""
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "step_in_epoch": self._step,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_rows": self.num_examples,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
        }

    def set_state(self, state: Mapping) -> None:
        """Resume from :meth:`get_state`: the next batch equals the one an uninterrupted run would give.

        Raises:
          ValueError: the state is malformed, or was saved with other ``seed`` / ``shuffle`` / ``num_rows`` /
            ``batch_size`` / ``drop_last`` (the names and both values are given).
        """
        mine = self.get_state()
        missing = [k for k in mine if k not in state]
        if missing:
            raise ValueError(f"pipeline state is missing keys {missing}; got keys {sorted(state)}")
        diffs = [
            f"{k}: saved {state[k]!r}, now {mine[k]!r}"
            for k in ("version", "seed", "shuffle", "num_rows", "batch_size", "drop_last")
            if state[k] != mine[k]
        ]
        if diffs:
            raise ValueError("pipeline state does not match this pipeline (" + "; ".join(diffs) + ")")
        epoch, step = state["epoch"], state["step_in_epoch"]
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(step, int) and 0 <= step <= self.steps_per_epoch):
            raise ValueError(
                f"invalid position epoch={epoch!r} step_in_epoch={step!r} (steps_per_epoch={self.steps_per_epoch})"
            )
        self.epoch, self._step = epoch, step
