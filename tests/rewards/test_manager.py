"""RewardManager: calls run in scoring processes (on their main thread), errors and timeouts score 0 and
are counted, a batch whose calls all fail stops the run, and the verl managers (naive, prime, dapo, batch)."""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from jaxrl.rewards import RewardManager, default_compute_score, load_custom_reward_fn
from jaxrl.rewards.manager import OverlongBuffer, RewardError, default_num_workers
from jaxrl.rewards.shaping import overlong_penalty


def _score(mgr, sols, sources=None, truths=None):
    n = len(sols)
    return mgr.score(sources or ["openai/gsm8k"] * n, sols, truths or ["72"] * n, [None] * n)


@pytest.fixture
def scorer_file(tmp_path):
    """Write a custom reward file and load it (a picklable handle the scoring processes re-import)."""

    def make(body: str, name: str = "compute_score", **kw):
        f = tmp_path / f"reward_{abs(hash(body))}.py"
        f.write_text(textwrap.dedent(body))
        return load_custom_reward_fn(str(f), name, **kw)

    return make


@pytest.fixture
def manager():
    """RewardManagers closed at the end of the test (no scoring process outlives it)."""
    made = []

    def make(*args, **kw):
        made.append(RewardManager(*args, **kw))
        return made[-1]

    yield make
    for m in made:
        m.close()


def test_default_scores_in_processes(manager):
    mgr = manager(default_compute_score, num_workers=2)
    out = _score(mgr, ["#### 72", "#### 71", "nothing"])
    assert out.scores.dtype == np.float32 and out.scores.tolist() == [1.0, 0.0, 0.0]
    assert (out.num_errors, out.num_timeouts, out.first_error) == (0, 0, None)
    assert len(mgr.worker_pids) == 2  # the pool is up and reused by the next call
    pids = set(mgr.worker_pids)
    assert _score(mgr, ["#### 72"]).scores.tolist() == [1.0] and set(mgr.worker_pids) == pids


def test_parallel_by_default():
    assert default_num_workers() >= 1
    mgr = RewardManager(default_compute_score)
    assert mgr.num_workers == default_num_workers() and mgr.num_workers <= 8
    mgr.close()


def test_calls_run_on_the_main_thread_of_a_process_so_signal_alarm_works(manager, scorer_file):
    # Math-Verify times itself out with signal.alarm, which raises off the main thread (the old
    # thread-based manager scored such a scorer 0 with no error).
    fn = scorer_file("""
        import signal, threading, os
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            old = signal.signal(signal.SIGALRM, lambda *a: None)
            signal.alarm(5)
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
            return {"score": 1.0, "main": threading.current_thread() is threading.main_thread(), "pid": os.getpid()}
    """)
    out = _score(manager(fn, num_workers=2), ["a", "b", "c"])
    assert out.scores.tolist() == [1.0, 1.0, 1.0] and out.num_errors == 0
    assert out.extra["main"] == [True, True, True]
    import os

    assert os.getpid() not in out.extra["pid"]


def test_exception_scores_zero_is_counted_and_keeps_its_traceback(manager, scorer_file, caplog):
    fn = scorer_file("""
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            if "boom" in solution_str:
                raise RuntimeError(f"bad {solution_str}")
            return 1.0
    """)
    out = _score(manager(fn, num_workers=2), ["ok", "boom1", "ok", "boom2"])
    assert out.scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert out.num_errors == 2 and out.num_timeouts == 0
    assert out.first_error == "index 1: RuntimeError: bad boom1"
    assert "Traceback" in out.first_traceback and 'raise RuntimeError(f"bad {solution_str}")' in out.first_traceback
    assert sum("failed on 2 of 4" in r.getMessage() for r in caplog.records) == 1  # one warning per batch


def test_non_numeric_and_non_finite_are_errors(manager, scorer_file):
    fn = scorer_file("""
        import math
        import numpy as np
        VALUES = {"nan": math.nan, "str": "1.0", "none": None, "nokey": {"no_score": 1}, "bool": True,
                  "np": np.float64(0.5), "inf": math.inf}
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return VALUES[solution_str]
    """)
    out = _score(manager(fn, num_workers=2), ["nan", "str", "none", "nokey", "bool", "np", "inf"])
    assert out.scores.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.0]
    assert out.num_errors == 5
    assert out.first_error.startswith("index 0: non-finite") and out.first_traceback is None


def test_dict_return(manager, scorer_file):
    fn = scorer_file("""
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": len(solution_str), "acc": solution_str == "aa"} if solution_str else 0.5
    """)
    out = _score(manager(fn, num_workers=1), ["a", "aa", ""])
    assert out.scores.tolist() == [1.0, 2.0, 0.5]
    assert out.extra == {"acc": [False, True, None]}
    assert out.num_errors == 0


