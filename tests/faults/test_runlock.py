"""Run-folder lock (jaxrl.runlock): one run per folder, stale locks taken over, no lock kept by children,
and ``python -m jaxrl.train`` refusing a locked folder with exit 2 before any model loads."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from jaxrl.runlock import LOCK_NAME, RunLock, RunLockError, lock_holder

from faultkit import REPO, command, env, error_lines


def _dead_pid() -> int:
    """The PID of a process that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_second_lock_on_a_folder_is_refused_naming_the_holder(tmp_path):
    first = RunLock(tmp_path / "run", command="python -m jaxrl.train --config a.yaml").acquire()
    try:
        rec = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
        assert rec["pid"] == os.getpid() and rec["host"] == socket.gethostname() and rec["started"]
        assert lock_holder(tmp_path / "run")["pid"] == os.getpid()
        with pytest.raises(RunLockError) as ei:
            RunLock(tmp_path / "run").acquire()
        msg = str(ei.value)
        assert f"PID {os.getpid()} on host {socket.gethostname()}" in msg
        assert "python -m jaxrl.train --config a.yaml" in msg and "another trainer.default_local_dir" in msg
        assert "\n" not in msg and ei.value.holder["pid"] == os.getpid()
    finally:
        first.release()
    assert not (tmp_path / "run" / LOCK_NAME).exists() and lock_holder(tmp_path / "run") is None
    with RunLock(tmp_path / "run"):  # free again
        assert lock_holder(tmp_path / "run")["pid"] == os.getpid()


def test_stale_lock_of_a_dead_pid_is_taken_over_with_a_warning(tmp_path, caplog):
    dead = _dead_pid()
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / LOCK_NAME).write_text(json.dumps({"pid": dead, "host": socket.gethostname(),
                                                "started": "2026-01-01T00:00:00+00:00", "command": "old run"}))
    with caplog.at_level(logging.WARNING, logger="jaxrl.runlock"):
        lock = RunLock(folder).acquire()
    try:
        warned = caplog.text
        assert "stale run lock" in warned and f"PID {dead}" in warned and "no longer running" in warned
        assert json.loads((folder / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_crashed_holders_children_do_not_keep_the_lock(tmp_path):
    """A run that forks a worker and then dies (os._exit: no cleanup) leaves a lock the next run takes over,
    although the forked worker (which inherited the descriptor) is still alive."""
    folder = tmp_path / "run"
    script = textwrap.dedent(f"""
        import os, sys, time
        from jaxrl.runlock import RunLock
        RunLock({str(folder)!r}).acquire()
        child = os.fork()
        if child == 0:
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 1), os.dup2(null, 2)  # let the test's pipes close
            time.sleep(60)
            os._exit(0)
        print(child, flush=True)
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", script], env=env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    child = int(out.stdout.split()[0])
    try:
        assert os.path.exists(f"/proc/{child}")  # the forked worker outlives its parent
        lock = RunLock(folder).acquire()  # would raise RunLockError if the child held the flock
        lock.release()
    finally:
        os.kill(child, signal.SIGKILL)


def test_train_refuses_a_locked_folder_fast_with_exit_2(tmp_path, shared):
    """``python -m jaxrl.train`` into a folder another process holds: exit 2 within seconds (before the model
    load), one error line naming the holder's PID and the way out, no traceback, the holder's files untouched."""
    holder = RunLock(tmp_path / "run", command="the first run").acquire()
    try:
        (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
        t0 = time.monotonic()
        proc = subprocess.run(command(tmp_path / "run"), cwd=REPO, env=env(), capture_output=True, text=True,
                              timeout=120)
        elapsed = time.monotonic() - t0
    finally:
        holder.release()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert elapsed < 15, elapsed
    (line,) = error_lines(proc.stderr)
    assert f"PID {os.getpid()}" in line and "the first run" in line and "trainer.default_local_dir" in line
    assert "Traceback" not in proc.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["metrics.jsonl"]  # nothing written
