"""Reward manager: score a batch of responses with a verl-style ``compute_score`` function, concurrently,
with per-call timeouts, without ever stopping the run or hanging process exit.

Each call runs in a *daemon* worker thread. A call that raises, returns a non-number / non-finite
value, or runs longer than ``timeout_s`` scores 0.0 and is counted. A timed-out call cannot be
killed (Python threads cannot be interrupted): its thread is abandoned, a fresh worker takes over
the remaining work, and because the thread is a daemon the interpreter exits without waiting for it
(``concurrent.futures`` joins its workers at exit, which is why it is not used here).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real

import numpy as np

logger = logging.getLogger(__name__)

_PENDING, _RUNNING, _DONE = 0, 1, 2


@dataclass
class RewardOutput:
    """Scores of one batch.

    Attributes:
        scores: ``[B]`` float32, one score per response (0.0 for failed / timed-out calls).
        num_errors: calls that raised or returned something that is not a finite number
            (or a dict without a finite ``"score"``).
        num_timeouts: calls that ran longer than ``timeout_s``.
        first_error: ``"index i: <ExceptionType>: message"`` of the first error (lowest index), or None.
        extra: for dict returns, every key other than ``"score"`` -> a length-``B`` list of its values
            (None where a call did not return that key); empty if no call returned a dict.
    """

    scores: np.ndarray
    num_errors: int
    num_timeouts: int
    first_error: str | None
    extra: dict = field(default_factory=dict)


def _to_score(value) -> tuple[float | None, dict | None, str | None]:
    """``(score, extras, error)`` from one return value."""
    extras = None
    if isinstance(value, Mapping):
        if "score" not in value:
            return None, None, f"dict return has no 'score' key (keys: {sorted(map(str, value))})"
        extras = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    if (
        isinstance(value, (bool, np.bool_))
        or isinstance(value, Real)
        or (isinstance(value, np.ndarray) and value.shape == () and value.dtype.kind in "biuf")
    ):
        f = float(value)
        if math.isfinite(f):
            return f, extras, None
        return None, extras, f"non-finite score {f!r}"
    return None, extras, f"non-numeric score of type {type(value).__name__}: {value!r:.80}"


class RewardManager:
    """Concurrent, fault-tolerant scorer around a verl-signature ``compute_score``.

    Args:
        compute_score: called as ``compute_score(data_source=..., solution_str=..., ground_truth=...,
            extra_info=...)``; returns a number or a dict with key ``"score"`` (other keys go to
            :attr:`RewardOutput.extra`).
        timeout_s: seconds one call may run (measured from its start), > 0.
        num_workers: concurrent calls, >= 1 (threads: they help when the function releases the GIL,
            sleeps or waits on I/O, e.g. a sandbox or a remote reward model).

    Raises:
        TypeError: ``compute_score`` is not callable.
        ValueError: ``timeout_s`` <= 0 or ``num_workers`` < 1.
    """

    def __init__(self, compute_score: Callable, *, timeout_s: float = 10.0, num_workers: int = 4):
        if not callable(compute_score):
            raise TypeError(f"compute_score must be callable, got {type(compute_score).__name__}")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        self.compute_score = compute_score
        self.timeout_s = float(timeout_s)
        self.num_workers = num_workers
        self._abandoned: list[threading.Thread] = []

    @property
    def num_stuck_threads(self) -> int:
        """Abandoned (timed-out) worker threads that are still running."""
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        return len(self._abandoned)

    def score(
        self,
        data_sources: Sequence[str],
        solution_strs: Sequence[str],
        ground_truths: Sequence,
        extra_infos: Sequence[dict | None],
    ) -> RewardOutput:
        """Score ``B`` responses; returns after at most about ``ceil(B / num_workers) * timeout_s``.

        Args:
            data_sources: ``[B]`` data-source names (``row["data_source"]``).
            solution_strs: ``[B]`` decoded responses.
            ground_truths: ``[B]`` ``reward_model.ground_truth`` values.
            extra_infos: ``[B]`` ``extra_info`` dicts or None.

        Returns:
            :class:`RewardOutput`.

        Raises:
            ValueError: the four sequences differ in length.
        """
        lengths = {
            "data_sources": len(data_sources),
            "solution_strs": len(solution_strs),
            "ground_truths": len(ground_truths),
            "extra_infos": len(extra_infos),
        }
        if len(set(lengths.values())) != 1:
            raise ValueError(f"score() inputs must have the same length, got {lengths}")
        n = len(solution_strs)
        results: list = [None] * n  # (score, extras, error)
        status = [_PENDING] * n
        started = [0.0] * n
        owner: list[threading.Thread | None] = [None] * n
        timed_out = [False] * n
        cond = threading.Condition()
        next_item = [0]
        fn = self.compute_score

        def worker() -> None:
            me = threading.current_thread()
            while True:
                with cond:
                    if next_item[0] >= n or me.abandoned:  # type: ignore[attr-defined]
                        return
                    i = next_item[0]
                    next_item[0] += 1
                    status[i], started[i], owner[i] = _RUNNING, time.monotonic(), me
                try:
                    res = _to_score(
                        fn(
                            data_source=data_sources[i],
                            solution_str=solution_strs[i],
                            ground_truth=ground_truths[i],
                            extra_info=extra_infos[i],
                        )
                    )
                except BaseException as e:  # noqa: BLE001 - a reward bug must not stop training
                    res = (None, None, f"{type(e).__name__}: {e}")
                with cond:
                    if not timed_out[i]:
                        results[i], status[i] = res, _DONE
                    cond.notify_all()

        def spawn() -> threading.Thread:
            t = threading.Thread(target=worker, name="jaxrl-reward", daemon=True)
            t.abandoned = False  # type: ignore[attr-defined]
            t.start()
            return t

        with cond:
            for _ in range(min(self.num_workers, n)):
                spawn()
            while True:
                now = time.monotonic()
                running = [i for i in range(n) if status[i] == _RUNNING]
                for i in running:
                    if now - started[i] >= self.timeout_s:
                        timed_out[i], status[i] = True, _DONE
                        owner[i].abandoned = True  # type: ignore[union-attr]
                        self._abandoned.append(owner[i])
                        if next_item[0] < n:
                            spawn()
                if all(s == _DONE for s in status):
                    break
                deadlines = [started[i] + self.timeout_s for i in range(n) if status[i] == _RUNNING]
                cond.wait(timeout=max(0.0, min(deadlines) - now) + 1e-3 if deadlines else 0.05)

        scores = np.zeros(n, dtype=np.float32)
        num_errors = num_timeouts = 0
        first_error = None
        extra: dict[str, list] = {}
        for i in range(n):
            if timed_out[i]:
                num_timeouts += 1
                continue
            value, extras, err = results[i]
            if err is not None:
                num_errors += 1
                first_error = first_error or f"index {i}: {err}"
                continue
            scores[i] = value
            for k, v in (extras or {}).items():
                extra.setdefault(k, [None] * n)[i] = v
        if num_errors:
            logger.warning(
                "reward function failed on %d of %d responses (scored 0.0); first: %s",
                num_errors,
                n,
                first_error,
            )
        if num_timeouts:
            logger.warning(
                "reward function timed out (> %.1f s) on %d of %d responses (scored 0.0); "
                "%d stuck reward thread(s) still running",
                self.timeout_s,
                num_timeouts,
                n,
                self.num_stuck_threads,
            )
        return RewardOutput(scores, num_errors, num_timeouts, first_error, extra)
