"""The one container that travels through an RL step.

Every field is a host numpy array with a documented shape. ``N`` is the number of responses in the
step (prompts x ``rollout.n``), ``P`` the bucketed prompt width, ``R`` the response horizon
(``rollout.max_new_tokens``; fixed, so XLA compiles one program per phase).

Fields are filled phase by phase by the controller (``jaxrl.trainer``): the rollout engine sets the
token fields, the reward phase ``token_level_scores``/``token_level_rewards``, the actor
``old_log_probs``, the reference ``ref_log_probs``, the advantage phase ``advantages``/``returns``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np


@dataclass
class RLBatch:
    """Arrays of one RL step (numpy, host memory).

    Attributes:
      prompt_ids: int32 ``[N, P]``, left-padded with the pad id.
      prompt_mask: int32 ``[N, P]``, 1 on real prompt tokens.
      response_ids: int32 ``[N, R]``, right-padded.
      response_mask: int32 ``[N, R]``, 1 on generated tokens up to and including EOS.
      group_ids: int32 ``[N]``, responses to the same prompt share a group id (GRPO groups).
      rollout_log_probs: float32 ``[N, R]``, log-probs the rollout engine reported for its samples.
      old_log_probs: float32 ``[N, R]``, the actor's recomputed log-probs before the update.
      ref_log_probs: float32 ``[N, R]``, the frozen reference policy's log-probs.
      token_level_scores: float32 ``[N, R]``, the reward function's score on the last response token.
      token_level_rewards: float32 ``[N, R]``, scores minus the in-reward KL penalty (if enabled).
      advantages, returns: float32 ``[N, R]``.
      values: float32 ``[N, R]``, the critic's values before the update (PPO/GAE); value at response token
        ``j`` is read from the state before emitting it.
    """

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    response_ids: np.ndarray
    response_mask: np.ndarray
    group_ids: np.ndarray
    rollout_log_probs: np.ndarray | None = None
    old_log_probs: np.ndarray | None = None
    ref_log_probs: np.ndarray | None = None
    token_level_scores: np.ndarray | None = None
    token_level_rewards: np.ndarray | None = None
    advantages: np.ndarray | None = None
    returns: np.ndarray | None = None
    values: np.ndarray | None = None

    @property
    def size(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def prompt_width(self) -> int:
        return int(self.prompt_ids.shape[1])

    @property
    def response_width(self) -> int:
        return int(self.response_ids.shape[1])

    def input_ids(self) -> np.ndarray:
        """``[N, P + R]`` int32: prompt and response side by side."""
        return np.concatenate([self.prompt_ids, self.response_ids], axis=1).astype(np.int32)

    def attention_mask(self) -> np.ndarray:
        """``[N, P + R]`` int32: 1 on real prompt tokens and valid response tokens."""
        return np.concatenate([self.prompt_mask, self.response_mask], axis=1).astype(np.int32)

    def positions(self) -> np.ndarray:
        """``[N, P + R]`` int32 RoPE positions: ``cumsum(mask) - 1`` clipped at 0 (left padding aware)."""
        return positions_from_mask(self.attention_mask())

    def select(self, idx: np.ndarray) -> "RLBatch":
        """A new batch with rows ``idx`` (``[K]`` int) of every non-empty field."""
        return RLBatch(
            **{f.name: (None if (v := getattr(self, f.name)) is None else v[idx]) for f in dataclasses.fields(self)}
        )


def positions_from_mask(mask: np.ndarray) -> np.ndarray:
    """RoPE positions ``[B, T]`` int32 from an attention mask ``[B, T]``: ``max(cumsum(mask) - 1, 0)``."""
    return np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
