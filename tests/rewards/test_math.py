"""MATH rule scorer (jaxrl.rewards.math): hand-checked responses against reference answers."""

from __future__ import annotations

import pytest

from jaxrl.rewards import default_compute_score
from jaxrl.rewards import math as math_reward

MATH500 = "HuggingFaceH4/MATH-500"


@pytest.mark.parametrize(
    "response, ground_truth",
    [
        (r"The answer is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        (r"$\boxed{\dfrac{1}{2}}$", r"\frac{1}{2}"),  # \dfrac / \tfrac are \frac
        (r"$\boxed{\tfrac12}$", r"\frac{1}{2}"),  # shorthand arguments get braces
        (r"$\boxed{1/2}$", r"\frac{1}{2}"),  # a/b of integers
        (r"$\boxed{0.5}$", r"\frac{1}{2}"),
        (r"$\boxed{-1/2}$", r"-\frac{1}{2}"),  # sign in front
        (r"$\boxed{\frac{-1}{2}}$", r"-\frac{1}{2}"),
        (r"$\boxed{-3}$", "-3"),
        (r"$\boxed{- 3}$", "-3"),  # spaces do not matter
        (r"$\boxed{2000}$", r"2,\!000"),  # MATH's own way of writing thousands
        (r"$\boxed{2,000}$", "2000"),
        (r"$\boxed{2{,}000}$", "2000"),
        (r"$\boxed{-12,345}$", "-12345"),
        (r"$\boxed{2.50}$", "2.5"),  # plain numbers compare as decimals
        (r"$\boxed{10\text{ cm}}$", "10"),  # a unit after "\text{ " is cut
        (r"$\boxed{10}$", r"10\text{ cm}"),
        (r"$\boxed{\$5}$", "5"),  # dollars
        (r"$\boxed{\$1,\!657}$", "1657"),
        (r"$\boxed{50\%}$", "50"),  # percentages
        (r"$\boxed{50%}$", r"50\%"),
        (r"$\boxed{90^\circ}$", "90"),  # degrees
        (r"$\boxed{x = 5}$", "5"),  # a short equation prefix is dropped
        (r"$\boxed{\frac{\sqrt{3}}{2}}$", r"\frac{\sqrt3}{2}"),  # nested braces; \sqrt3 -> \sqrt{3}
        (r"$\boxed{\left( 3, \frac{\pi}{2} \right)}$", r"(3,\frac{\pi}{2})"),  # \left / \right
        (r"so the answer is $\boxed 5$.", "5"),  # \boxed without braces (MATH's short form)
        (r"hence \boxed {7}", "7"),  # a space before the brace
        (r"\fbox{7}", "7"),  # \fbox is a box too
        (r"first \boxed{3}, then corrected: \boxed{4}", "4"),  # the last box counts
        (r"$\boxed{\boxed{12}}$", "12"),
        (r"$\boxed{\text{Evelyn}}$", r"\text{Evelyn}"),
    ],
)
def test_right_answers_score_one(response, ground_truth):
    out = default_compute_score(MATH500, response, ground_truth)
    assert out["score"] == 1.0 and out["acc"] == 1.0, (out, math_reward.normalize_answer(ground_truth))


@pytest.mark.parametrize(
    "response, ground_truth",
    [
        (r"$\boxed{\frac{1}{3}}$", r"\frac{1}{2}"),  # wrong
        (r"$\boxed{3}$", "-3"),  # the sign matters
        (r"$\boxed{1,2}$", "12"),  # a list is not a thousands-separated number
        (r"$\boxed{2,00}$", "200"),
        (r"$\boxed{2.51}$", "2.5"),
        (r"first \boxed{4}, then corrected: \boxed{3}", "4"),  # an earlier box does not count
        (r"The answer is 5.", "5"),  # no box at all
        (r"$\boxed{5", "5"),  # unclosed box
        (r"$\boxed{}$", ""),  # empty box: no answer
        (r"$\boxed{50}$", "5"),
        (r"\boxed", "5"),
    ],
)
def test_wrong_or_malformed_answers_score_zero(response, ground_truth):
    out = default_compute_score(MATH500, response, ground_truth)
    assert out["score"] == 0.0 and out["acc"] == 0.0, out


def test_pred_is_the_normalised_box_and_empty_without_one():
    assert default_compute_score(MATH500, r"\boxed{\dfrac{1}{2}}", "3") == {
        "score": 0.0, "acc": 0.0, "pred": r"\frac{1}{2}"
    }
    assert default_compute_score(MATH500, r"\boxed{2,\!000}", "2000")["pred"] == "2000"
    assert default_compute_score(MATH500, "no box", "3")["pred"] == ""


def test_every_math_data_source_uses_it():
    for ds in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", MATH500):
        assert default_compute_score(ds, r"\boxed{\frac12}", r"\frac{1}{2}")["score"] == 1.0
        assert default_compute_score(ds, r"\boxed{\frac13}", r"\frac{1}{2}")["score"] == 0.0


def test_last_boxed_only():
    assert math_reward.last_boxed_only(r"a \boxed{\frac{1}{\sqrt{2}}} b") == r"\frac{1}{\sqrt{2}}"
    assert math_reward.last_boxed_only("$\\boxed 42$ and more") == "42"
    assert math_reward.last_boxed_only("\\boxed 42\nnext line") == "42"
    assert math_reward.last_boxed_only(r"\boxed{1} \fbox{2}") == "2"
    assert math_reward.last_boxed_only(r"\fbox{1} \boxed{2}") == "2"
    assert math_reward.last_boxed_only(r"\boxed{unclosed") is None
    assert math_reward.last_boxed_only("nothing") is None


def test_none_ground_truth_is_an_error_not_a_zero():
    with pytest.raises(ValueError, match="ground_truth is None"):
        default_compute_score(MATH500, r"\boxed{1}", None)


def test_numeric_ground_truth_is_read_as_text():
    assert default_compute_score(MATH500, r"\boxed{42}", 42)["score"] == 1.0
