"""Batches of the offline trainers: shuffled, checkpointable batches of sequences (SFT) or sequence pairs (DPO),
laid out as :class:`jaxrl.batch.RLBatch` rows so the roles' forward passes read them as they read rollouts.

Layout of a sequence of ``T`` tokens in a split of width ``W`` (:func:`sequence_width`: the split's longest sequence
rounded up to a multiple of 32, at most ``data.max_length``): the first token is the one-token "prompt"
(``prompt_ids [B, 1]``), the other ``T - 1`` tokens are the "response" right-padded to ``W - 1``
(``response_ids``), with ``response_mask`` = the loss mask (the targets) and ``response_attention_mask`` = every real
token. The response's token ``j`` is scored by the logits after ``prompt + response[:j]``: exactly the causal-LM
shift, so a role computes the log-probability of every target token in one forward over ``W`` columns, and every
batch of a split has one shape (one compiled program).

The order of the training batches is :class:`jaxrl.data.order.EpochOrder` (verl's seeded sampler with
``drop_last``); the state is ``(epoch, step_in_epoch)``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import numpy as np

from jaxrl.batch import PairBatch, RLBatch
from jaxrl.data.examples import SequenceExample
from jaxrl.data.order import EpochOrder

__all__ = ["ExampleBatches", "collate", "collate_pairs", "iter_batches", "sequence_width"]

WIDTH_MULTIPLE = 32


def sequence_width(lengths: Sequence[int], max_length: int, multiple: int = WIDTH_MULTIPLE) -> int:
    """The padded width of a split: its longest sequence rounded up to ``multiple``, at most ``max_length`` (and at
    least 2: one prompt token and one response column)."""
    longest = max(int(n) for n in lengths)
    return max(2, min(int(max_length), -(-longest // multiple) * multiple))


def collate(examples: Sequence[SequenceExample], width: int, pad_id: int = 0) -> RLBatch:
    """``examples`` as one :class:`RLBatch` of width ``width`` (the module docstring's layout).

    Raises:
      ValueError: an example longer than ``width``, or an empty one.
    """
    b, r = len(examples), width - 1
    response_ids = np.full((b, r), pad_id, np.int32)
    response_mask = np.zeros((b, r), np.int32)
    attention = np.zeros((b, r), np.int32)
    first = np.zeros((b, 1), np.int32)
    for i, ex in enumerate(examples):
        n = len(ex)
        if not 1 <= n <= width:
            raise ValueError(f"example {i} has {n} tokens; expected 1..{width}")
        first[i, 0] = ex.ids[0]
        response_ids[i, : n - 1] = ex.ids[1:]
        response_mask[i, : n - 1] = ex.loss_mask[1:]
        attention[i, : n - 1] = 1
    return RLBatch(prompt_ids=first, prompt_mask=np.ones((b, 1), np.int32), response_ids=response_ids,
                   response_mask=response_mask, group_ids=np.arange(b, dtype=np.int32),
                   response_attention_mask=attention)


def collate_pairs(pairs: Sequence[tuple[SequenceExample, SequenceExample]], width: int, pad_id: int = 0) -> PairBatch:
    """``(chosen, rejected)`` pairs as a :class:`PairBatch` of width ``width``."""
    return PairBatch(collate([p[0] for p in pairs], width, pad_id), collate([p[1] for p in pairs], width, pad_id))


def _digest(items) -> str:
    h = hashlib.sha256()
    for item in items:
        for ex in (item if isinstance(item, tuple) else (item,)):
            h.update(len(ex).to_bytes(4, "little"))
            h.update(np.asarray(ex.ids, np.int64).tobytes())
            h.update(np.asarray(ex.loss_mask, np.int8).tobytes())
    return h.hexdigest()


class ExampleBatches:
    """Training batches over a split's sequences (SFT) or pairs (DPO), epoch after epoch.

    Args:
      items: :class:`SequenceExample` s, or ``(chosen, rejected)`` tuples of them.
      batch_size: items per batch (``data.train_batch_size``).
      width: the padded width of every batch (:func:`sequence_width`).
      shuffle, seed: a seeded permutation per epoch (``data.shuffle``, ``data.seed``).
      pad_id: the id of padding positions (masked everywhere).

    Attributes:
      steps_per_epoch: ``len(items) // batch_size`` (the last partial batch of an epoch is dropped, as verl's
        sampler does).
      num_rows: ``len(items)``.

    Raises:
      ValueError: fewer items than ``batch_size``, or a bad seed.
    """

    def __init__(self, items: Sequence, *, batch_size: int, width: int, shuffle: bool, seed: int, pad_id: int = 0):
        self.items = list(items)
        self.width = int(width)
        self.pad_id = int(pad_id)
        self.pairs = bool(self.items) and isinstance(self.items[0], tuple)
        self._order = EpochOrder(len(self.items), batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=True)
        self.steps_per_epoch = self._order.steps_per_epoch
        self.num_rows = len(self.items)

    @property
    def epoch(self) -> int:
        return self._order.epoch

    def _collate(self, items):
        return (collate_pairs if self.pairs else collate)(items, self.width, self.pad_id)

    def next_batch(self):
        """The next :class:`RLBatch` (sequences) or :class:`PairBatch` (pairs) of ``batch_size`` items."""
        return self._collate([self.items[p] for p in self._order.next_positions()])

    def get_state(self) -> dict:
        return self._order.get_state()

    def set_state(self, state) -> None:
        """Resume from :meth:`get_state` (raises ValueError for a state of other settings)."""
        self._order.set_state(state)

    def prompts_digest(self) -> str:
        """SHA-256 of the items' token ids and loss masks in dataset order (the checkpoint fingerprint's)."""
        return _digest(self.items)


def iter_batches(items: Sequence, batch_size: int, width: int, pad_id: int = 0) -> Iterator:
    """One ordered pass over ``items`` in batches of ``batch_size`` (the last one may be smaller), for validation."""
    pairs = bool(items) and isinstance(items[0], tuple)
    for k in range(0, len(items), batch_size):
        chunk = list(items[k : k + batch_size])
        yield collate_pairs(chunk, width, pad_id) if pairs else collate(chunk, width, pad_id)
