"""Fault: a hung or spinning reward scorer (issue 12 item 4).

Each affected call costs at most ``timeout_s`` (+ the kill), the other calls are scored in parallel, and
afterwards nothing is left running: no scoring process beyond the idle pool, no thread, no CPU burning --
also when the trainer process itself dies. Timing bounds are generous (a loaded 2-core box)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from jaxrl.rewards import RewardManager, load_custom_reward_fn
from jaxrl.rewards.pool import ScoringPool

TIMEOUT_S = 1.0
SLACK_S = 5.0  # kill + scheduling on a loaded box; the scorers themselves would run for an hour

SCORER = """
import os, time
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "spin":
        while True:
            pass
    if solution_str == "sleep":
        time.sleep(3600)
    if solution_str == "fork-and-hang":  # a scorer whose own subprocess hangs too
        import subprocess, sys
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(3600)
    if solution_str == "die":
        os._exit(7)
    return 1.0
"""


@pytest.fixture
def scorer(tmp_path):
    f = tmp_path / "faulty_reward.py"
    f.write_text(SCORER)
    return load_custom_reward_fn(str(f))


def _descendants() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


def _cpu_seconds(procs) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _burn(seconds: float) -> float:
    """CPU seconds used by this process and its descendants over ``seconds`` of idling."""
    procs = [psutil.Process(), *_descendants()]
    before = _cpu_seconds(procs)
    time.sleep(seconds)
    return _cpu_seconds(procs) - before


def test_hung_and_spinning_calls_cost_one_timeout_each_and_leave_nothing_running(scorer):
    threads_before = set(threading.enumerate())
    children_before = {p.pid for p in _descendants()}
    mgr = RewardManager(scorer, timeout_s=TIMEOUT_S, num_workers=3, max_error_fraction=1.0)
    try:
        mgr.score(["d"], ["warm"], ["x"], [None])  # processes up
        idle_pool = set(mgr.worker_pids)
        sols = ["spin", "ok", "sleep", "ok", "fork-and-hang", "ok", "ok", "die", "ok"]
        t0 = time.perf_counter()
        out = mgr.score(["d"] * len(sols), sols, ["x"] * len(sols), [None] * len(sols))
        elapsed = time.perf_counter() - t0
        assert out.scores.tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
        assert out.num_timeouts == 3 and out.num_errors == 1
        assert "died (exit code 7)" in out.first_error
        # 3 hung calls over 3 processes run side by side: about one timeout in all, not one per call
        assert TIMEOUT_S <= elapsed < 2 * TIMEOUT_S + 2 * SLACK_S, elapsed
        live = set(mgr.worker_pids)
        replaced = idle_pool - live
        assert len(live) == 3 and replaced  # stuck processes were replaced ...
        assert not any(_alive(pid) for pid in replaced)  # ... and are gone
        # only the idle pool is left: the scorer's own hung subprocess was killed with its process group
        assert {p.pid for p in _descendants()} - children_before == live
        assert _burn(1.5) < 0.5  # nothing spins
        assert set(threading.enumerate()) <= threads_before  # the manager runs no threads
    finally:
        mgr.close()
    assert {p.pid for p in _descendants()} - children_before == set()


def test_each_timed_out_call_is_cut_at_its_own_deadline(scorer):
    pool = ScoringPool(scorer, 2)
    try:
        calls = [((), dict(data_source="d", solution_str=s, ground_truth="x", extra_info=None))
                 for s in ["spin", "sleep", "ok", "ok"]]
        pool.run(calls[2:], TIMEOUT_S)  # warm
        results = pool.run(calls, TIMEOUT_S)
        for r in results[:2]:
            assert r.timed_out and TIMEOUT_S <= r.seconds < TIMEOUT_S + SLACK_S, r
        assert [r.value for r in results[2:]] == [1.0, 1.0]
    finally:
        pool.close()
    assert pool.pids == []


def test_scoring_processes_die_with_the_trainer(tmp_path, scorer):
    """SIGKILL of the process that owns the pool (no chance to clean up): its workers follow within seconds."""
    code = textwrap.dedent(f"""
        import sys, time
        from jaxrl.rewards import RewardManager, load_custom_reward_fn
        mgr = RewardManager(load_custom_reward_fn({scorer.path!r}), timeout_s=3600, num_workers=2)
        mgr.start()
        mgr.score(["d"], ["ok"], ["x"], [None])
        print(" ".join(map(str, mgr.worker_pids)), flush=True)
        mgr.score(["d", "d"], ["spin", "sleep"], ["x", "x"], [None, None])  # blocks: both workers busy forever
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        time.sleep(1.0)  # the calls are running (one spinning)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), "scoring processes outlived their parent"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def test_sigterm_and_exit_close_the_pool(scorer):
    """A normal interpreter exit (after SIGTERM handled as the trainer does, or just the end of a script) leaves
    no scoring process, even with a call stuck at exit."""
    code = textwrap.dedent(f"""
        import signal, sys, threading
        from jaxrl.rewards import RewardManager, load_custom_reward_fn
        mgr = RewardManager(load_custom_reward_fn({scorer.path!r}), timeout_s=3600, num_workers=2)
        mgr.score(["d"], ["ok"], ["x"], [None])
        print(" ".join(map(str, mgr.worker_pids)), flush=True)
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
        mgr.score(["d"], ["sleep"], ["x"], [None])  # stuck until SIGTERM -> SystemExit -> atexit closes the pool
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        time.sleep(1.0)
        proc.terminate()
        assert proc.wait(30) == 0
        assert not any(_alive(p) for p in pids)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
