"""Reward manager: score a batch of responses with a verl-style ``compute_score`` function in worker
processes, with per-call timeouts that kill, never silently zero.

Managers, by verl's name (``reward_model.reward_manager``):

* ``naive`` -- one call ``compute_score(data_source=, solution_str=, ground_truth=, extra_info=)`` per
  response (verl's ``NaiveRewardManager``); the calls run in parallel over the scoring processes.
* ``prime`` -- verl's ``PrimeRewardManager`` scores the same per-response calls in a process pool; that is
  what ``naive`` does here already, so ``prime`` shares ``naive``'s path.
* ``dapo`` -- ``naive``'s calls, plus verl's ``DAPORewardManager`` conventions: a number returned is also
  the response's ``acc``, and the soft overlong penalty (:class:`OverlongBuffer`, from
  ``reward_model.reward_kwargs.overlong_buffer_cfg`` or ``reward_model.overlong_buffer``) is added by the
  trainer through :meth:`RewardManager.overlong_penalty`.
* ``batch`` -- one call ``compute_score(data_sources=, solution_strs=, ground_truths=, extra_infos=)`` with
  the whole lists, returning one score per response (verl's ``BatchRewardManager``); it runs in one scoring
  process and ``timeout_s`` applies to the whole call.

A call that raises, returns a non-number / non-finite value, or runs longer than ``timeout_s`` (its
process is killed, see :mod:`jaxrl.rewards.pool`) scores 0.0 and is counted. When the failed fraction of
one :meth:`RewardManager.score` call (errors and timeouts together) is above ``max_error_fraction``
(default None: only when *every* call failed), :class:`RewardError` stops the run with the first
failure's traceback.

``num_workers=0`` scores in the calling thread, one call after another (for debugging with pdb; the
timeout then uses ``SIGALRM`` and works only on the main thread and only for Python code).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real

import numpy as np

from jaxrl.rewards.pool import CallResult, ScoringPool
from jaxrl.rewards.shaping import overlong_penalty

logger = logging.getLogger(__name__)

REWARD_MANAGERS = ("naive", "prime", "dapo", "batch")
MAX_DEFAULT_WORKERS = 8


def default_num_workers() -> int:
    """``min(8, CPUs this process may run on)``: what ``reward_model.num_workers=null`` means."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_WORKERS, cpus))


class RewardError(RuntimeError):
    """Too many reward calls of one batch failed (see ``max_error_fraction``); the run must stop.

    Attributes:
        traceback: the first failure's traceback text (None for a timeout).
    """

    def __init__(self, message: str, traceback_text: str | None = None):
        super().__init__(message)
        self.traceback = traceback_text


@dataclass(frozen=True)
class OverlongBuffer:
    """DAPO's soft overlong punishment settings (verl ``overlong_buffer_cfg``).

    Attributes:
        len: the buffer length in tokens.
        penalty_factor: the penalty at ``max_resp_len`` (>= 0).
        log: also report the per-response penalty (``overlong_reward``) and ``overlong`` flag.
        max_resp_len: the response horizon in tokens; None = the batch's response width.
    """

    len: int
    penalty_factor: float
    log: bool = False
    max_resp_len: int | None = None


@dataclass
class RewardOutput:
    """Scores of one batch.

    Attributes:
        scores: ``[B]`` float32, one score per response (0.0 for failed / timed-out calls).
        num_errors: calls that raised, whose process died, or that returned something that is not a finite
            number (or a dict without a finite ``"score"``).
        num_timeouts: calls that ran longer than ``timeout_s`` (a timed-out batch call counts ``B``).
        first_error: ``"index i: <ExceptionType>: message"`` of the first error (lowest index), or None.
        extra: for dict returns, every key other than ``"score"`` -> a length-``B`` list of its values
            (None where a call did not return that key); empty if no call returned a dict. The ``dapo``
            manager also puts a number's value under ``"acc"``.
        first_traceback: the traceback text of ``first_error`` (None when it has none, e.g. a bad value).
    """

    scores: np.ndarray
    num_errors: int
    num_timeouts: int
    first_error: str | None
    extra: dict = field(default_factory=dict)
    first_traceback: str | None = None


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


class _CallTimeout(BaseException):
    """Raised by SIGALRM in the in-process mode (a BaseException so scorers' ``except Exception`` miss it)."""


