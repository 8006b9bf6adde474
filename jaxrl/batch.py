"""The containers that travel through a training step: :class:`RLBatch` (an RL step's rows) and :class:`PairBatch`
(DPO's chosen / rejected pairs of them).

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
      reward_baselines: float32 ``[N]``, ReMax's baseline: the score of a greedy response to the same prompt.
      response_attention_mask: int32 ``[N, R]``, multi-turn rollouts only: 1 on every real response token (the
        model's and the tool / user tokens between its turns, which the model attends to but is not trained on:
        ``response_mask`` is 0 there). None (single-turn): ``response_mask`` is also the attention mask.
      acc: float32 ``[N]``, PRIME: the outcome label of each response in [0, 1] (the reward function's ``acc``
        output, else its score, clipped), what the implicit PRM is trained against.
      rm_scores: float32 ``[N, R]``, PRIME: the implicit PRM's process rewards (the ``"prime"`` estimator's input).
      policy_version: int32 ``[N]``, the asynchronous pipeline (``async_training.staleness`` > 0): the policy version
        (actor updates applied) of the weights that generated each row. None in synchronous runs.
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
    reward_baselines: np.ndarray | None = None
    response_attention_mask: np.ndarray | None = None
    acc: np.ndarray | None = None
    rm_scores: np.ndarray | None = None
    policy_version: np.ndarray | None = None

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
        """``[N, P + R]`` int32: 1 on real prompt tokens and valid response tokens (with
        ``response_attention_mask`` set: also the tool / user tokens of a multi-turn response)."""
        resp = self.response_mask if self.response_attention_mask is None else self.response_attention_mask
        return np.concatenate([self.prompt_mask, resp], axis=1).astype(np.int32)

    def positions(self) -> np.ndarray:
        """``[N, P + R]`` int32 RoPE positions: ``cumsum(mask) - 1`` clipped at 0 (left padding aware)."""
        return positions_from_mask(self.attention_mask())

    def sequence_arrays(self) -> dict[str, np.ndarray]:
        """The per-row arrays every log-prob forward and policy-side loss reads, ``[N, ...]`` each:
        ``input_ids`` / ``positions`` / ``attention_mask`` ``[N, P + R]`` int32, ``response_ids`` ``[N, R]`` and
        ``response_mask`` ``[N, R]`` float32."""
        return {
            "input_ids": self.input_ids(),
            "positions": self.positions(),
            "attention_mask": self.attention_mask(),
            "response_ids": self.response_ids,
            "response_mask": self.response_mask.astype(np.float32),
        }

    def select(self, idx: np.ndarray) -> RLBatch:
        """A new batch with rows ``idx`` (``[K]`` int) of every non-empty field."""
        return RLBatch(
            **{f.name: (None if (v := getattr(self, f.name)) is None else v[idx]) for f in dataclasses.fields(self)}
        )


@dataclass
class PairBatch:
    """``B`` preference pairs: row ``i`` of ``chosen`` and row ``i`` of ``rejected`` answer the same prompt.

    Attributes:
      chosen, rejected: :class:`RLBatch` of ``B`` rows each, one width.
      ref_chosen_logps, ref_rejected_logps: float32 ``[B]``, the frozen reference's sequence log-probabilities of
        each response (filled by the trainer before the update), or None.
    """

    chosen: RLBatch
    rejected: RLBatch
    ref_chosen_logps: np.ndarray | None = None
    ref_rejected_logps: np.ndarray | None = None

    @property
    def size(self) -> int:
        return self.chosen.size

    @property
    def prompt_width(self) -> int:
        return self.chosen.prompt_width

    def both(self) -> RLBatch:
        """Chosen rows then rejected rows as one ``[2B, ...]`` batch (one forward pass over both)."""
        c, r = self.chosen, self.rejected
        return RLBatch(**{f.name: (None if getattr(c, f.name) is None
                                   else np.concatenate([getattr(c, f.name), getattr(r, f.name)]))
                          for f in dataclasses.fields(RLBatch)})


def positions_from_mask(mask: np.ndarray) -> np.ndarray:
    """RoPE positions ``[B, T]`` int32 from an attention mask ``[B, T]``: ``max(cumsum(mask) - 1, 0)``."""
    return np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)


def concat_batches(batches: list[RLBatch]) -> RLBatch:
    """Stack batches row-wise (e.g. several generation rounds of dynamic sampling).

    Prompts are left-padded to the widest prompt (new slots: id 0, mask 0); group ids
    are offset so that groups of different batches never merge. Fields must be set in all batches or none.

    Raises:
      ValueError: an empty list, different response widths, or a field set in some batches only.
    """
    if not batches:
        raise ValueError("concat_batches needs at least one batch")
    widths = {b.response_width for b in batches}
    if len(widths) != 1:
        raise ValueError(f"cannot concatenate batches with different response widths {sorted(widths)}")
    p = max(b.prompt_width for b in batches)

    def left_pad(x: np.ndarray, width: int) -> np.ndarray:
        return np.pad(x, ((0, 0), (width - x.shape[1], 0)))

    out = {}
    offset = 0
    group_ids = []
    for b in batches:
        group_ids.append(b.group_ids + offset)
        offset += int(b.group_ids.max()) + 1 if b.size else 0
    out["group_ids"] = np.concatenate(group_ids).astype(np.int32)
    out["prompt_ids"] = np.concatenate([left_pad(b.prompt_ids, p) for b in batches])
    out["prompt_mask"] = np.concatenate([left_pad(b.prompt_mask, p) for b in batches])
    for f in dataclasses.fields(RLBatch):
        if f.name in out:
            continue
        vals = [getattr(b, f.name) for b in batches]
        if all(v is None for v in vals):
            out[f.name] = None
        elif any(v is None for v in vals):
            raise ValueError(f"batch field {f.name!r} is set in some batches but not others")
        else:
            out[f.name] = np.concatenate(vals)
    return RLBatch(**out)
