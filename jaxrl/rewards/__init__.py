"""Rule-based rewards (verl ``verl/utils/reward_score``-style), the custom-function loader and the
concurrent reward manager. No jax import.
"""

from __future__ import annotations

from jaxrl.rewards import gsm8k, sentiment
from jaxrl.rewards.custom import load_custom_reward_fn
from jaxrl.rewards.manager import RewardManager, RewardOutput

GSM8K_SOURCES = ("openai/gsm8k",)
SENTIMENT_SOURCES = ("tinystories/sentiment",)
KNOWN_DATA_SOURCES = GSM8K_SOURCES + SENTIMENT_SOURCES


def default_compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> dict[str, float]:
    """Score one response by its data source, like verl's ``default_compute_score``.

    Dispatch:
      * ``"openai/gsm8k"`` -> :func:`jaxrl.rewards.gsm8k.compute_score` (strict ``#### N``; 1.0 / 0.0);
      * ``"tinystories/sentiment"`` -> :func:`jaxrl.rewards.sentiment.compute_score` (in ``[-1, 1]``;
        ``ground_truth`` is ignored).

    Args:
        data_source: the row's ``data_source``.
        solution_str: the decoded response.
        ground_truth: the row's ``reward_model.ground_truth``.
        extra_info: the row's ``extra_info`` (unused by these scorers; part of verl's signature).

    Returns:
        ``{"score": float, "acc": float}`` (+ ``"pred"``, the extracted answer, for GSM8K: validation's maj@n
        votes on it): ``acc`` is 1.0 for a correct GSM8K answer and, for the sentiment task,
        for a story at least :data:`jaxrl.rewards.sentiment.HAPPY_THRESHOLD` happy (DAPO's dynamic sampling
        filters groups on ``acc`` by default, as verl's DAPO reward does).

    Raises:
        NotImplementedError: unknown ``data_source`` (the message lists the known ones and points to
            ``custom_reward_function``).
    """
    if data_source in GSM8K_SOURCES:
        score = float(gsm8k.compute_score(solution_str, ground_truth))
        return {"score": score, "acc": float(score == 1.0), "pred": gsm8k.extract_solution(solution_str) or ""}
    if data_source in SENTIMENT_SOURCES:
        score = float(sentiment.compute_score(solution_str))
        return {"score": score, "acc": float(score >= sentiment.HAPPY_THRESHOLD)}
    raise NotImplementedError(
        f"no built-in reward for data_source={data_source!r}; known data sources: "
        f"{list(KNOWN_DATA_SOURCES)} (for others, set custom_reward_function.path/name)"
    )


__all__ = [
    "KNOWN_DATA_SOURCES",
    "RewardManager",
    "RewardOutput",
    "default_compute_score",
    "gsm8k",
    "load_custom_reward_fn",
    "sentiment",
]
