"""Data-parallel dispatch for a rollout group of independent engines (vLLM per host): split one generate call's
prompts across the members, merge their outputs back into one batch.

verl's ``Dispatch.DP_COMPUTE_PROTO`` splits a batch into equal chunks by data-parallel rank and concatenates the
results; these two pure functions are that for :class:`~jaxrl.rollout.base.RolloutOutput`. A JAX world needs no
such split (every process takes the same inputs, the mesh shards the rows), so only a group of separate engines
uses them.

Exactness: member ``k`` generates rows ``first_row ..`` of the whole call with the per-row seeds a single engine
would use for those rows (``first_row`` = its first prompt x ``n``, see
:meth:`jaxrl.rollout.vllm_engine.VllmEngine.generate`), and :func:`merge_outputs` re-pads the prompts to the widest
member's width, so the merged output is the one a single engine would return for the whole call, up to the
engines' own batch-dependent numerics.
"""

from __future__ import annotations

import numpy as np

from jaxrl.rollout.base import RolloutOutput

__all__ = ["merge_outputs", "split_prompts"]


def split_prompts(num_prompts: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous ``(start, stop)`` prompt ranges, one per member, sizes differing by at most one (the first
    ``num_prompts % parts`` members take one more); a member may get an empty range when prompts < members.

    Raises:
      ValueError: ``parts`` < 1 or ``num_prompts`` < 0.
    """
    if parts < 1 or num_prompts < 0:
        raise ValueError(f"split_prompts(num_prompts={num_prompts}, parts={parts}): need parts >= 1, prompts >= 0")
    base, extra = divmod(num_prompts, parts)
    out, start = [], 0
    for k in range(parts):
        stop = start + base + (1 if k < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def merge_outputs(outputs: list[RolloutOutput], *, first_prompts: list[int], pad_token_id: int) -> RolloutOutput:
    """One :class:`RolloutOutput` from the members' outputs, in member order.

    Args:
      outputs: each member's output for its prompt range (rows ``[N_k, ...]``; prompts left-padded to the member's
        bucketed width ``P_k``; responses ``[N_k, R]`` with the same ``R``).
      first_prompts: the index of each member's first prompt in the whole call (its ``prompt_index`` is shifted by
        it).
      pad_token_id: the pad id the prompts are left-padded with to the widest ``P_k``.

    Raises:
      ValueError: no outputs, ``first_prompts`` of another length, or response widths that differ.
    """
    if not outputs or len(outputs) != len(first_prompts):
        raise ValueError(f"merge_outputs: {len(outputs)} outputs for {len(first_prompts)} members")
    widths = {o.response_ids.shape[1] for o in outputs}
    if len(widths) != 1:
        raise ValueError(f"merge_outputs: the members' response widths differ ({sorted(widths)})")
    p = max(o.prompt_ids.shape[1] for o in outputs)

    def left_pad(a: np.ndarray, value: int) -> np.ndarray:
        return np.pad(a, ((0, 0), (p - a.shape[1], 0)), constant_values=value)

    attn = [o.response_attention_mask for o in outputs]
    return RolloutOutput(
        prompt_ids=np.concatenate([left_pad(o.prompt_ids, pad_token_id) for o in outputs]),
        prompt_mask=np.concatenate([left_pad(o.prompt_mask, 0) for o in outputs]),
        response_ids=np.concatenate([o.response_ids for o in outputs]),
        response_mask=np.concatenate([o.response_mask for o in outputs]),
        rollout_log_probs=np.concatenate([o.rollout_log_probs for o in outputs]),
        prompt_index=np.concatenate([o.prompt_index + first for o, first in zip(outputs, first_prompts)]),
        response_attention_mask=(None if all(a is None for a in attn) else np.concatenate(
            [o.response_mask if a is None else a for o, a in zip(outputs, attn)])),
    )
