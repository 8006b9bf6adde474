"""verl's own, unchanged scorer file ``verl/utils/reward_score/gsm8k.py``, pointed at with
``custom_reward_function.path``, scores like jaxrl's built-in GSM8K scorer (issue 13 acceptance).

The file comes from ``scripts/fetch_verl_reward_files.sh`` (cached in the git-ignored ``.cache/verl/``; tests
never download). Missing file: the test fails when ``CI`` is set, and is skipped otherwise."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from jaxrl.config import load_config
from jaxrl.data.prepare import gsm8k_row
from jaxrl.rewards import default_compute_score
from jaxrl.rewards.factory import build_reward_manager
from jaxrl.rewards.manager import RewardManager

REPO = Path(__file__).resolve().parents[2]
FETCH = REPO / "scripts" / "fetch_verl_reward_files.sh"
VERL_VERSION = re.search(r'VERL_VERSION="\$\{VERL_VERSION:-([^}]+)\}"', FETCH.read_text()).group(1)
SCORE_DIR = REPO / ".cache" / "verl" / VERL_VERSION / "verl" / "utils" / "reward_score"


@pytest.fixture(scope="module")
def verl_gsm8k() -> Path:
    path = SCORE_DIR / "gsm8k.py"
    if not path.is_file():
        msg = f"verl's gsm8k.py is not cached at {path}; run `bash scripts/fetch_verl_reward_files.sh`"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def _managers(path: Path):
    cfg = load_config(None, [f"custom_reward_function.path={path}", "reward_model.num_workers=2"])
    return build_reward_manager(cfg), RewardManager(default_compute_score, num_workers=2)


def test_verl_gsm8k_file_is_adapted_and_scores_like_the_builtin(verl_gsm8k):
    responses = [
        "She has 3 + 4 = 7 apples.\n#### 72",  # right, strict format
        "The answer is 72.",  # no #### : 0 in both (strict)
        "#### 71",  # wrong
        "#### 1,234",  # thousands comma
        "#### -5",  # negative
        "",  # empty
        "#### 72\n#### 8",  # the last one counts
    ]
    truths = ["72", "72", "72", "1234", "-5", "72", "8"]
    verl, builtin = _managers(verl_gsm8k)
    with verl, builtin:
        assert verl.compute_score.style == "scorer"  # compute_score(solution_str, ground_truth, method=...)
        n = len(responses)
        got = verl.score(["openai/gsm8k"] * n, responses, truths, [None] * n)
        ref = builtin.score(["openai/gsm8k"] * n, responses, truths, [None] * n)
    assert got.num_errors == got.num_timeouts == 0
    assert got.scores.tolist() == ref.scores.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]


def test_verl_gsm8k_file_on_real_gsm8k_rows(verl_gsm8k, shared):
    rows = [json.loads(line) for line in (shared / "data" / "gsm8k" / "test.jsonl").read_text().splitlines()[:60]]
    rows = [gsm8k_row(r, "test", i) for i, r in enumerate(rows)]
    truths = [r["reward_model"]["ground_truth"] for r in rows]
    responses = []
    for i, gt in enumerate(truths):  # right, wrong, unformatted, in turn
        responses.append([f"Step by step...\n#### {gt}", f"#### {int(gt) + 1}", f"I think it is {gt}"][i % 3])
    n = len(rows)
    verl, builtin = _managers(verl_gsm8k)
    with verl, builtin:
        got = verl.score([r["data_source"] for r in rows], responses, truths, [r.get("extra_info") for r in rows])
        ref = builtin.score([r["data_source"] for r in rows], responses, truths, [r.get("extra_info") for r in rows])
    assert got.num_errors == 0 and got.scores.tolist() == ref.scores.tolist()
    assert got.scores.sum() == sum(1 for i in range(n) if i % 3 == 0)


def _verl_file(name: str) -> Path:
    path = SCORE_DIR / name
    if not path.is_file():
        msg = f"verl's {name} is not cached at {path}; run `bash scripts/fetch_verl_reward_files.sh`"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def test_verl_math_verify_file_scores_right_answers(verl_gsm8k):
    """verl's math_verify.py times Math-Verify out with signal.alarm: in a scoring process's main thread it
    works (the old thread-based manager scored these 0 with no error)."""
    pytest.importorskip("math_verify")
    from jaxrl.rewards import load_custom_reward_fn

    fn = load_custom_reward_fn(str(_verl_file("math_verify.py")))
    assert fn.style == "scorer"  # compute_score(model_output, ground_truth, timeout_score=0)
    cases = [("The answer is $\\boxed{\\frac{1}{2}}$", "0.5"), ("so $x = 2\\sqrt{2}$", "\\sqrt{8}"), ("$\\boxed{3}$", "4")]
    with RewardManager(fn, num_workers=2) as mgr:
        out = mgr.score(["d"] * 3, [c[0] for c in cases], [c[1] for c in cases], [None] * 3)
    assert out.scores.tolist() == [1.0, 1.0, 0.0] and out.num_errors == 0


@pytest.mark.parametrize("name", ["math_reward.py", "math_dapo.py"])
def test_other_verl_scorer_files_load_with_the_scorer_signature(verl_gsm8k, name):
    from jaxrl.rewards import load_custom_reward_fn

    assert load_custom_reward_fn(str(_verl_file(name))).style == "scorer"
