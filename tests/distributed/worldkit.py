"""Starting a test world of several processes through ``python -m jaxrl.launch`` and ending it, whatever happens.

Every process these helpers start is ended by PID when the test is done or fails: the launcher's group, and each
process it started (each is a session of its own) with whatever is in their groups. Nothing listens outside
127.0.0.1: :func:`require_loopback_hostname` fails a test when this host's name does not resolve to loopback
(the collectives between the processes listen on that address).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from jaxrl.paths import shared_dir

REPO = Path(__file__).resolve().parents[2]


def require_loopback_hostname() -> None:
    """Fail (naming the addresses) unless this host's name resolves to loopback only."""
    name = socket.gethostname()
    addrs = sorted({info[4][0] for info in socket.getaddrinfo(name, None)})
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        pytest.fail(f"hostname {name!r} resolves to {addrs}, not loopback: the multi-process tests' collectives "
                    "(gloo) would listen on that address; map the name to 127.0.0.1 (/etc/hosts) to run them")


def child_env() -> dict[str, str]:
    """This process's environment (PYTHONPATH, ...) for the processes a test starts, with ``JAXRL_SHARED`` set to
    the shared folder this process uses: a child that runs from another folder (``ray job submit --working-dir``
    unpacks the checkout elsewhere, so its ``<repo>/../shared`` default does not exist) finds the same assets."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXRL_")}
    env["JAXRL_SHARED"] = str(shared_dir())
    env["PYTHONUNBUFFERED"] = "1"
    return env


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _end(pid: int, tracked: list[psutil.Process]) -> None:
    """SIGKILL the launcher's group, every tracked descendant and their groups (all by PID)."""
    for p in [*tracked, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError, PermissionError, psutil.Error):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(psutil.Error):
            p.kill()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


@contextlib.contextmanager
def launched(launch_args: list[str], *, cwd: Path = REPO, env: dict | None = None):
    """``python -m jaxrl.launch *launch_args`` started in its own session, output captured to files; yields
    ``(Popen, tracked)`` where ``tracked`` collects the processes the test saw (see :func:`track`). On exit
    everything still alive is killed, so a failing test leaves no process behind."""
    require_loopback_hostname()
    stdout, stderr = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "jaxrl.launch", *launch_args], cwd=cwd,
                            env=child_env() if env is None else env, stdout=stdout, stderr=stderr,
                            start_new_session=True, text=True)
    proc.stdout_file, proc.stderr_file = stdout, stderr
    tracked: list[psutil.Process] = []
    try:
        yield proc, tracked
    finally:
        if proc.poll() is None:
            _end(proc.pid, tracked)
        proc.wait()
        _end(proc.pid, tracked)
        stdout.close()
        stderr.close()


def output(proc) -> tuple[str, str]:
    """What a launched process printed so far: ``(stdout, stderr)``."""
    texts = []
    for f in (proc.stdout_file, proc.stderr_file):
        f.flush()
        f.seek(0)
        texts.append(f.read())
    return texts[0], texts[1]


def track(proc, tracked: list, nproc: int, timeout_s: float = 60.0) -> list[psutil.Process]:
    """Wait until the launcher started its ``nproc`` processes; add them (and their children) to ``tracked``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        kids = [p for p in descendants(proc.pid) if p.ppid() == proc.pid]
        if len(kids) >= nproc:
            for p in kids:
                if p not in tracked:
                    tracked.append(p)
            return kids
        if proc.poll() is not None:
            raise AssertionError(f"the launcher exited ({proc.returncode}) before starting {nproc} processes: "
                                 f"{output(proc)[1][-2000:]}")
        time.sleep(0.05)
    raise AssertionError(f"the launcher did not start {nproc} processes within {timeout_s} s")


def wait_for(paths: list[Path], proc, timeout_s: float = 120.0) -> None:
    """Wait until every path exists (fails early when the launcher exits)."""
    t0 = time.monotonic()
    while not all(p.exists() for p in paths):
        if proc.poll() is not None:
            raise AssertionError(f"the launcher exited ({proc.returncode}) early: {output(proc)[1][-3000:]}")
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{[str(p) for p in paths if not p.exists()]} did not appear within {timeout_s} s")
        time.sleep(0.05)


def alive(procs: list[psutil.Process]) -> list[int]:
    """PIDs of ``procs`` that still run (zombies count as gone)."""
    out = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
    return out
