"""GSM8K rule reward: a table of responses against verl's extraction rules plus our number equality."""

from __future__ import annotations

import pytest

from jaxrl.rewards import default_compute_score, gsm8k

CASES = [
    # (response, ground_truth, method, expected_extraction, expected_score)
    ("She sold 48 + 24 = 72 clips.\n#### 72", "72", "strict", "72", 1.0),
    ("#### 71", "72", "strict", "71", 0.0),
    ("The answer is 72", "72", "strict", None, 0.0),  # no "####": strict finds nothing
    ("The answer is 72", "72", "flexible", "72", 1.0),
    ("#### 1,000", "1000", "strict", "1000", 1.0),
    ("#### $1,000", "1000", "strict", "1000", 1.0),
    ("It costs $1,000.", "1000", "flexible", "1000", 1.0),
    ("#### -5", "-5", "strict", "-5", 1.0),
    ("#### 5", "-5", "strict", "5", 0.0),
    ("The change is -12 degrees", "-12", "flexible", "-12", 1.0),
    ("#### 18.00", "18", "strict", "18.00", 1.0),
    ("#### 18.5", "18", "strict", "18.5", 0.0),
    ("#### 18.", "18", "strict", "18", 1.0),
    ("So she has 18 apples.", "18", "flexible", "18", 1.0),
    ("#### 3\nwait, actually\n#### 4", "4", "strict", "4", 1.0),  # the last "####" wins
    ("first 3 then 4 ...", "4", "flexible", "4", 1.0),  # trailing dots are not a number
    ("no digits at all.", "4", "flexible", None, 0.0),
    ("", "4", "strict", None, 0.0),
    ("#### 7" + " padding" * 50, "7", "strict", None, 0.0),  # answer outside the last 300 chars
    ("x" * 1000 + "#### 7", "7", "strict", "7", 1.0),
]


@pytest.mark.parametrize("response,gt,method,extracted,score", CASES)
def test_table(response, gt, method, extracted, score):
    assert gsm8k.extract_solution(response, method=method) == extracted
    assert gsm8k.compute_score(response, gt, method=method) == score


def test_format_score_and_score():
    assert gsm8k.compute_score("#### 71", "72", format_score=0.1, score=2.0) == pytest.approx(0.1)
    assert gsm8k.compute_score("#### 72", "72", format_score=0.1, score=2.0) == 2.0
    assert gsm8k.compute_score("no answer", "72", format_score=0.1) == 0.0


def test_bad_method():
    with pytest.raises(ValueError, match=r"method='loose'.*\('strict', 'flexible'\)"):
        gsm8k.extract_solution("#### 1", method="loose")


def test_default_compute_score_dispatch():
    assert default_compute_score("openai/gsm8k", "#### 1,234", "1234") == {
        "score": 1.0, "acc": 1.0, "format": 1.0, "acc_flexible": 1.0, "pred": "1234"}
    assert default_compute_score("openai/gsm8k", "#### 1,235", "1234") == {
        "score": 0.0, "acc": 0.0, "format": 1.0, "acc_flexible": 0.0, "pred": "1235"}
    assert default_compute_score("openai/gsm8k", "no answer", "1234")["pred"] == ""
    assert default_compute_score("tinystories/sentiment", "They were happy and smiled.", "") == {"score": 0.5, "acc": 1.0}
    assert default_compute_score("tinystories/sentiment", "They were happy.", "") == {"score": 0.25, "acc": 0.0}
    with pytest.raises(
        NotImplementedError, match=r"'my/dataset'.*openai/gsm8k.*lighteval/MATH.*tinystories/sentiment.*custom_reward"
    ):
        default_compute_score("my/dataset", "x", "y")


@pytest.mark.parametrize("response,score,acc,fmt,flexible", [
    ("so 48 + 24 = 72\n#### 72", 1.0, 1.0, 1.0, 1.0),
    ("#### 71", 0.1, 0.0, 1.0, 0.0),  # well formed, wrong: verl's format_score
    ("The answer is 72", 0.0, 0.0, 0.0, 1.0),  # right number, not the format: flexible only
    ("#### 72 and then 5 more", 1.0, 1.0, 1.0, 0.0),  # flexible takes the last number
    ("I do not know.", 0.0, 0.0, 0.0, 0.0),
])
def test_compute_score_with_extras_separates_format_strict_and_flexible(response, score, acc, fmt, flexible):
    out = gsm8k.compute_score_with_extras("openai/gsm8k", response, "72", None, format_score=0.1)
    assert out["score"] == pytest.approx(score)
    assert (out["acc"], out["format"], out["acc_flexible"]) == (acc, fmt, flexible)
    assert out["pred"] == (gsm8k.extract_solution(response) or "")


def test_compute_score_with_extras_loads_as_a_custom_reward_with_verl_kwargs():
    from pathlib import Path

    from jaxrl.rewards.custom import load_custom_reward_fn

    fn = load_custom_reward_fn(str(Path(gsm8k.__file__)), "compute_score_with_extras",
                               reward_kwargs={"format_score": 0.1})
    out = fn(data_source="openai/gsm8k", solution_str="#### 9", ground_truth="72", extra_info=None)
    assert out["score"] == pytest.approx(0.1) and out["format"] == 1.0 and out["acc"] == 0.0
