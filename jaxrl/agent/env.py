"""The environment interface for interactive tasks in a multi-turn rollout, and one built-in example.

An environment answers the model's turns that call no tool: :meth:`Environment.reset` gets the data row,
:meth:`Environment.step` the model's turn text and returns ``(observation, reward, done)``; when not done, the
observation goes back to the model as the next user message. Rewards of all steps are summed into the row's
score (added to the reward function's). No jax.
"""

from __future__ import annotations

import re


class Environment:
    """Base class of environments (one instance per rollout row; the loop constructs it with ``config``)."""

    def __init__(self, config: dict | None = None):
        self.config = dict(config or {})

    def reset(self, row: dict) -> None:
        """Start an episode for the data row ``row`` (``reward_model.ground_truth``, ``extra_info``, ...)."""
        raise NotImplementedError

    def step(self, text: str) -> tuple[str, float, bool]:
        """React to the model's turn ``text``: ``(observation, reward, done)``; ``observation`` is the next user
        message (ignored when ``done``)."""
        raise NotImplementedError


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


class RetryAnswerEnv(Environment):
    """Example: a grader that lets the model try again.

    Reads the last number of each model turn and compares it with the row's ``reward_model.ground_truth``
    (commas dropped). Right: reward ``1``, done. Wrong or no number: reward 0 and the observation asks for another
    try (config ``feedback``), until the loop's ``max_user_turns`` ends the episode.
    """

    def reset(self, row: dict) -> None:
        truth = (row.get("reward_model") or {}).get("ground_truth")
        if truth is None:
            raise ValueError("RetryAnswerEnv needs reward_model.ground_truth in each row")
        self.truth = str(truth).replace(",", "").strip()

    def step(self, text: str) -> tuple[str, float, bool]:
        nums = _NUMBER.findall(text)
        guess = nums[-1].replace(",", "") if nums else None
        if guess is not None and _same_number(guess, self.truth):
            return "", 1.0, True
        feedback = self.config.get("feedback", "That is not correct. Check your work and give the final answer "
                                               "again as a number.")
        return feedback, 0.0, False


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b