def _run_inline(fn, calls: list[tuple[tuple, dict]], timeout_s: float) -> list[CallResult]:
    """``num_workers=0``: the calls one by one in this thread; SIGALRM timeouts on the main thread only."""
    import traceback

    use_alarm = threading.current_thread() is threading.main_thread()

    def on_alarm(signum, frame):
        raise _CallTimeout()

    results = []
    for args, kwargs in calls:
        t0 = time.monotonic()
        previous = signal.signal(signal.SIGALRM, on_alarm) if use_alarm else None
        try:
            if use_alarm:
                signal.setitimer(signal.ITIMER_REAL, timeout_s)
            results.append(CallResult(value=fn(*args, **kwargs), seconds=time.monotonic() - t0))
        except _CallTimeout:
            results.append(CallResult(timed_out=True, seconds=time.monotonic() - t0))
        except Exception as e:  # noqa: BLE001 - a reward bug is counted, not raised
            results.append(CallResult(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(),
                                      seconds=time.monotonic() - t0))
        finally:
            if use_alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
    return results


class RewardManager:
    """Parallel, fault-tolerant scorer around a verl-signature ``compute_score`` (see the module docstring).

    Args:
        compute_score: called as ``compute_score(data_source=..., solution_str=..., ground_truth=...,
            extra_info=...)`` (``batch``: ``data_sources=, solution_strs=, ground_truths=, extra_infos=`` ->
            a list); returns a number or a dict with key ``"score"`` (other keys go to
            :attr:`RewardOutput.extra`). Must be picklable when ``num_workers >= 1``.
        reward_manager: one of :data:`REWARD_MANAGERS`.
        timeout_s: seconds one call may run (``batch``: the whole call), > 0.
        num_workers: scoring processes (>= 1), None = :func:`default_num_workers`, 0 = in the calling thread.
        max_error_fraction: stop (:class:`RewardError`) when more than this fraction of a batch's calls
            fail; None = only when all of them fail.
        overlong: DAPO's overlong penalty settings, or None.

    Raises:
        TypeError: ``compute_score`` is not callable, or cannot be pickled for the scoring processes.
        ValueError: a bad ``reward_manager``, ``timeout_s`` <= 0, ``num_workers`` < 0, or
            ``max_error_fraction`` outside [0, 1].
    """

    def __init__(
        self,
        compute_score: Callable,
        *,
        reward_manager: str = "naive",
        timeout_s: float = 30.0,
        num_workers: int | None = None,
        max_error_fraction: float | None = None,
        overlong: OverlongBuffer | None = None,
    ):
        if not callable(compute_score):
            raise TypeError(f"compute_score must be callable, got {type(compute_score).__name__}")
        if reward_manager not in REWARD_MANAGERS:
            raise ValueError(f"reward_manager={reward_manager!r} is not valid; use one of {REWARD_MANAGERS}")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
        if num_workers is None:
            num_workers = default_num_workers()
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0 (0 = in-process) or None, got {num_workers!r}")
        if max_error_fraction is not None and not (
            isinstance(max_error_fraction, (int, float)) and 0 <= max_error_fraction <= 1
        ):
            raise ValueError(f"max_error_fraction must be in [0, 1] or None, got {max_error_fraction!r}")
        self.compute_score = compute_score
        self.reward_manager = reward_manager
        self.timeout_s = float(timeout_s)
        self.num_workers = num_workers
        self.max_error_fraction = max_error_fraction
        self.overlong = overlong
        # batch: one call at a time, so one process is enough
        self._pool = ScoringPool(compute_score, 1 if reward_manager == "batch" else num_workers) if num_workers else None

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the scoring processes now (in the background); otherwise the first :meth:`score` does."""
        if self._pool is not None:
            self._pool.start()

    def close(self) -> None:
        """Stop the scoring processes (also done at interpreter exit). Idempotent; a later :meth:`score`
        raises."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def worker_pids(self) -> list[int]:
        """PIDs of the live scoring processes (empty in-process or before the first score)."""
        return self._pool.pids if self._pool is not None else []

    # -- scoring -----------------------------------------------------------------------------------------
    def score(
        self,
        data_sources: Sequence[str],
        solution_strs: Sequence[str],
        ground_truths: Sequence,
        extra_infos: Sequence[dict | None],
    ) -> RewardOutput:
        """Score ``B`` responses.

        Args:
            data_sources: ``[B]`` data-source names (``row["data_source"]``).
            solution_strs: ``[B]`` decoded responses.
            ground_truths: ``[B]`` ``reward_model.ground_truth`` values.
            extra_infos: ``[B]`` ``extra_info`` dicts or None.

        Returns:
            :class:`RewardOutput`.

        Raises:
            ValueError: the four sequences differ in length.
            RewardError: more than ``max_error_fraction`` of the calls failed (default: all of them).
            jaxrl.rewards.pool.WorkerStartError: a scoring process could not load the function.
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
        if n == 0:
            return RewardOutput(np.zeros(0, np.float32), 0, 0, None)
        if self.reward_manager == "batch":
            kwargs = dict(data_sources=list(data_sources), solution_strs=list(solution_strs),
                          ground_truths=list(ground_truths), extra_infos=list(extra_infos))
            per_call = self._batch_results(self._run([((), kwargs)])[0], n)
        else:
            per_call = self._run([
                ((), dict(data_source=data_sources[i], solution_str=solution_strs[i],
                          ground_truth=ground_truths[i], extra_info=extra_infos[i]))
                for i in range(n)
            ])
        out = self._collect(per_call)
        self._check_failures(out, n)
        return out

    def _run(self, calls: list[tuple[tuple, dict]]) -> list[CallResult]:
        if self._pool is None:
            return _run_inline(self.compute_score, calls, self.timeout_s)
        return self._pool.run(calls, self.timeout_s)

    @staticmethod
    def _batch_results(res: CallResult, n: int) -> list[CallResult]:
        """One batch call's result -> ``n`` per-response results."""
        if res.timed_out or res.error is not None:
            return [res] * n
        values = res.value
        if isinstance(values, np.ndarray):
            values = values.tolist()
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = f"{type(values).__name__} of length {len(values)}" if hasattr(values, "__len__") else repr(values)
            err = f"BatchResultError: the batch reward function returned {got:.80}; expected a list of {n} scores"
            return [CallResult(error=err)] * n
        return [CallResult(value=v, seconds=res.seconds) for v in values]

    def _collect(self, results: list[CallResult]) -> RewardOutput:
        n = len(results)
        scores = np.zeros(n, dtype=np.float32)
        num_errors = num_timeouts = 0
        first_error = first_tb = None
        extra: dict[str, list] = {}
        for i, r in enumerate(results):
            if r.timed_out:
                num_timeouts += 1
                continue
            if r.error is not None:
                value, extras, err = None, None, r.error
            else:
                value, extras, err = _to_score(r.value)
            if err is not None:
                num_errors += 1
                if first_error is None:
                    first_error, first_tb = f"index {i}: {err}", r.traceback
                continue
            scores[i] = value
            if extras is None and self.reward_manager == "dapo":
                extras = {"acc": value}  # verl's DAPORewardManager: a plain number is also the accuracy
            for k, v in (extras or {}).items():
                extra.setdefault(k, [None] * n)[i] = v
        if num_errors:
            logger.warning(
                "reward function failed on %d of %d responses (scored 0.0); first: %s", num_errors, n, first_error
            )
        if num_timeouts:
            logger.warning(
                "reward function timed out (> %.1f s, process killed) on %d of %d responses (scored 0.0)",
                self.timeout_s, num_timeouts, n,
            )
        return RewardOutput(scores, num_errors, num_timeouts, first_error, extra, first_tb)

    def _check_failures(self, out: RewardOutput, n: int) -> None:
        failed = out.num_errors + out.num_timeouts
        limit = self.max_error_fraction
        if not failed or (failed < n if limit is None else failed / n <= limit):
            return
        rule = (
            "all of them" if limit is None else f"more than reward_model.max_error_fraction={limit:g} of them"
        )
        first = out.first_error or f"timed out after reward_model.timeout_s={self.timeout_s:g} s"
        raise RewardError(
            f"the reward function failed on {failed} of {n} responses ({out.num_errors} errors, "
            f"{out.num_timeouts} timeouts), {rule}: stopping instead of training on zero rewards; first failure: "
            f"{first}",
            out.first_traceback,
        )

    # -- DAPO shaping ------------------------------------------------------------------------------------
    def overlong_penalty(self, response_lengths: np.ndarray, response_width: int) -> np.ndarray | None:
        """DAPO's overlong penalty per response, or None when it is off.

        Args:
            response_lengths: ``[N]`` valid response tokens.
            response_width: the batch's response width ``R``, the horizon when ``overlong.max_resp_len`` is
                None.

        Returns:
            float32 ``[N]`` penalties (<= 0), see :func:`jaxrl.rewards.shaping.overlong_penalty`.
        """
        ob = self.overlong
        if ob is None:
            return None
        horizon = ob.max_resp_len if ob.max_resp_len is not None else response_width
        return overlong_penalty(
            response_lengths, max_response_length=horizon, buffer_len=ob.len, penalty_factor=ob.penalty_factor
        )
