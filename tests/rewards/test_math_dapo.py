"""DAPO math scorer (jaxrl.rewards.math_dapo): the ``Answer:`` format, +1 / -1, score/acc/pred as verl."""

from __future__ import annotations

import pytest

from jaxrl.rewards import default_compute_score
from jaxrl.rewards import math_dapo


@pytest.mark.parametrize(
    "response, ground_truth, pred",
    [
        ("Let me think.\nAnswer: 42", "42", "42"),
        ("answer : 42", "42", "42"),  # case and spaces around the colon
        ("Answer: $\\frac{1}{2}$", "\\frac12", "\\frac{1}{2}"),  # $...$ dropped, \frac12 braced
        ("Answer: 2,000", "2000", "2000"),  # thousands commas
        ("Answer: -2,000", "-2000", "-2000"),
        ("Answer: -7", "-7", "-7"),
        ("Answer: 2000 dollars", "2000", "2000"),  # listed units / words dropped
        ("Answer: 10 cm", "10", "10"),
        ("Answer: \\$5", "5", "5"),
        ("Answer: x = 5", "5", "5"),  # the right-hand side of the last "="
        ("Answer: \\boxed{5}", "5", "5"),
        ("Answer: \\text{Evelyn}", "Evelyn", "Evelyn"),
        ("Answer: 1\nwait, no.\nAnswer: 2", "2", "2"),  # the last Answer: line counts
    ],
)
def test_right_answers(response, ground_truth, pred):
    assert math_dapo.compute_score(response, ground_truth) == {"score": 1.0, "acc": 1.0, "pred": pred}


@pytest.mark.parametrize(
    "response, ground_truth, pred",
    [
        ("Answer: 41", "42", "41"),  # wrong
        ("Answer: 7", "-7", "7"),  # the sign matters
        ("Answer: -2,2", "-22", "-2,2"),  # a list is not a thousands-separated number
        ("The answer is 42.", "42", "[INVALID]"),  # no "Answer:" line
        ("\\boxed{42}", "42", "[INVALID]"),  # a box alone is not the DAPO format
        ("Answer: 42\n" + "x" * 400, "42", "[INVALID]"),  # only the last 300 characters are read
        ("Answer: 2\nAnswer: 1", "2", "1"),
    ],
)
def test_wrong_or_malformed_answers_score_minus_one(response, ground_truth, pred):
    assert math_dapo.compute_score(response, ground_truth) == {"score": -1.0, "acc": 0.0, "pred": pred}


def test_strict_box_mode_compares_the_last_box_verbatim():
    assert math_dapo.compute_score("so \\boxed{42}", "42", strict_box_verify=True) == {
        "score": 1.0, "acc": 1.0, "pred": "42"
    }
    assert math_dapo.compute_score("so \\boxed{42.0}", "42", strict_box_verify=True)["score"] == -1.0
    assert math_dapo.compute_score("\\boxed{42}" + "y" * 120, "42", strict_box_verify=True) == {
        "score": -1.0, "acc": 0.0, "pred": None  # the box is outside the last 100 characters
    }


@pytest.mark.parametrize("data_source", ["math_dapo", "math", "math_dapo_reasoning", "aime2024", "aime25", "aime"])
def test_dispatch_by_data_source(data_source):
    assert default_compute_score(data_source, "Answer: 42", "42") == {"score": 1.0, "acc": 1.0, "pred": "42"}
    assert default_compute_score(data_source, "Answer: 41", "42")["score"] == -1.0


def test_normalize_final_answer():
    assert math_dapo.normalize_final_answer("x = \\$2,000") == "2000"
    assert math_dapo.normalize_final_answer("\\sqrt2") == "\\sqrt{2}"
    assert math_dapo.normalize_final_answer("\\overline{3}") == "3"
    assert math_dapo.normalize_final_answer("45^\\circ") == "45"


def test_none_ground_truth_is_an_error():
    with pytest.raises(ValueError, match="ground_truth is None"):
        math_dapo.compute_score("Answer: 1", None)
