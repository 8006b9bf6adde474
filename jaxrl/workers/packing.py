"""Micro-batch layouts from slots (host side, numpy): padded rows, or packed rows without padding.

A micro-batch's *slots* ``[G, S]`` (:mod:`jaxrl.workers.seqlen`) name the batch rows each of ``G`` devices holds
(``-1``: empty). Two layouts turn them into the arrays one jitted call takes:

* **padded** (:func:`padded_micro`): every per-row array gathered as ``[G x S, ...]`` (empty slots all zero, so
  fully masked): the layout of ``use_remove_padding=False``.
* **packed** (:func:`packed_micro`, ``use_remove_padding=True``): each device's sequences laid end to end in one row
  of ``T`` tokens, padding only at the row's end. verl packs the same way (``unpad_input`` into one
  ``(1, total_nnz)`` row with ``cu_seqlens``); here a row carries ``segment_ids`` (1, 2, ... per sequence, 0 on
  padding), ``positions`` restarting at 0 per sequence and ``segment_cols`` (each sequence's columns, playing
  ``cu_seqlens``' part), and the decoder attends per segment (:class:`jaxrl.models.decoder.Decoder`,
  ``segment_ids=`` / ``segment_cols=``: :class:`~jaxrl.models.decoder.SegmentLayout`). The per-response arrays the
  losses read stay ``[G x S, R]`` (the same rows as the padded layout), and two index arrays connect them to the
  packed row:
  ``score_cols [G, K]``, the column of the token *before* each response token (where its logits / value are
  read), and ``slot_index [G, S x R]``, where response token ``j`` of slot ``s`` sits among the row's ``K``
  scoring columns. So the LM head runs on real response tokens only, and the loss code is the padded one.

A sequence's real tokens are one contiguous span of its padded row (prompts left-padded, responses right-padded):
``[P - prompt_len, P + response_len)``; its RoPE positions there are ``0 .. len - 1``, the same as the padded
layout's ``cumsum(mask) - 1``, so packed and padded computations see the same tokens, positions and attention sets.

**Shared prompts** (``share_prompts=True``, ``actor.use_prefix_grouper``): the ``n`` responses of a GRPO group repeat
one prompt, and in the layout above each row's linear layers run over that prompt ``n`` times. With sharing, a
device row lays each distinct prompt once; a later sequence with the same real prompt tokens lays only its response,
and its segment's columns are the shared prompt's columns followed by its own (its positions continue from the
prompt's length). The per-segment attention (:class:`jaxrl.models.decoder.SegmentLayout`) then computes every
response against the one prompt copy, so a group of ``n`` costs ``prompt + n x response`` tokens in every
projection instead of ``n x (prompt + response)``; the prompt's hidden states (and, in the backward pass, the sum of
every response's gradient into them) are computed once. verl's ``use_prefix_grouper`` (PrefixGrouper: prefix
self-attention + suffix attention over the concatenated prefix) does the same for its padded rows. Exact: every
response sees the same tokens, positions and attention set as in its own padded row.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxrl.workers.seqlen import bucket, bucket_below

__all__ = ["PACKED_KEYS", "at_scores", "micro_layout", "packed_micro", "padded_micro", "prompt_groups",
           "prompt_sharing", "real_lengths", "scatter_rows", "spans", "to_slots"]

# Per-row arrays of the padded layout that the packed layout replaces by its own.
_PADDED_ONLY = ("input_ids", "positions", "attention_mask")
PACKED_KEYS = ("input_ids", "positions", "segment_ids", "segment_cols", "score_cols", "score_ids", "slot_index")


def spans(attention_mask: np.ndarray, prompt_width: int) -> tuple[np.ndarray, np.ndarray]:
    """``(start, end)`` ``[N]`` of each row's real tokens in a ``[N, P + R]`` attention mask.

    Raises:
      ValueError: a row whose real tokens are not one contiguous span ending the prompt at ``P`` (the packed layout
        relies on left-padded prompts and right-padded responses).
    """
    mask = np.asarray(attention_mask) != 0
    p = int(prompt_width)
    prompt_len = mask[:, :p].sum(1)
    resp_len = mask[:, p:].sum(1)
    start, end = p - prompt_len, p + resp_len
    if np.any((prompt_len == 0) & (resp_len > 0)):
        bad = int(np.flatnonzero((prompt_len == 0) & (resp_len > 0))[0])
        raise ValueError(f"row {bad}: a response without a prompt token has no position to score its first token")
    cols = np.arange(mask.shape[1])[None, :]
    contiguous = ((cols >= start[:, None]) & (cols < end[:, None])) == mask
    if not contiguous.all():
        bad = int(np.flatnonzero(~contiguous.all(1))[0])
        raise ValueError(f"row {bad}: real tokens are not [left-padded prompt | right-padded response]; cannot pack")
    return start.astype(np.int64), end.astype(np.int64)


def real_lengths(attention_mask: np.ndarray) -> np.ndarray:
    """Real tokens (prompt + response) per row, ``[N]`` int64: the weights of the token budget."""
    return (np.asarray(attention_mask) != 0).sum(1).astype(np.int64)


def prompt_sharing(arrays: dict[str, np.ndarray], prompt_width: int, share: bool) -> dict[str, np.ndarray | None]:
    """The planner's shared-prompt arguments (:func:`jaxrl.workers.seqlen.plan_slots`' ``groups`` /
    ``prompt_lengths``) for the rows of ``arrays`` (``input_ids`` / ``attention_mask`` ``[N, P + R]``); both None
    when not ``share``."""
    if not share:
        return {"groups": None, "prompt_lengths": None}
    mask = np.asarray(arrays["attention_mask"])
    return {"groups": prompt_groups(arrays["input_ids"], mask, prompt_width),
            "prompt_lengths": (mask[:, : int(prompt_width)] != 0).sum(1).astype(np.int64)}


def prompt_groups(input_ids: np.ndarray, attention_mask: np.ndarray, prompt_width: int) -> np.ndarray:
    """Which rows repeat one prompt: ``[N]`` int64 ids, equal exactly where two rows' real prompt tokens are equal
    (``0 .. U - 1`` over the ``U`` distinct prompts). The shared-prompt layout and planner group rows by them; no
    metadata (``uid``) is trusted, so rows of different groups with the same prompt may share it too (exact all
    the same)."""
    p = int(prompt_width)
    ids = np.where(np.asarray(attention_mask)[:, :p] != 0, np.asarray(input_ids)[:, :p], -1)
    _, inverse = np.unique(ids, axis=0, return_inverse=True)
    return inverse.reshape(-1).astype(np.int64)


def padded_micro(arrays: dict[str, np.ndarray], slots: np.ndarray) -> dict[str, np.ndarray]:
    """The padded layout: every array's rows gathered by ``slots`` ``[G, S]`` into ``[G x S, ...]``, empty slots
    all zero (mask 0: they add nothing to any masked loss or metric)."""
    flat = slots.reshape(-1)
    valid = flat >= 0
    out = {}
    for k, v in arrays.items():
        a = v[np.where(valid, flat, 0)]
        a[~valid] = 0
        out[k] = a
    return out


def packed_micro(arrays: dict[str, np.ndarray], slots: np.ndarray, prompt_width: int, *,
                 max_row_tokens: int | None = None, share_prompts: bool = False) -> dict[str, np.ndarray]:
    """The packed layout of one micro-batch.

    Args:
      arrays: per-row arrays ``[N, ...]`` with ``input_ids`` / ``attention_mask`` ``[N, P + R]`` (the padded rows)
        and the ``[N, R]`` response arrays (``response_ids``, ``response_mask``, what the loss reads).
      slots: ``[G, S]`` batch rows per device (-1 = empty).
      prompt_width: ``P``.
      max_row_tokens: the token budget, if any: ``T`` is then bucketed down from it
        (:func:`~jaxrl.workers.seqlen.bucket_below`), else on the grid of :func:`~jaxrl.workers.seqlen.bucket`.
      share_prompts: lay each distinct prompt once per device row, its later sequences only their responses
        (see the module docstring); ``T`` then counts each shared prompt once.

    Returns:
      the response arrays as :func:`padded_micro` gives them (``[G x S, R]``), plus ``input_ids``, ``positions``,
      ``segment_ids`` ``[G, T]`` int32, ``segment_cols`` ``[G, S, P + R]`` int32 (the column of token ``p`` of the
      sequence in slot ``s``, ``T`` past its end: the decoder's per-segment attention), ``score_cols`` /
      ``score_ids`` ``[G, K]`` int32 (the column before each response token and that token's id; 0 on padding) and
      ``slot_index`` ``[G, S x R]`` int32 (index into the row's ``K`` scoring columns; 0 where the response mask is
      0). ``T`` is bucketed on the fine grid (the model's cost), ``K`` on powers of two (the LM head's), as ``S`` is
      by the planner. A shared prompt's tokens carry the segment id of the first sequence laid with it.
    """
    g, s = slots.shape
    ids, mask = arrays["input_ids"], arrays["attention_mask"]
    resp = {k: v for k, v in arrays.items() if k not in _PADDED_ONLY}
    out = padded_micro(resp, slots)
    p = int(prompt_width)
    r = ids.shape[1] - p
    start, end = spans(mask, prompt_width)
    # per device row: for each slot, the column where its prompt starts (None: laid with it) and the row's tokens
    layouts, row_tokens, row_scores = [], [], []
    for row in slots:
        laid: dict[bytes, int] = {}  # a shared prompt's tokens -> its first column in this row
        plan, col = [], 0
        for i in row:
            if i < 0:
                plan.append(None)
                continue
            key = ids[i, start[i] : p].tobytes() if share_prompts else None
            shared = laid.get(key)  # always None without sharing: nothing is laid under a key
            plan.append(shared)
            if share_prompts and shared is None:
                laid[key] = col
            col += int(end[i] - (p if shared is not None else start[i]))
        layouts.append(plan)
        row_tokens.append(col)
        row_scores.append(int(sum(end[i] - p for i in row if i >= 0)))
    if max_row_tokens is not None and max(row_tokens) <= max_row_tokens:
        t = bucket_below(max(row_tokens), int(max_row_tokens))  # anchored at the budget: most rows share it
    else:
        t = bucket(max(row_tokens))
    k = bucket(max(max(row_scores), 1), fine=False)
    input_ids = np.zeros((g, t), np.int32)
    positions = np.zeros((g, t), np.int32)
    segment_ids = np.zeros((g, t), np.int32)
    segment_cols = np.full((g, s, ids.shape[1]), t, np.int32)  # t: no token there
    score_cols = np.zeros((g, k), np.int32)
    score_ids = np.zeros((g, k), np.int32)
    slot_index = np.zeros((g, s, r), np.int32)
    for d in range(g):
        col = kcol = 0
        for j, (i, shared) in enumerate(zip(slots[d], layouts[d])):
            if i < 0:
                continue
            plen, nr = int(p - start[i]), int(end[i] - p)  # prompt / response tokens
            if shared is None:  # the whole sequence here
                laid, seq_cols = plen + nr, np.arange(col, col + plen + nr)
            else:  # the prompt at `shared`, the response here
                laid = nr
                seq_cols = np.concatenate([np.arange(shared, shared + plen), np.arange(col, col + nr)])
            input_ids[d, col : col + laid] = ids[i, end[i] - laid : end[i]]
            positions[d, col : col + laid] = np.arange(plen + nr - laid, plen + nr)
            segment_ids[d, col : col + laid] = j + 1
            segment_cols[d, j, : plen + nr] = seq_cols
            # response token q is scored at the column of the token before it (q = 0: the prompt's last token)
            score_cols[d, kcol : kcol + nr] = seq_cols[plen - 1 : plen - 1 + nr]
            score_ids[d, kcol : kcol + nr] = ids[i, p : p + nr]
            slot_index[d, j, :nr] = np.arange(kcol, kcol + nr)
            col += laid
            kcol += nr
    out.update(input_ids=input_ids, positions=positions, segment_ids=segment_ids, segment_cols=segment_cols,
               score_cols=score_cols, score_ids=score_ids, slot_index=slot_index.reshape(g, s * r))
    return out


# ------------------------------------------------------------------------------------------ in the jitted programs
def at_scores(x, score_cols):
    """Rows of a packed ``[G, T, ...]`` array at the scoring columns ``[G, K]`` -> ``[G, K, ...]`` (a per-row gather,
    so rows sharded over the batch axes stay on their device)."""
    idx = score_cols.reshape(score_cols.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


def to_slots(x, slot_index, response_mask):
    """Per-scoring-column values ``[G, K]`` -> the padded response layout ``[G x S, R]`` (``slot_index``
    ``[G, S x R]``; ``response_mask`` ``[G x S, R]``), 0 where the mask is 0."""
    g = x.shape[0]
    out = jnp.take_along_axis(x, slot_index, axis=1).reshape(g * (slot_index.shape[1] // response_mask.shape[1]),
                                                              response_mask.shape[1])
    return jnp.where(response_mask != 0, out, jnp.zeros((), out.dtype))


def micro_layout(arrays: dict[str, np.ndarray], slots: np.ndarray, prompt_width: int, *, packed: bool,
                 max_row_tokens: int | None = None, share_prompts: bool = False) -> dict[str, np.ndarray]:
    """:func:`packed_micro` when ``packed`` (``share_prompts``: its shared-prompt layout), else
    :func:`padded_micro` (the arrays one jitted call takes)."""
    if packed:
        return packed_micro(arrays, slots, prompt_width, max_row_tokens=max_row_tokens, share_prompts=share_prompts)
    return padded_micro(arrays, slots)


def scatter_rows(outputs: list[np.ndarray], slot_list: list[np.ndarray], num_rows: int) -> np.ndarray:
    """Per-slot outputs ``[G x S, ...]`` of each micro-batch back in batch row order ``[num_rows, ...]``.

    Raises:
      ValueError: a row is missing from the slots or appears twice.
    """
    first = outputs[0]
    out = np.zeros((num_rows,) + first.shape[1:], first.dtype)
    seen = np.zeros(num_rows, np.int64)
    for res, slots in zip(outputs, slot_list):
        flat = slots.reshape(-1)
        valid = flat >= 0
        out[flat[valid]] = res[valid]
        np.add.at(seen, flat[valid], 1)
    if not np.all(seen == 1):
        raise ValueError(f"micro-batch slots must cover each of the {num_rows} rows once")
    return out
