"""Running gcloud for the launcher: one call at a time, or one per host started together with fail-fast.

Every child runs in its own session (its own process group), so stopping a host is `killpg` of the group
this module started, and a terminal's Ctrl-C reaches only the launcher, which then decides what stops.
`raise_on_interrupt` turns the first Ctrl-C (SIGINT) or SIGTERM into an `Interrupted` exception.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

STOP_GRACE_S = 2.0   # SIGTERM -> SIGKILL


class Interrupted(Exception):
    """Ctrl-C (SIGINT) or SIGTERM reached the launcher; `signum` is the signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_on_interrupt(later_note: str) -> None:
    """From now on the first SIGINT / SIGTERM raises Interrupted in the main thread; later ones only print
    `later_note` (the launcher is already stopping hosts or deleting the TPU, which must not be cut short)."""
    def handler(signum, frame):
        ignore_interrupts(later_note)
        raise Interrupted(signum)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, handler)


def ignore_interrupts(note: str) -> None:
    """From now on SIGINT / SIGTERM only print `note` (SIGQUIT, Ctrl-\\, still ends the launcher)."""
    def handler(signum, frame):
        print(note, file=sys.stderr, flush=True)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, handler)


def exit_code(returncode: int) -> int:
    """A Popen return code as a shell exit code (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def _exited_unreaped(pid: int) -> bool:
    """True when child `pid` has exited; it stays unreaped (a zombie), so its id cannot be reused yet."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the child's process group, SIGKILL it after STOP_GRACE_S, then reap the child.

    Only a child not yet reaped is signalled: until it is reaped its pid (= the group id) is not reused, so
    the signals reach only the group this module started.
    """
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + STOP_GRACE_S
    while not _exited_unreaped(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        os.killpg(proc.pid, signal.SIGKILL)   # members left behind by the leader, or the leader itself
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run(argv: list[str], capture: bool = False, timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run one command to completion in its own session; output goes to ours unless `capture`.

    Interrupted (or a timeout: subprocess.TimeoutExpired) stops the child's group before it propagates.
    """
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True,
                            stdout=subprocess.PIPE if capture else None,
                            stderr=subprocess.PIPE if capture else None, text=capture)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        _stop(proc)
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _pump(stream, prefix: str, lock: threading.Lock) -> None:
    """Copy `stream` to our stdout line by line, each line prefixed; `\\r` (remote terminals, progress bars)
    also ends a line."""
    buf = b""
    for chunk in iter(lambda: stream.read1(65536), b""):
        buf += chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *lines, buf = buf.split(b"\n")
        if lines:
            text = "".join(f"{prefix}{ln.decode(errors='replace')}\n" for ln in lines if ln)
            with lock:
                sys.stdout.write(text)
                sys.stdout.flush()
    if buf:
        with lock:
            sys.stdout.write(f"{prefix}{buf.decode(errors='replace')}\n")
            sys.stdout.flush()


def run_together(commands: list[list[str]], prefixes: list[str], poll_s: float = 0.05) -> tuple[int, int | None]:
    """Start every command at once, stdout+stderr of each prefixed; fail-fast.

    Returns (code, index): (0, None) when all exit 0; else the exit code of the first command seen exiting
    non-zero (lowest index among those found in the same poll) and its index, after every other command's
    process group was stopped (SIGTERM, SIGKILL after STOP_GRACE_S). On Interrupted every group is stopped
    and the exception propagates.
    """
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    try:
        for argv, prefix in zip(commands, prefixes):
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            procs.append(p)
            t = threading.Thread(target=_pump, args=(p.stdout, prefix, lock), daemon=True)
            t.start()
            pumps.append(t)
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                first = failed[0]
                return exit_code(codes[first]), first
            if all(c == 0 for c in codes):
                return 0, None
            time.sleep(poll_s)
    finally:
        for p in procs:
            _stop(p)
        for t in pumps:
            t.join(timeout=5)
