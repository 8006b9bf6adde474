"""RewardManager: errors and timeouts score 0 and are counted, never stop the batch or hang exit;
custom reward-function loader."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from jaxrl.rewards import RewardManager, default_compute_score, load_custom_reward_fn


def _score(mgr, sols, sources=None):
    n = len(sols)
    return mgr.score(sources or ["openai/gsm8k"] * n, sols, ["72"] * n, [None] * n)


def test_default_scores():
    out = _score(RewardManager(default_compute_score), ["#### 72", "#### 71", "nothing"])
    assert out.scores.dtype == np.float32 and out.scores.tolist() == [1.0, 0.0, 0.0]
    assert (out.num_errors, out.num_timeouts, out.first_error) == (0, 0, None)


def test_exception_scores_zero_and_is_counted(caplog):
    def fn(data_source, solution_str, ground_truth, extra_info):
        if "boom" in solution_str:
            raise RuntimeError(f"bad {solution_str}")
        return 1.0

    out = _score(RewardManager(fn, num_workers=2), ["ok", "boom1", "ok", "boom2"])
    assert out.scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert out.num_errors == 2 and out.num_timeouts == 0
    assert out.first_error == "index 1: RuntimeError: bad boom1"
    assert (
        sum("failed on 2 of 4" in r.getMessage() for r in caplog.records) == 1
    )  # one warning per batch


def test_non_numeric_and_non_finite_are_errors():
    values = iter([math.nan, "1.0", None, {"no_score": 1}, True, np.float64(0.5), math.inf])
    mgr = RewardManager(lambda **kw: next(values), num_workers=1)
    out = _score(mgr, ["x"] * 7)
    assert out.scores.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.0]
    assert out.num_errors == 5
    assert out.first_error.startswith("index 0: non-finite")


def test_dict_return():
    def fn(data_source, solution_str, ground_truth, extra_info):
        return {"score": len(solution_str), "acc": solution_str == "aa"} if solution_str else 0.5

    out = _score(RewardManager(fn), ["a", "aa", ""])
    assert out.scores.tolist() == [1.0, 2.0, 0.5]
    assert out.extra == {"acc": [False, True, None]}
    assert out.num_errors == 0


def test_timeout_returns_fast_and_counts():
    def fn(data_source, solution_str, ground_truth, extra_info):
        if solution_str == "slow":
            time.sleep(30)
        return 1.0

    mgr = RewardManager(fn, timeout_s=0.5, num_workers=2)
    t0 = time.perf_counter()
    out = _score(mgr, ["slow", "fast", "slow", "slow", "fast", "fast"])
    elapsed = time.perf_counter() - t0
    assert elapsed < 3.0, elapsed
    assert out.scores.tolist() == [0.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert out.num_timeouts == 3 and out.num_errors == 0
    assert mgr.num_stuck_threads == 3


def test_stuck_reward_does_not_hang_exit():
    code = textwrap.dedent(
        """
        import time
        from jaxrl.rewards import RewardManager
        mgr = RewardManager(lambda **kw: time.sleep(3600), timeout_s=0.2)
        out = mgr.score(["s"], ["x"], ["y"], [None])
        print("timeouts", out.num_timeouts)
        """
    )
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "timeouts 1" in proc.stdout
    assert time.perf_counter() - t0 < 30


def test_bad_arguments():
    with pytest.raises(ValueError, match="same length"):
        RewardManager(default_compute_score).score(["a"], ["b", "c"], ["d"], [None])
    with pytest.raises(ValueError, match="timeout_s"):
        RewardManager(default_compute_score, timeout_s=0)
    with pytest.raises(ValueError, match="num_workers"):
        RewardManager(default_compute_score, num_workers=0)
    out = RewardManager(default_compute_score).score([], [], [], [])
    assert out.scores.shape == (0,)


def test_custom_loader(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(
        "import math\n"
        "def helper(x):\n    return x\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(solution_str.strip() == ground_truth)\n"
    )
    fn = load_custom_reward_fn(str(f))
    assert fn("d", "72", "72") == 1.0
    out = RewardManager(fn).score(["d", "d"], ["72", "7"], ["72", "72"], [None, None])
    assert out.scores.tolist() == [1.0, 0.0]
    assert load_custom_reward_fn(str(f), "helper")(3) == 3
    with pytest.raises(
        AttributeError, match=r"my_reward\.py.*no function 'score_fn'.*\['compute_score', 'helper'\]"
    ):
        load_custom_reward_fn(str(f), "score_fn")
    missing = tmp_path / "nope.py"
    with pytest.raises(FileNotFoundError, match=r"nope\.py"):
        load_custom_reward_fn(str(missing))
