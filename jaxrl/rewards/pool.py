"""Run reward-function calls in worker processes that are killed at a timeout and replaced.

One :class:`ScoringPool` holds ``num_workers`` worker processes, all bound to one function. A worker is a
fresh interpreter (``python -c`` with the trainer's ``sys.path``, started by :mod:`subprocess`): no jax,
no threads or locks inherited from the trainer, no re-import of the user's ``__main__``. Each worker runs
one call at a time **on its main thread**, so a scorer that times itself out with ``signal.alarm``
(Math-Verify does) works as in a script. The parent gives every call its own deadline, ``timeout_s``
after it was handed to a worker:

* a call that returns (or raises) in time gives its value (or its exception text and traceback);
* a call still running at its deadline is recorded as timed out; its worker's whole process group (the
  worker leads its own group, so the scorer's subprocesses are in it) gets SIGTERM, then SIGKILL after
  :data:`KILL_GRACE_S`, and a fresh worker takes its place. The other workers keep going, so a hung or
  spinning scorer costs at most ``timeout_s`` per affected call and leaves nothing running;
* a worker that dies mid-call (segfault, ``os._exit``, out of memory) fails that call and is replaced.

Workers cannot outlive the trainer: each holds the read end of a pipe whose write end only the trainer
holds, and a daemon thread kills the worker's process group when that pipe reaches end-of-file (the
trainer closed the pool, exited, crashed or was SIGKILLed) or when the worker's parent changed (checked
every second). :meth:`ScoringPool.close` stops them at the
end of a run, and an ``atexit`` hook at interpreter exit. Workers ignore SIGINT and are outside the
terminal's process group (Ctrl-C reaches the trainer, which closes the pool).

The function must be picklable (a module-level function, a ``functools.partial`` of one, or the object
:func:`jaxrl.rewards.custom.load_custom_reward_fn` returns); workers unpickle it once at start and call
its ``prepare()`` method if it has one (a custom reward file is imported there, not inside a timed call).
Messages travel as pickles over a socket pair (:class:`multiprocessing.connection.Connection`); a
scorer's prints go to the trainer's stdout/stderr.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # a worker must import the function within this (a cold import of sympy can take 10 s)
KILL_GRACE_S = 0.5  # SIGTERM -> SIGKILL delay for a timed-out worker
STOP_GRACE_S = 2.0  # close(): how long idle workers get to exit on their own before they are killed

# The worker's bootstrap: adopt the trainer's sys.path (sent first), then serve calls.
_BOOT = (
    "import sys\n"
    "from multiprocessing.connection import Connection\n"
    "conn = Connection(int(sys.argv[1]))\n"
    "sys.path[:] = conn.recv()\n"
    "from jaxrl.rewards.pool import _worker_main\n"
    "_worker_main(conn, int(sys.argv[2]))\n"
)


class WorkerStartError(RuntimeError):
    """A worker could not load the scoring function (or did not start within :data:`START_TIMEOUT_S`).

    Attributes:
        traceback: the worker's traceback text, or None.
    """

    def __init__(self, message: str, traceback_text: str | None = None):
        super().__init__(message)
        self.traceback = traceback_text


@dataclass
class CallResult:
    """What one call gave.

    Attributes:
        value: the return value (None unless ``error`` and ``timed_out`` are unset).
        error: ``"<ExceptionType>: message"`` when the call raised or its worker died, else None.
        traceback: the worker's formatted traceback for ``error``, else None.
        timed_out: the call ran past its deadline (its worker was killed).
        seconds: wall time from hand-off to result (or to the kill).
    """

    value: Any = None
    error: str | None = None
    traceback: str | None = None
    timed_out: bool = False
    seconds: float = 0.0


# ---------------------------------------------------------------------------------------------- worker side
def _watch_parent(alive_fd: int, parent_pid: int) -> None:
    """Daemon thread in a worker: when the trainer's pipe reaches end-of-file or the worker was re-parented
    (the trainer died while a forked child of it still holds the pipe), kill this worker's process group."""
    try:
        while os.getppid() == parent_pid:
            ready, _, _ = select.select([alive_fd], [], [], 1.0)
            if ready and not os.read(alive_fd, 1):
                break
    except OSError:
        pass
    try:
        os.killpg(os.getpgrp(), signal.SIGKILL)  # also any process the scorer started
    finally:
        os._exit(1)


