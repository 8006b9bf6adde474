"""Rule-based rewards (verl ``verl/utils/reward_score``-style), the custom-function loader and the
concurrent reward manager. No jax import.

Built-in scorers by ``data_source`` (:func:`default_compute_score`, verl's dispatch):

================================================================  ==================================
data source                                                       scorer
================================================================  ==================================
``openai/gsm8k``                                                  :mod:`jaxrl.rewards.gsm8k`
``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``,       :mod:`jaxrl.rewards.math` (``rule``) or
``HuggingFaceH4/MATH-500``                                        :mod:`jaxrl.rewards.math_verify`
``math_dapo``, ``math``, ``math_dapo_reasoning``, ``aime*``       :mod:`jaxrl.rewards.math_dapo`
``tinystories/sentiment``                                         :mod:`jaxrl.rewards.sentiment`
================================================================  ==================================
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxrl.rewards import gsm8k, math_dapo, sentiment
from jaxrl.rewards import math as math_reward
from jaxrl.rewards import math_verify as math_verify_reward
from jaxrl.rewards.custom import load_custom_reward_fn
from jaxrl.rewards.manager import RewardManager, RewardOutput

GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
MATH_DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")
MATH_DAPO_PREFIXES = ("aime",)  # verl: any data source starting with "aime" (aime2024, aime25, ...)
SENTIMENT_SOURCES = ("tinystories/sentiment",)
KNOWN_DATA_SOURCES = GSM8K_SOURCES + MATH_SOURCES + MATH_DAPO_SOURCES + SENTIMENT_SOURCES
MATH_VERIFIERS = ("rule", "math_verify")  # reward_model.math_verifier: how MATH_SOURCES are compared
CHECKED_ROWS = 1000  # check_data_sources reads this many rows of each file set (the trainer's choice)


class UnknownDataSourceError(ValueError):
    """A data source that no built-in scorer handles, with no custom reward function configured."""


def scorer_name(data_source: str) -> str | None:
    """The built-in scorer for ``data_source``: ``"gsm8k"``, ``"math"``, ``"math_dapo"``, ``"sentiment"`` or None."""
    if not isinstance(data_source, str):
        return None
    if data_source in GSM8K_SOURCES:
        return "gsm8k"
    if data_source in MATH_SOURCES:
        return "math"
    if data_source in MATH_DAPO_SOURCES or data_source.startswith(MATH_DAPO_PREFIXES):
        return "math_dapo"
    if data_source in SENTIMENT_SOURCES:
        return "sentiment"
    return None


def _known_list() -> str:
    return ", ".join(KNOWN_DATA_SOURCES) + ", " + ", ".join(p + "*" for p in MATH_DAPO_PREFIXES)


def default_compute_score(
    data_source: str, solution_str: str, ground_truth, extra_info=None, *, math_verifier: str = "rule", **kwargs
) -> dict:
    """Score one response by its data source, like verl's ``default_compute_score``.

    Dispatch (see the module docstring's table):
      * GSM8K -> :func:`jaxrl.rewards.gsm8k.compute_score` (strict ``#### N``; 1.0 / 0.0);
      * MATH family -> the last ``\\boxed{}`` compared with :func:`jaxrl.rewards.math.compute_score`
        (``math_verifier="rule"``, Hendrycks normalisation; 1.0 / 0.0) or
        :func:`jaxrl.rewards.math_verify.compute_score` (``"math_verify"``, symbolic; 1.0 / 0.0);
      * ``math_dapo`` / ``math`` / ``math_dapo_reasoning`` / ``aime*`` -> :func:`jaxrl.rewards.math_dapo.compute_score`
        (``Answer: ...``; 1.0 / -1.0);
      * ``tinystories/sentiment`` -> :func:`jaxrl.rewards.sentiment.compute_score` (in ``[-1, 1]``;
        ``ground_truth`` is ignored).

    ``functools.partial(default_compute_score, math_verifier="math_verify")`` pickles (module-level function),
    so it can be sent to reward worker processes.

    Args:
        data_source: the row's ``data_source``.
        solution_str: the decoded response.
        ground_truth: the row's ``reward_model.ground_truth``.
        extra_info: the row's ``extra_info`` (unused by these scorers; part of verl's signature).
        math_verifier: ``"rule"`` or ``"math_verify"`` (``reward_model.math_verifier``), for the MATH family.
        **kwargs: verl's other keywords (``sandbox_fusion_url``, ``concurrent_semaphore``, ...), accepted and
            unused by these scorers.

    Returns:
        ``{"score": float, "acc": float}`` plus ``"pred"`` (the extracted answer; validation's maj@n votes on it)
        for the math scorers. ``acc`` is 1.0 for a correct answer and, for the sentiment task, for a story at least
        :data:`jaxrl.rewards.sentiment.HAPPY_THRESHOLD` happy (DAPO's dynamic sampling filters groups on ``acc``).

    Raises:
        NotImplementedError: unknown ``data_source`` (verl's error type; the message lists the known ones and
            points to ``custom_reward_function.path``).
        ValueError: ``math_verifier`` is not one of :data:`MATH_VERIFIERS`; a scorer's own errors (e.g. a None
            ground truth).
    """
    if math_verifier not in MATH_VERIFIERS:
        raise ValueError(f"math_verifier={math_verifier!r} is not valid; use one of {MATH_VERIFIERS}")
    kind = scorer_name(data_source)
    if kind == "gsm8k":
        score = float(gsm8k.compute_score(solution_str, ground_truth))
        return {"score": score, "acc": float(score == 1.0), "pred": gsm8k.extract_solution(solution_str) or ""}
    if kind == "math":
        if math_verifier == "math_verify":
            return math_verify_reward.compute_score(solution_str, ground_truth)
        return math_reward.compute_score(solution_str, ground_truth)
    if kind == "math_dapo":
        return math_dapo.compute_score(solution_str, ground_truth)
    if kind == "sentiment":
        score = float(sentiment.compute_score(solution_str))
        return {"score": score, "acc": float(score >= sentiment.HAPPY_THRESHOLD)}
    raise NotImplementedError(
        f"no built-in reward for data_source={data_source!r}; known data sources: {_known_list()} "
        "(for others, set custom_reward_function.path/name)"
    )


def check_data_sources(data_sources: Iterable, *, custom_reward: bool, origin: str | None = None) -> None:
    """Fail at start, not with silent zero rewards, when a row's data source has no built-in scorer.

    Args:
        data_sources: the rows' ``data_source`` values (e.g. of the first :data:`CHECKED_ROWS` rows of each file).
        custom_reward: True when ``custom_reward_function.path`` is set: that function scores every row, so
            nothing is checked.
        origin: where the rows came from (e.g. ``"data.train_files=['x.parquet']"``), named in the error.

    Raises:
        UnknownDataSourceError: the first data source with no built-in scorer (a missing ``data_source`` is
            named as None); the one-line message names it, ``origin``, the known data sources and the options.
    """
    if custom_reward:
        return
    for ds in data_sources:
        if scorer_name(ds) is None:
            where = f" in {origin}" if origin else ""
            raise UnknownDataSourceError(
                f"data_source {ds!r}{where} has no built-in reward function (built-in: {_known_list()}); "
                "set custom_reward_function.path=FILE.py (and custom_reward_function.name, default compute_score) "
                "to score it with your own function, or change the rows' data_source to a built-in one"
            )


__all__ = [
    "CHECKED_ROWS",
    "KNOWN_DATA_SOURCES",
    "MATH_VERIFIERS",
    "RewardManager",
    "RewardOutput",
    "UnknownDataSourceError",
    "check_data_sources",
    "default_compute_score",
    "gsm8k",
    "load_custom_reward_fn",
    "math_dapo",
    "math_reward",
    "math_verify_reward",
    "scorer_name",
    "sentiment",
]
