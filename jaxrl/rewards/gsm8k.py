"""GSM8K rule reward, following verl ``verl/utils/reward_score/gsm8k.py``.

Reference: Trung et al., "ReFT: Reasoning with Reinforced Fine-Tuning", ACL 2024 (the scoring verl
adopted). Differences from verl, all in the direction of accepting the same number written
differently: ``#### $1,000`` and ``####  18`` are accepted by ``strict``; extracted answers and the
ground truth are compared as exact decimals (``"18.00" == "18"``, ``"1,000" == "1000"``) after
removing thousands commas, ``$`` and trailing periods.

Like verl, only the last :data:`SOLUTION_CLIP_CHARS` (300) characters of the response are searched
(regexes on long strings are slow, and the final answer is at the end).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

SOLUTION_CLIP_CHARS = 300
METHODS = ("strict", "flexible")

# strict: the answer format the prompt asks for, "#### <number>" (optionally "$" before the number).
_STRICT_RE = re.compile(r"####\s*\$?\s*(-?[0-9.,]+)")
# flexible: any number-like run of digits, dots and commas (optionally negative).
_NUMBER_RE = re.compile(r"-?[0-9.,]+")


def normalize_number(s: str) -> str | None:
    """Canonical text of a number: drop ``,`` / ``$`` / spaces and trailing ``.``; None if no digit is left.

    ``"1,000." -> "1000"``, ``"$18.50" -> "18.50"``, ``"." -> None``.
    """
    s = s.replace(",", "").replace("$", "").strip().rstrip(".")
    return s if s and s not in ("-",) and any(c.isdigit() for c in s) else None


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer in a model response, as a normalised number string, or None.

    Args:
        solution_str: the response text (only its last 300 characters are searched).
        method: ``"strict"`` -> the last ``#### <number>``; ``"flexible"`` -> the last number anywhere.

    Returns:
        The number with commas, ``$`` and trailing periods removed (see :func:`normalize_number`),
        or None when there is none.

    Raises:
        ValueError: ``method`` is not ``"strict"`` or ``"flexible"``.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not valid; use one of {METHODS}")
    text = solution_str[-SOLUTION_CLIP_CHARS:]
    candidates = _STRICT_RE.findall(text) if method == "strict" else _NUMBER_RE.findall(text)
    for cand in reversed(candidates):
        norm = normalize_number(cand)
        if norm is not None:
            return norm
    return None


def numbers_equal(answer: str, ground_truth: str) -> bool:
    """True if the two strings denote the same decimal number (``"18.00"`` == ``"18"``).

    Falls back to comparing the normalised strings when either is not a valid decimal (``"1.2.3"``).
    """
    a, g = normalize_number(str(answer)), normalize_number(str(ground_truth))
    if a is None or g is None:
        return False
    try:
        return Decimal(a) == Decimal(g)
    except InvalidOperation:
        return a == g


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """GSM8K reward: ``score`` if the extracted answer equals the ground truth, ``format_score`` if an
    answer was found but is wrong, 0.0 if no answer was found.

    Args:
        solution_str: the response text.
        ground_truth: the reference number (``reward_model.ground_truth``), e.g. ``"72"``.
        method: ``"strict"`` (needs ``#### N``) or ``"flexible"`` (last number); see :func:`extract_solution`.
        format_score: reward for a well-formed but wrong answer.
        score: reward for a correct answer.

    Returns:
        float reward.

    Raises:
        ValueError: bad ``method``.
    """
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return float(score) if numbers_equal(answer, ground_truth) else float(format_score)


def compute_score_with_extras(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info=None,
    format_score: float = 0.0,
    score: float = 1.0,
) -> dict:
    """GSM8K reward in verl's reward-function signature, with what a run needs to watch learning.

    ``score`` is :func:`compute_score` with ``method="strict"`` (verl's GSM8K reward; with ``format_score > 0`` a
    well-formed wrong answer earns it, verl's ``format_score`` argument). Usable as
    ``custom_reward_function.path=jaxrl/rewards/gsm8k.py custom_reward_function.name=compute_score_with_extras``
    with ``+custom_reward_function.reward_kwargs.format_score=0.1``; the built-in GSM8K reward
    (:func:`jaxrl.rewards.default_compute_score`) is this function with ``format_score=0``.

    Args:
        data_source, extra_info: verl's arguments, unused.
        solution_str: the response text.
        ground_truth: the reference number, e.g. ``"72"``.
        format_score: reward for a ``#### N`` answer that is wrong (verl's default 0.0).
        score: reward for a correct answer.

    Returns:
        ``{"score", "acc", "format", "acc_flexible", "pred"}``: ``acc`` 1.0 if the strict answer is correct;
        ``format`` 1.0 if the response has a ``#### N`` answer at all (the format-following rate's numerator);
        ``acc_flexible`` 1.0 if the last number anywhere in the response is correct (verl's ``flexible``
        extraction); ``pred`` the strict answer or ``""``. Training logs the numeric ones as
        ``reward/<key>/mean``, validation as ``val-core/<data_source>/acc/mean@n`` and
        ``val-aux/<data_source>/<key>/mean@n``.
    """
    del data_source, extra_info
    answer = extract_solution(solution_str, method="strict")
    correct = answer is not None and numbers_equal(answer, ground_truth)
    flexible = extract_solution(solution_str, method="flexible")
    reward = float(score) if correct else (float(format_score) if answer is not None else 0.0)
    return {
        "score": reward,
        "acc": float(correct),
        "format": float(answer is not None),
        "acc_flexible": float(flexible is not None and numbers_equal(flexible, ground_truth)),
        "pred": answer or "",
    }