def test_timeout_kills_and_counts_and_other_calls_are_scored(manager, scorer_file):
    fn = scorer_file("""
        import time
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "slow":
                time.sleep(3600)
            return 1.0
    """)
    mgr = manager(fn, timeout_s=1.0, num_workers=3)
    mgr.start()
    _score(mgr, ["warm"])  # the processes are up
    before = set(mgr.worker_pids)
    t0 = time.perf_counter()
    out = _score(mgr, ["slow", "fast", "slow", "fast", "fast", "fast"])
    elapsed = time.perf_counter() - t0
    assert out.scores.tolist() == [0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    assert out.num_timeouts == 2 and out.num_errors == 0
    assert elapsed < 1.0 + 15.0, elapsed  # both slow calls ran side by side; generous for a loaded 2-core box
    after = set(mgr.worker_pids)
    assert len(after) == 3 and len(before - after) == 2  # the two stuck processes were replaced


def test_in_process_mode_for_debugging(manager):
    values = iter([math.nan, 2.0])
    mgr = manager(lambda **kw: next(values), num_workers=0)  # lambdas are fine in-process
    out = _score(mgr, ["x", "y"])
    assert out.scores.tolist() == [0.0, 2.0] and out.num_errors == 1
    assert mgr.worker_pids == []

    def spin(**kw):
        if kw["solution_str"] == "spin":
            while True:
                pass
        return 1.0

    t0 = time.perf_counter()
    out = _score(manager(spin, num_workers=0, timeout_s=0.3), ["spin", "ok"])
    assert out.scores.tolist() == [0.0, 1.0] and out.num_timeouts == 1
    assert time.perf_counter() - t0 < 10


def test_bad_arguments(manager):
    with pytest.raises(ValueError, match="same length"):
        manager(default_compute_score, num_workers=1).score(["a"], ["b", "c"], ["d"], [None])
    with pytest.raises(ValueError, match="timeout_s"):
        RewardManager(default_compute_score, timeout_s=0)
    with pytest.raises(ValueError, match="num_workers"):
        RewardManager(default_compute_score, num_workers=-1)
    with pytest.raises(ValueError, match="reward_manager='reinforce'"):
        RewardManager(default_compute_score, reward_manager="reinforce")
    with pytest.raises(ValueError, match="max_error_fraction"):
        RewardManager(default_compute_score, max_error_fraction=1.5)
    with pytest.raises(TypeError, match="cannot be sent to a scoring process"):
        RewardManager(lambda **kw: 1.0, num_workers=1)
    out = manager(default_compute_score, num_workers=1).score([], [], [], [])
    assert out.scores.shape == (0,)


# -- no silent zero ------------------------------------------------------------------------------------------
def test_all_calls_failing_stops_with_the_first_traceback(manager):
    mgr = manager(default_compute_score, num_workers=1)  # no built-in scorer for this data source
    with pytest.raises(RewardError, match=r"failed on 3 of 3 responses \(3 errors, 0 timeouts\), all of them") as e:
        _score(mgr, ["a", "b", "c"], sources=["lighteval/unknown"] * 3)
    assert "NotImplementedError" in str(e.value) and "index 0" in str(e.value)
    assert "Traceback" in e.value.traceback and "default_compute_score" in e.value.traceback
    # some failures are tolerated by default (counted and warned about)
    out = _score(mgr, ["#### 72", "b"], sources=["openai/gsm8k", "lighteval/unknown"])
    assert out.scores.tolist() == [1.0, 0.0] and out.num_errors == 1


def test_max_error_fraction_and_timeouts_count_as_failures(manager, scorer_file):
    fn = scorer_file("""
        import time
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "bad":
                raise ValueError("bad")
            if solution_str == "slow":
                time.sleep(3600)
            return 1.0
    """)
    strict = manager(fn, num_workers=2, timeout_s=1.0, max_error_fraction=0.25)
    assert _score(strict, ["ok", "ok", "ok", "bad"]).num_errors == 1  # 1/4 is not more than 0.25
    with pytest.raises(RewardError, match=r"failed on 2 of 4 .*\(1 errors, 1 timeouts\).*max_error_fraction=0.25"):
        _score(strict, ["ok", "bad", "ok", "slow"])
    with pytest.raises(RewardError, match=r"0 errors, 2 timeouts.*timed out after reward_model.timeout_s=1 s"):
        _score(manager(fn, num_workers=2, timeout_s=1.0), ["slow", "slow"])


# -- verl's managers -----------------------------------------------------------------------------------------
def test_prime_scores_like_naive(manager):
    sols = ["#### 72", "#### 7", "x"]
    naive = _score(manager(default_compute_score, num_workers=1), sols)
    prime = _score(manager(default_compute_score, reward_manager="prime", num_workers=2), sols)
    assert prime.scores.tolist() == naive.scores.tolist() == [1.0, 0.0, 0.0]
    assert prime.extra == naive.extra


def test_dapo_manager_number_is_also_acc_and_applies_the_overlong_buffer(manager, scorer_file):
    fn = scorer_file("""
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return 0.5 if solution_str == "half" else {"score": 1.0, "acc": 0.0, "pred": "x"}
    """)
    ob = OverlongBuffer(len=4, penalty_factor=1.0, log=True, max_resp_len=10)
    dapo = manager(fn, reward_manager="dapo", num_workers=1, overlong=ob)
    out = _score(dapo, ["half", "dict"])
    assert out.extra == {"acc": [0.5, 0.0], "pred": [None, "x"]}
    naive = _score(manager(fn, num_workers=1), ["half", "dict"])
    assert naive.extra == {"acc": [None, 0.0], "pred": [None, "x"]}
    lengths = np.array([3, 6, 8, 10])
    got = dapo.overlong_penalty(lengths, response_width=64)  # max_resp_len wins over the batch width
    np.testing.assert_allclose(got, [0.0, 0.0, -0.5, -1.0])  # verl: min(-(L - (10 - 4)) / 4 * 1.0, 0)
    np.testing.assert_allclose(got, overlong_penalty(lengths, max_response_length=10, buffer_len=4, penalty_factor=1))
    no_horizon = manager(fn, num_workers=1, overlong=OverlongBuffer(len=4, penalty_factor=1.0))
    np.testing.assert_allclose(no_horizon.overlong_penalty(lengths, response_width=8), [0.0, -0.5, -1.0, -1.5])
    assert manager(fn, num_workers=1).overlong_penalty(lengths, 8) is None


def test_batch_manager_gets_whole_lists(manager, scorer_file, tmp_path):
    fn = scorer_file("""
        import os
        def compute_score(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):
            with open(os.environ.get("JAXRL_TEST_LOG", os.devnull), "a") as f:
                f.write(f"{len(solution_strs)}\\n")
            return [float(s == g) + bonus if s != "dict" else {"score": 2.0, "acc": 1.0}
                    for s, g in zip(solution_strs, ground_truths)]
    """, batch=True, reward_kwargs={"bonus": 0.25})
    assert pickle.loads(pickle.dumps(fn)).style == "batch"
    mgr = manager(fn, reward_manager="batch", num_workers=4)
    out = mgr.score(["d"] * 4, ["1", "2", "3", "dict"], ["1", "0", "3", "x"], [None, {"a": 1}, None, None])
    assert out.scores.tolist() == [1.25, 0.25, 1.25, 2.0]
    assert out.extra == {"acc": [None, None, None, 1.0]}
    assert len(mgr.worker_pids) == 1  # one call at a time: one process


def test_batch_manager_bad_return_and_timeout(manager, scorer_file):
    wrong = scorer_file("""
        def compute_score(data_sources, solution_strs, ground_truths, extra_infos):
            return [1.0]
    """, batch=True)
    lenient = manager(wrong, reward_manager="batch", num_workers=1, max_error_fraction=1.0)
    out = lenient.score(["d"] * 3, ["a", "b", "c"], ["x"] * 3, [None] * 3)
    assert out.num_errors == 3 and "expected a list of 3 scores" in out.first_error
    hang = scorer_file("""
        import time
        def compute_score(data_sources, solution_strs, ground_truths, extra_infos):
            if "hang" in solution_strs:
                time.sleep(3600)
            return [1.0] * len(solution_strs)
    """, batch=True)
    mgr = manager(hang, reward_manager="batch", num_workers=1, timeout_s=1.0, max_error_fraction=1.0)
    t0 = time.perf_counter()
    out = mgr.score(["d"] * 3, ["a", "hang", "c"], ["x"] * 3, [None] * 3)
    assert out.num_timeouts == 3 and out.scores.tolist() == [0.0, 0.0, 0.0]  # the timeout covers the whole call
    assert time.perf_counter() - t0 < 15
    assert mgr.score(["d"], ["a"], ["x"], [None]).scores.tolist() == [1.0]  # a fresh process took over


def test_stuck_reward_does_not_hang_exit(tmp_path):
    f = tmp_path / "stuck.py"
    f.write_text("import time\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    time.sleep(3600)\n")
    code = textwrap.dedent(f"""
        from jaxrl.rewards import RewardManager, load_custom_reward_fn
        mgr = RewardManager(load_custom_reward_fn({str(f)!r}), timeout_s=0.5, num_workers=2,
                            max_error_fraction=1.0)
        out = mgr.score(["s", "s"], ["x", "y"], ["y", "y"], [None, None])
        print("timeouts", out.num_timeouts)
        mgr.score(["s"], ["x"], ["y"], [None])  # ... and exit with a stuck call's replacement still idle
    """)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "timeouts 2" in proc.stdout
    assert time.perf_counter() - t0 < 60
