"""Run-folder lock: one training run at a time per ``trainer.default_local_dir``.

Two runs writing one folder interleave ``metrics.jsonl`` and each other's checkpoints. :class:`RunLock` takes an
exclusive ``fcntl.flock`` on ``<folder>/jaxrl.lock`` and writes its holder there as one JSON line::

    {"pid": 4242, "host": "node-3", "started": "2026-11-25T04:00:00+00:00", "command": "python -m jaxrl.train ..."}

* The OS drops a flock when its holder dies (even on SIGKILL), so a crashed run never blocks the next one.
  A lock file that still names a holder but whose flock is free is stale (the holder died without cleaning up):
  it is taken over with a warning naming the old PID and host.
* A second run finds the flock held and fails at once with :class:`RunLockError`, whose one-line message
  names the holder (PID, host, start time, command) and the ways out.
* The descriptor is close-on-exec and is closed in forked children (``os.register_at_fork``), so worker
  processes never inherit (and so never prolong) the lock.
* :meth:`RunLock.release` removes the file; the inode is re-checked after every acquisition, so a run that
  opened the file just before it was removed retries on the new one instead of sharing a dead lock.

Scope: processes on hosts that share the folder through a filesystem with working ``flock`` (local disks; NFSv4
maps flock onto byte-range locks). In a multi-process (multi-host) run only the primary process takes it.
No jax import: ``python -m jaxrl.train`` refuses a busy folder within a second or two, before any model loads.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
from pathlib import Path

log = logging.getLogger("jaxrl.runlock")

LOCK_NAME = "jaxrl.lock"

__all__ = ["LOCK_NAME", "RunLock", "RunLockError", "lock_holder"]


class RunLockError(RuntimeError):
    """The run folder is locked by another live run.

    Attributes:
      path: the lock file.
      holder: the holder's record (``pid``, ``host``, ``started``, ``command``; empty if unreadable).
    """

    def __init__(self, message: str, *, path: Path, holder: dict):
        super().__init__(message)
        self.path = path
        self.holder = holder


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (signal 0; EPERM means it exists under another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError as e:
        return e.errno != errno.ESRCH
    return True


def _read_record(fd: int) -> dict:
    """The holder record in the lock file (``{}`` when empty or unparsable)."""
    try:
        data = os.pread(fd, 65536, 0).decode("utf-8", "replace").strip()
        rec = json.loads(data) if data else {}
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


def lock_holder(folder: str | os.PathLike) -> dict | None:
    """The record of the run holding ``folder``'s lock right now, or None when nobody holds it.

    Read-only: opens the lock file without creating it and probes the flock without keeping it.
    """
    path = Path(folder).expanduser() / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_record(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _describe(rec: dict) -> str:
    if not rec:
        return "a process whose record is not readable yet"
    parts = [f"PID {rec.get('pid', '?')} on host {rec.get('host', '?')}"]
    if rec.get("started"):
        parts.append(f"started {rec['started']}")
    text = ", ".join(parts)
    if rec.get("command"):
        cmd = rec["command"]
        text += f": {cmd if len(cmd) <= 160 else cmd[:157] + '...'}"
    return text


class RunLock:
    """An exclusive lock on one run folder (see the module docstring).

    Args:
      folder: the run folder (``trainer.default_local_dir``); created if missing.
      command: recorded for the message a second run prints (default: this process's command line).

    Use :meth:`acquire` / :meth:`release` or ``with RunLock(folder):``.
    """

    def __init__(self, folder: str | os.PathLike, *, command: str | None = None):
        self.folder = Path(folder).expanduser().absolute()
        self.path = self.folder / LOCK_NAME
        self.command = command if command is not None else _command_line()
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunLock:
        """Take the lock or fail at once.

        Returns ``self``. Logs a warning when a stale lock (holder gone) is taken over.

        Raises:
          RunLockError: another live run holds the folder; the message names it and the ways out.
          OSError: the folder or lock file cannot be created (e.g. a read-only location).
        """
        if self._fd is not None:
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                rec = self._wait_for_record(fd)
                os.close(fd)
                raise RunLockError(self._busy_message(rec), path=self.path, holder=rec) from None
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed the file between our open and flock: lock the current one
        previous = _read_record(fd)
        if previous:
            self._warn_stale(previous)
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds"),
                  "command": self.command}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        with contextlib.suppress(OSError):
            os.fsync(fd)
        self._fd = fd
        os.register_at_fork(after_in_child=self._close_in_child)
        return self

    def _close_in_child(self) -> None:
        """A forked child drops its copy of the descriptor: only this process holds the lock."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    @staticmethod
    def _wait_for_record(fd: int) -> dict:
        """The holder's record; a holder that has just taken the lock writes it within milliseconds."""
        import time

        for _ in range(20):
            rec = _read_record(fd)
            if rec:
                return rec
            time.sleep(0.025)
        return {}

    def _busy_message(self, rec: dict) -> str:
        pid = rec.get("pid")
        here = rec.get("host") == socket.gethostname()
        note = ""
        if isinstance(pid, int) and here and not _pid_alive(pid):
            note = (f" (PID {pid} has exited but a process it started still holds the lock; find it with "
                    f"`fuser {self.path}`)")
        return (f"trainer.default_local_dir={str(self.folder)!r} is in use by another jaxrl run ({_describe(rec)})"
                f"{note}; wait for that run to finish (or stop it), or set another trainer.default_local_dir")

    def _warn_stale(self, rec: dict) -> None:
        pid, host = rec.get("pid"), rec.get("host")
        if host == socket.gethostname() and isinstance(pid, int) and _pid_alive(pid) and pid != os.getpid():
            why = f"PID {pid} is running but does not hold the lock (the PID was reused)"
        elif host == socket.gethostname():
            why = f"PID {pid} is no longer running"
        else:
            why = f"its holder PID {pid} on host {host} released the flock without removing the file"
        log.warning("taking over the stale run lock %s of %s: %s (that run ended without releasing it)",
                    self.path, _describe(rec), why)

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                    os.unlink(self.path)
        except OSError as e:
            log.warning("could not remove the run lock %s: %s", self.path, e)
        finally:
            os.close(fd)  # closing the last descriptor drops the flock

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _command_line() -> str:
    argv = list(sys.argv)
    if argv and argv[0].endswith(("jaxrl/train.py", "jaxrl/train")):
        argv = ["python", "-m", "jaxrl.train", *argv[1:]]
    return " ".join(shlex.quote(a) for a in argv)
