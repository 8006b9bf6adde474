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
``codecontests``, ``apps``, ``codeforces``, ``taco``, ``mbpp``,     :mod:`jaxrl.rewards.code` (test cases run
``google-research-datasets/mbpp``                                 in the sandbox, :mod:`jaxrl.sandbox`)
``openai/openai_humaneval``                                       :mod:`jaxrl.rewards.code` (HumanEval)
================================================================  ==================================
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxrl.rewards import code as code_reward
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
# verl's code data sources (scored with test cases in a sandbox) and MBPP-style rows (assert cases)
CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco", "mbpp", "google-research-datasets/mbpp")
HUMANEVAL_SOURCES = ("openai/openai_humaneval",)
KNOWN_DATA_SOURCES = (GSM8K_SOURCES + MATH_SOURCES + MATH_DAPO_SOURCES + SENTIMENT_SOURCES + CODE_SOURCES
                      + HUMANEVAL_SOURCES)
SANDBOX_SCORERS = ("code", "humaneval")  # the scorers that run model-written code
MATH_VERIFIERS = ("rule", "math_verify")  # reward_model.math_verifier: how MATH_SOURCES are compared
CHECKED_ROWS = 1000  # check_data_sources reads this many rows of each file set (the trainer's choice)


class UnknownDataSourceError(ValueError):
    """A data source that no built-in scorer handles, with no custom reward function configured."""


def scorer_name(data_source: str) -> str | None:
    """The built-in scorer for ``data_source``: ``"gsm8k"``, ``"math"``, ``"math_dapo"``, ``"sentiment"``,
    ``"code"``, ``"humaneval"`` or None."""
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
    if data_source in CODE_SOURCES:
        return "code"
    if data_source in HUMANEVAL_SOURCES:
        return "humaneval"
    return None


def needs_sandbox(data_sources: Iterable) -> bool:
    """Whether any of ``data_sources`` is scored by running model-written code (the sandbox must work)."""
    return any(scorer_name(ds) in SANDBOX_SCORERS for ds in data_sources)


def _known_list() -> str:
    return ", ".join(KNOWN_DATA_SOURCES) + ", " + ", ".join(p + "*" for p in MATH_DAPO_PREFIXES)


def default_compute_score(
    data_source: str, solution_str: str, ground_truth, extra_info=None, sandbox_fusion_url: str | None = None,
    concurrent_semaphore=None, memory_limit_mb: int | None = None, *, math_verifier: str = "rule",
    code: code_reward.CodeRewardSettings | None = None, **kwargs,
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
        ``ground_truth`` is ignored);
      * ``codecontests`` / ``apps`` / ``codeforces`` / ``taco`` / MBPP -> :func:`jaxrl.rewards.code.compute_score`
        (the ground truth's test cases run in the sandbox; the fraction passed or all-pass, in ``[0, 1]``);
      * ``openai/openai_humaneval`` -> :func:`jaxrl.rewards.code.compute_humaneval_score` (1.0 / 0.0).

    ``functools.partial(default_compute_score, math_verifier="math_verify")`` pickles (module-level function),
    so it can be sent to reward worker processes.

    Args:
        data_source: the row's ``data_source``.
        solution_str: the decoded response.
        ground_truth: the row's ``reward_model.ground_truth``.
        extra_info: the row's ``extra_info`` (unused by these scorers; part of verl's signature).
        sandbox_fusion_url: verl's keyword: code rows run on this Sandbox Fusion server (when ``code`` is None).
        concurrent_semaphore: verl's keyword, accepted and unused (requests in flight are at most the reward
            manager's scoring processes).
        memory_limit_mb: verl's keyword: each code run's memory (when ``code`` is None).
        math_verifier: ``"rule"`` or ``"math_verify"`` (``reward_model.math_verifier``), for the MATH family.
        code: how code rows run (sandbox, limits, score mode, time budget; built from ``reward_model.sandbox``
            and ``reward_model.sandbox_fusion`` by :func:`jaxrl.rewards.factory.build_reward_manager`); None =
            :func:`jaxrl.rewards.code.settings_for` the two verl keywords above.
        **kwargs: verl's other keywords, accepted and unused by these scorers.

    Returns:
        ``{"score": float, "acc": float}`` plus ``"pred"`` (the extracted answer; validation's maj@n votes on it)
        for the math scorers; GSM8K also gives ``"format"`` and ``"acc_flexible"``
        (:func:`jaxrl.rewards.gsm8k.compute_score_with_extras`). ``acc`` is 1.0 for a correct answer and, for the
        sentiment task, for a story at least :data:`jaxrl.rewards.sentiment.HAPPY_THRESHOLD` happy (DAPO's dynamic
        sampling filters groups on ``acc``).

    Raises:
        NotImplementedError: unknown ``data_source`` (verl's error type; the message lists the known ones and
            points to ``custom_reward_function.path``).
        ValueError: ``math_verifier`` is not one of :data:`MATH_VERIFIERS`; a scorer's own errors (e.g. a None
            ground truth, a code row without test cases).
        jaxrl.rewards.code.CodeSandboxError / jaxrl.sandbox.SandboxUnavailableError: a code row could not be run
            (counted by the reward manager as an error, never a zero).
    """
    if math_verifier not in MATH_VERIFIERS:
        raise ValueError(f"math_verifier={math_verifier!r} is not valid; use one of {MATH_VERIFIERS}")
    kind = scorer_name(data_source)
    if kind == "gsm8k":
        return gsm8k.compute_score_with_extras(data_source, solution_str, ground_truth)
    if kind == "math":
        if math_verifier == "math_verify":
            return math_verify_reward.compute_score(solution_str, ground_truth)
        return math_reward.compute_score(solution_str, ground_truth)
    if kind == "math_dapo":
        return math_dapo.compute_score(solution_str, ground_truth)
    if kind == "sentiment":
        score = float(sentiment.compute_score(solution_str))
        return {"score": score, "acc": float(score >= sentiment.HAPPY_THRESHOLD)}
    if kind in SANDBOX_SCORERS:
        settings = code or code_reward.settings_for(sandbox_fusion_url, memory_limit_mb)
        if kind == "code":
            return code_reward.compute_score(solution_str, ground_truth, settings)
        return code_reward.compute_humaneval_score(solution_str, ground_truth, settings)
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
    "CODE_SOURCES",
    "HUMANEVAL_SOURCES",
    "KNOWN_DATA_SOURCES",
    "MATH_VERIFIERS",
    "RewardManager",
    "RewardOutput",
    "UnknownDataSourceError",
    "check_data_sources",
    "code_reward",
    "default_compute_score",
    "gsm8k",
    "load_custom_reward_fn",
    "math_dapo",
    "math_reward",
    "math_verify_reward",
    "needs_sandbox",
    "scorer_name",
    "sentiment",
]
