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


def accuracy_band_groups(acc: np.ndarray, group_ids: np.ndarray, lengths: np.ndarray, *, keep: int,
                         filter_accuracy: bool, lower: float, upper: float, filter_truncate: bool,
                         max_length: int) -> tuple[np.ndarray, int]:
    """PRIME's prompt filter (verl ``recipe/prime``: ``data.filter_accuracy`` / ``accuracy_lower_bound`` /
    ``accuracy_upper_bound`` / ``filter_truncate``, after ``data.oversample_factor`` x the prompts were generated):
    the ``keep`` groups a step trains on. A group passes when its mean outcome label lies in ``[lower, upper]``
    (with ``filter_accuracy``) and none of its responses has ``>= max_length - 1`` tokens (with
    ``filter_truncate``); passing groups come first, then the others, each in batch order.

    Args:
      acc: ``[N]`` outcome labels; group_ids: ``[N]`` int groups; lengths: ``[N]`` response lengths in tokens.
      keep: groups to keep (``data.train_batch_size``).

    Returns:
      ``(rows, passing)``: the kept rows ``[K]`` int (ascending) and how many groups of the batch passed.
    """
    acc, group_ids, lengths = np.asarray(acc, np.float64), np.asarray(group_ids), np.asarray(lengths)
    groups = list(dict.fromkeys(group_ids.tolist()))  # in order of first appearance
    passing = []
    for g in groups:
        rows = group_ids == g
        ok = True
        if filter_accuracy:
            ok = bool(lower <= acc[rows].mean() <= upper)
        if filter_truncate:
            ok = ok and bool(lengths[rows].max() < max_length - 1)
        passing.append(ok)
    order = np.argsort(~np.asarray(passing, bool), kind="stable")
    chosen = np.asarray(groups)[order][:keep]
    return np.flatnonzero(np.isin(group_ids, chosen)), int(np.sum(passing))
