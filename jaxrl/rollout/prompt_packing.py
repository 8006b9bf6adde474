"""Prompts packed into one row for the embedded sampler's prefill (host side, numpy).

The sampler's KV cache keeps each prompt left-padded to the chunk's prompt width ``P`` (the decode loop reads it so).
Prefilling that padded ``[U, P]`` batch computes ``U x P`` positions however short the prompts are; laying the
prompts end to end in one row runs the projections on their real tokens only, and each token's keys/values are
scattered to its cache row and slot (:meth:`jaxrl.models.decoder.Decoder.prefill_packed`; its attention runs per
prompt, gathered into the padded layout, :class:`~jaxrl.models.decoder.SegmentLayout`, never across the row). vLLM's
prefill likewise runs the real tokens of all prompts as one flattened batch (verl's ``use_remove_padding`` packs the
training forward the same way, and so does jaxrl's).

The row's length is rounded up (:func:`packed_length`) so that few programs compile.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["PackedPrompts", "pack_prompts"]

BLOCK = 64  # the packed row's length is a multiple of this


class PackedPrompts(NamedTuple):
    """Prefill inputs of prompts packed end to end into one row of ``N`` tokens (int32 ``[1, N]``, but
    ``segment_cols``).

    Attributes:
      input_ids: token ids (the pad id on padding).
      positions: RoPE position of each token in its prompt (0, 1, ...; 0 on padding).
      segment_cols: int32 ``[1, U, P - 1]``: the column of token ``j`` of prompt ``u``, ``N`` where it has none (the
        decoder's per-prompt attention gathers by it).
      rows: the prompt (cache row) each token belongs to (0 on padding).
      slots: the cache slot of each token, its column in the left-padded ``[U, P]`` layout; ``cache_len`` (out of
        range, so the scatter drops it) on padding.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    segment_cols: np.ndarray
    rows: np.ndarray
    slots: np.ndarray


def packed_length(n: int) -> int:
    """The packed row's length for ``n`` real tokens: a multiple of :data:`BLOCK` and, past ``8 x BLOCK``, on a grid
    of 8 sizes per doubling, so it wastes less than 1/8 of the row there and a run compiles few lengths."""
    n = max(int(n), 1)
    step = max(BLOCK, 1 << max(0, (n - 1).bit_length() - 4))
    return -(-n // step) * step


def pack_prompts(input_ids: np.ndarray, prompt_mask: np.ndarray, *, cache_len: int, pad_token_id: int) -> PackedPrompts:
    """Lay every prompt token but each prompt's last (the decode loop feeds that one) end to end in one row.

    Args:
      input_ids: int ``[U, P]`` left-padded prompts.
      prompt_mask: int ``[U, P]``, 1 on a prompt's tokens (a suffix of its row).
      cache_len: slots per cache row (``P + R - 1``); padding tokens get this slot, which the scatter drops.
      pad_token_id: id written on padding.

    Returns:
      :class:`PackedPrompts` ``[1, N]``, ``N = packed_length(sum of (length - 1))``: the prompts in order, token ``j``
      of prompt ``u`` (length ``L``, ``j < L - 1``) in exactly one cell with ``rows = u``, ``slots = P - L + j``,
      ``positions = j``; padding at the end; ``segment_cols`` ``[1, U, P - 1]``.

    Raises:
      ValueError: shapes differ, or a prompt mask is not a suffix of its row (prompts must be left-padded).
    """
    ids = np.asarray(input_ids)
    mask = np.asarray(prompt_mask) != 0
    if ids.ndim != 2 or mask.shape != ids.shape:
        raise ValueError(f"pack_prompts: input_ids {ids.shape} and prompt_mask {mask.shape} must both be [U, P]")
    u, p = ids.shape
    lengths = mask.sum(1)
    suffix = np.arange(p)[None, :] >= (p - lengths)[:, None]
    if not np.array_equal(mask, suffix):
        bad = int(np.flatnonzero((mask != suffix).any(1))[0])
        raise ValueError(f"pack_prompts: prompt {bad} is not left-padded (its mask is not a suffix of the row)")
    # the prefilled cells of the [U, P] layout, row by row: columns [P - L, P - 1) of each prompt
    take = suffix.copy()
    take[:, p - 1] = False
    n = int(take.sum())
    width = packed_length(n)
    rows_u, cols_u = np.nonzero(take)
    out = {name: np.full((1, width), fill, np.int32) for name, fill in
           (("input_ids", pad_token_id), ("positions", 0), ("rows", 0), ("slots", cache_len))}
    out["input_ids"][0, :n] = ids[rows_u, cols_u]
    positions = cols_u - (p - lengths[rows_u])
    out["positions"][0, :n] = positions
    out["rows"][0, :n] = rows_u
    out["slots"][0, :n] = cols_u
    segment_cols = np.full((1, u, max(p - 1, 1)), width, np.int32)
    segment_cols[0, rows_u, positions] = np.arange(n)  # token j of prompt u: its packed column
    return PackedPrompts(**out, segment_cols=segment_cols)