def _worker_main(conn: Connection, alive_fd: int) -> None:
    """Entry point of a worker process: load the function, then serve calls until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(alive_fd, os.getppid()), name="jaxrl-reward-watch",
                     daemon=True).start()
    try:
        fn = pickle.loads(conn.recv_bytes())
        prepare = getattr(fn, "prepare", None)
        if callable(prepare):
            prepare()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises WorkerStartError
        conn.send(("load_error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        _, args, kwargs = msg
        try:
            reply = ("ok", fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - a reward bug is the parent's to count
            reply = ("error", f"{type(e).__name__}: {e}", traceback.format_exc())
        try:
            conn.send(reply)
        except Exception as e:  # noqa: BLE001 - e.g. an unpicklable return value
            conn.send(("error", f"the return value cannot be sent back ({type(e).__name__}: {e})", None))


# ---------------------------------------------------------------------------------------------- parent side
class _Worker:
    """One worker process and the call it is running."""

    def __init__(self, payload: bytes, alive_fd: int, index: int):
        self.conn, child = multiprocessing.Pipe(duplex=True)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(child.fileno()), str(alive_fd), f"jaxrl-reward-{index}"],
                stdin=subprocess.DEVNULL, pass_fds=(child.fileno(), alive_fd), process_group=0,
            )
        finally:
            child.close()
        self.pid = self.process.pid
        self.conn.send(list(sys.path))
        self.conn.send_bytes(payload)
        self.ready = False
        self.started_at = time.monotonic()
        self.call: int | None = None  # index of the call it runs
        self.sent_at = 0.0

    @property
    def busy(self) -> bool:
        return self.call is not None

    def alive(self) -> bool:
        return self.process.poll() is None

    def exitcode(self) -> int | None:
        try:
            return self.process.wait(1.0)
        except subprocess.TimeoutExpired:
            return None

    def kill(self, grace_s: float) -> None:
        """SIGTERM the worker's process group, SIGKILL it after ``grace_s``, reap the worker."""
        _signal_group(self.pid, signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        if self.alive() or _group_alive(self.pid):
            _signal_group(self.pid, signal.SIGKILL)
        try:
            self.process.wait(5.0)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
            logger.warning("reward scoring process %d did not exit after SIGKILL", self.pid)
        self.conn.close()


def _signal_group(pid: int | None, sig: int) -> None:
    if pid is None:
        return
    try:
        os.killpg(pid, sig)  # each worker leads its own group (Popen(process_group=0))
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _group_alive(pgid: int | None) -> bool:
    if pgid is None:
        return False
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _shutdown(workers: list[_Worker], alive_w: list[int]) -> None:
    """Stop every worker: a polite "stop" to idle ones, then kill whatever is left. Idempotent."""
    for w in workers:
        if w.alive() and not w.busy:
            try:
                w.conn.send(("stop",))
            except (OSError, ValueError):
                pass
    deadline = time.monotonic() + STOP_GRACE_S
    for w in workers:
        try:
            w.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for w in workers:
        if w.alive() or _group_alive(w.pid):
            w.kill(KILL_GRACE_S)
        else:
            w.conn.close()
    workers.clear()
    while alive_w:  # end-of-file for every worker's watchdog (the last resort, e.g. a worker we lost track of)
        os.close(alive_w.pop())


class ScoringPool:
    """Worker processes bound to one picklable function; see the module docstring.

    Args:
        fn: the function every call runs (pickled once here: an unpicklable one fails now).
        num_workers: processes, >= 1.

    Raises:
        TypeError: ``fn`` cannot be pickled (a lambda or a function defined inside another function).
        ValueError: ``num_workers`` < 1.
    """

    def __init__(self, fn, num_workers: int):
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        try:
            self._payload = pickle.dumps(fn)
        except Exception as e:  # noqa: BLE001 - pickling raises many types
            raise TypeError(
                f"the reward function {fn!r} cannot be sent to a scoring process ({type(e).__name__}: {e}); "
                "use a module-level function, a functools.partial of one, or custom_reward_function.path"
            ) from None
        self.num_workers = num_workers
        self._workers: list[_Worker] = []
        self._alive_w: list[int] = []  # write end of the watchdog pipe; only this process holds it
        self._alive_r: int | None = None
        self._spawned = 0
        self._closed = False
        self._lock = threading.Lock()  # one run() at a time (the trainer scores from one thread)
        self._finalizer = weakref.finalize(self, _shutdown, self._workers, self._alive_w)
        atexit.register(self._finalizer)

    @property
    def pids(self) -> list[int]:
        """PIDs of the live worker processes."""
        return [w.pid for w in self._workers if w.alive()]

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self) -> None:
        """Start missing workers; returns at once (they import the function in the background).

        Raises:
            RuntimeError: the pool was closed.
        """
        if self._closed:
            raise RuntimeError("this ScoringPool was closed")
        if self._alive_r is None:
            r, w = os.pipe()
            os.set_inheritable(r, False)
            self._alive_r, self._alive_w[:] = r, [w]
            self._close_alive_r = weakref.finalize(self, _close_fd, r)
        while len(self._workers) < self.num_workers:
            self._workers.append(self._new_worker())

    def close(self) -> None:
        """Stop all workers (idle ones exit, busy or stuck ones are killed). Idempotent."""
        self._closed = True
        self._finalizer()
        if self._alive_r is not None:
            self._close_alive_r()
            self._alive_r = None

    def run(self, calls: list[tuple[tuple, dict]], timeout_s: float) -> list[CallResult]:
        """Run ``fn(*args, **kwargs)`` for every ``(args, kwargs)`` in ``calls``, in parallel.

        Args:
            calls: the calls, in order.
            timeout_s: seconds each call may run, counted from when a worker receives it.

        Returns:
            One :class:`CallResult` per call, in order.

        Raises:
            WorkerStartError: a worker could not load the function, or none started in time (the pool is
                closed then).
            RuntimeError: the pool was closed.
        """
        with self._lock:
            return self._run(calls, timeout_s)

    def _run(self, calls: list[tuple[tuple, dict]], timeout_s: float) -> list[CallResult]:
        self.start()
        n = len(calls)
        results: list[CallResult | None] = [None] * n
        pending = deque(range(n))
        while pending or any(w.busy for w in self._workers):
            self._dispatch(pending, calls)
            self._wait(timeout_s)
            for w in list(self._workers):
                self._drain(w, results, pending)
            now = time.monotonic()
            for w in list(self._workers):
                if w.busy and now - w.sent_at >= timeout_s:
                    results[w.call] = CallResult(timed_out=True, seconds=now - w.sent_at)
                    w.call = None
                    self._replace(w)
            self._check_start_timeout()
        return results  # type: ignore[return-value]

    # -- internals ---------------------------------------------------------------------------------------
    def _new_worker(self) -> _Worker:
        self._spawned += 1
        return _Worker(self._payload, self._alive_r, self._spawned)

    def _dispatch(self, pending: deque, calls) -> None:
        for w in self._workers:
            if not pending:
                return
            if w.ready and not w.busy:
                i = pending.popleft()
                args, kwargs = calls[i]
                try:
                    w.conn.send(("call", args, kwargs))
                except (OSError, ValueError):  # died while idle: the call goes to another worker
                    pending.appendleft(i)
                    self._replace(w)
                    continue
                w.call, w.sent_at = i, time.monotonic()

    def _wait(self, timeout_s: float) -> None:
        now = time.monotonic()
        deadlines = [w.sent_at + timeout_s for w in self._workers if w.busy]
        starting = [w.started_at + START_TIMEOUT_S for w in self._workers if not w.ready]
        wake = min(deadlines + starting, default=now + 1.0)
        multiprocessing.connection.wait([w.conn for w in self._workers], timeout=max(0.0, wake - now) + 1e-3)

    def _drain(self, w: _Worker, results: list, pending: deque) -> None:
        """Read every message ``w`` sent; replace it if it died."""
        dead = False
        try:
            while w.conn.poll():
                msg = w.conn.recv()
                kind = msg[0]
                if kind == "ready":
                    w.ready = True
                elif kind == "load_error":
                    self.close()
                    raise WorkerStartError(
                        f"a reward scoring process could not load the reward function: {msg[1]}", msg[2]
                    )
                elif w.call is not None:
                    seconds = time.monotonic() - w.sent_at
                    if kind == "ok":
                        results[w.call] = CallResult(value=msg[1], seconds=seconds)
                    else:
                        results[w.call] = CallResult(error=msg[1], traceback=msg[2], seconds=seconds)
                    w.call = None
        except (EOFError, OSError):
            dead = True
        if not dead and w.alive():
            return
        code = w.exitcode()
        if w.call is not None:
            why = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            results[w.call] = CallResult(
                error=f"WorkerDied: the reward scoring process died ({why}) while scoring",
                seconds=time.monotonic() - w.sent_at,
            )
            w.call = None
        elif not w.ready:
            self.close()
            raise WorkerStartError(f"a reward scoring process exited during start-up (exit code {code})")
        self._replace(w)

    def _replace(self, w: _Worker) -> None:
        """Kill ``w`` (if still running) and start a fresh worker in its place."""
        w.kill(KILL_GRACE_S)
        self._workers[self._workers.index(w)] = self._new_worker()

    def _check_start_timeout(self) -> None:
        now = time.monotonic()
        if not self._workers or any(w.ready for w in self._workers):
            return
        if all(now - w.started_at > START_TIMEOUT_S for w in self._workers):
            self.close()
            raise WorkerStartError(
                f"no reward scoring process was ready within {START_TIMEOUT_S:.0f} s "
                "(does importing the reward function hang?)"
            )


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
