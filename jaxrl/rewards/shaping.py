"""Reward shaping applied on top of the reward function's scores (numpy, host side)."""

from __future__ import annotations

import numpy as np


def overlong_penalty(
    response_lengths: np.ndarray, *, max_response_length: int, buffer_len: int, penalty_factor: float
) -> np.ndarray:
    """DAPO's soft overlong punishment (arXiv 2503.14476, Eq. 13; verl ``DAPORewardManager``).

    With ``expected = max_response_length - buffer_len`` the penalty of a response of ``L`` tokens is
    ``min(0, -(L - expected) / buffer_len * penalty_factor)``: 0 up to ``expected`` tokens, falling linearly
    to ``-penalty_factor`` at ``max_response_length``.

    Args:
      response_lengths: ``[N]`` valid response tokens.
      max_response_length: the response horizon (tokens).
      buffer_len: the length of the soft-penalty window (tokens), ``0 < buffer_len <= max_response_length``.
      penalty_factor: the penalty at the horizon (>= 0).

    Returns:
      float32 ``[N]`` penalties (<= 0), to be added to the scores.

    Raises:
      ValueError: ``buffer_len`` outside ``(0, max_response_length]`` or a negative ``penalty_factor``.
    """
    if not 0 < buffer_len <= max_response_length:
        raise ValueError(
            f"reward_model.overlong_buffer.len={buffer_len} must be in (0, max_response_length={max_response_length}]"
        )
    if penalty_factor < 0:
        raise ValueError(f"reward_model.overlong_buffer.penalty_factor={penalty_factor} must be >= 0")
    expected = max_response_length - buffer_len
    exceed = np.asarray(response_lengths, np.float32) - expected
    return np.minimum(-exceed / buffer_len * penalty_factor, 0.0).astype(np.float32)


def groups_with_signal(metric: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """DAPO dynamic sampling: which responses belong to a group whose metric is not all equal.

    A group whose responses all score the same has zero GRPO advantage and teaches nothing; DAPO
    (arXiv 2503.14476, Sec. 3.2; verl ``filter_groups``) drops it and samples more prompts instead.
    Groups of one response are dropped too (their std is 0 by definition, as in verl).

    Args:
      metric: ``[N]`` per-response value (score, accuracy, ...).
      group_ids: ``[N]`` int group of each response.

    Returns:
      bool ``[N]``: True for responses of groups with ``std(metric) > 0``.
    """
    metric = np.asarray(metric, np.float64)
    group_ids = np.asarray(group_ids)
    keep = np.zeros(metric.shape, bool)
    for g in np.unique(group_ids):
        rows = group_ids == g
        keep[rows] = rows.sum() > 1 and np.std(metric[rows]) > 0
    return keep
