"""Prompt pipeline: tokenise verl-format rows, filter/truncate overlong prompts, and serve shuffled,
checkpointable batches in the order of :class:`jaxrl.data.order.EpochOrder` (a `grain
<https://github.com/google/grain>`_ ``MapDataset`` permutation per epoch over the kept rows; the iterator state is
``(epoch, step_in_epoch)`` and resuming reproduces an uninterrupted run exactly).

Note: ``grain`` imports ``jax`` on import; this module is therefore only imported on use (``import
jaxrl.data`` exposes it lazily) so that ``jaxrl.data.sources`` / ``jaxrl.data.prepare`` stay jax-free.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxrl.data.order import EpochOrder
from jaxrl.data.sources import SPLIT_KEYS, DataFileError

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right")
_TEMPLATE_CHUNK = 512


@dataclass
class PromptBatch:
    """One batch of prompts.

    Attributes:
        prompt_ids: ``B`` token-id lists (unpadded, variable length, each ``<= max_prompt_length``).
        rows: the ``B`` raw rows (shallow copies: ``data_source``, ``reward_model.ground_truth``,
            ``extra_info``, ...), aligned with ``prompt_ids``.
        indices: ``B`` dataset indices: each row's position in the ``rows`` list the pipeline was built
            from (before filtering).
        epoch: the epoch this batch belongs to (0-based; 0 for :meth:`PromptPipeline.iter_batches_once`).
    """

    prompt_ids: list[list[int]]
    rows: list[dict]
    indices: list[int]
    epoch: int = 0

    def __len__(self) -> int:
        return len(self.prompt_ids)


def _as_id_lists(out: Any) -> list:
    """Normalise ``apply_chat_template`` / ``__call__`` output (list, BatchEncoding, dict) to id lists."""
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    return [list(map(int, ids)) for ids in out]


def _has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def tokenize_prompts(
    prompts: list, tokenizer: Any, *, apply_chat_template: bool | None = None
) -> list[list[int]]:
    """Token ids of each prompt, the way verl's ``RLHFDataset`` builds them.

    * A list of chat messages with the chat template applied:
      ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``
      (transformers 5 returns a ``BatchEncoding``; its ``input_ids`` are taken).
    * A plain string: ``tokenizer(text, add_special_tokens=True).input_ids`` (the tokenizer adds BOS
      if it is configured to).
    * A list of messages *without* the template (``apply_chat_template=False``, or ``None`` and the
      tokenizer has no chat template): the message contents joined with ``"\\n"``, encoded like a
      plain string. Roles are dropped.

    Args:
        prompts: ``N`` prompts, each a string or a list of ``{"role", "content"}`` dicts.
        tokenizer: a Hugging Face tokenizer (``__call__`` and, for templates, ``apply_chat_template``).
        apply_chat_template: True -> always apply the template (a string prompt becomes one user
            message); False -> never; None -> apply to message lists when the tokenizer has one.

    Returns:
        ``N`` lists of int token ids.

    Raises:
        ValueError: ``apply_chat_template=True`` but the tokenizer has no chat template.
    """
    has_template = _has_chat_template(tokenizer)
    if apply_chat_template and not has_template:
        raise ValueError(
            f"apply_chat_template=True but tokenizer {type(tokenizer).__name__} has no chat_template; "
            "use apply_chat_template=None/False (contents are then joined with newlines)"
        )
    chat_pos, chat_convs, text_pos, texts = [], [], [], []
    joined = 0
    for i, p in enumerate(prompts):
        is_messages = not isinstance(p, str)
        if apply_chat_template or (apply_chat_template is None and is_messages and has_template):
            chat_pos.append(i)
            chat_convs.append([{"role": "user", "content": p}] if isinstance(p, str) else list(p))
        else:
            text_pos.append(i)
            if is_messages:
                joined += 1
                texts.append("\n".join(m["content"] for m in p))
            else:
                texts.append(p)
    if joined:
        logger.info(
            "%d chat prompts encoded without a chat template (contents joined with newlines)", joined
        )
    out: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(chat_convs), _TEMPLATE_CHUNK):
        chunk = chat_convs[start : start + _TEMPLATE_CHUNK]
        ids = tokenizer.apply_chat_template(chunk, add_generation_prompt=True, tokenize=True)
        for pos, seq in zip(chat_pos[start : start + _TEMPLATE_CHUNK], _as_id_lists(ids), strict=True):
            out[pos] = seq
    if texts:
        ids = tokenizer(texts, add_special_tokens=True)
        for pos, seq in zip(text_pos, _as_id_lists(ids), strict=True):
            out[pos] = seq
    return out


@dataclass
class _Kept:
    """The rows that survived filtering, with their token ids (internal)."""

    indices: list[int] = field(default_factory=list)
    ids: list[list[int]] = field(default_factory=list)


class PromptPipeline:
    """Infinite, shuffled, checkpointable batches of tokenised prompts (verl ``RLHFDataset`` + sampler).

    Args:
        rows: verl-format rows (see :mod:`jaxrl.data.sources`); each must hold ``prompt_key``.
        tokenizer: Hugging Face tokenizer; see :func:`tokenize_prompts` for how prompts are encoded.
        batch_size: prompts per batch (``data.train_batch_size``), >= 1.
        max_prompt_length: token limit per prompt (``data.max_prompt_length``), >= 1.
        prompt_key: the row key holding the prompt (``data.prompt_key``).
        filter_overlong_prompts: drop prompts longer than ``max_prompt_length`` at construction
            (counted in :attr:`num_filtered`, logged). If False, ``truncation`` applies.
        truncation: for overlong prompts when not filtering: ``"error"`` raises, ``"left"`` keeps the
            last ``max_prompt_length`` tokens, ``"right"`` keeps the first ``max_prompt_length``.
        shuffle: a seeded permutation per epoch (different each epoch); False -> dataset order.
        seed: shuffle seed, an int in ``[0, 2**32)``.
        drop_last: drop each epoch's final partial batch (so every batch has ``batch_size`` rows).
        apply_chat_template: see :func:`tokenize_prompts` (None = auto).
        origins: optional ``"file:line"`` per row (:attr:`jaxrl.data.sources.LoadedRows.origins`), so length
            errors name the file and row.
        split: ``"train"`` or ``"val"`` when the rows are a run's split (messages name ``data.<split>_files``).

    Attributes:
        num_rows: rows kept after filtering (``N``).
        num_filtered: rows dropped as overlong.
        steps_per_epoch: batches per epoch: ``N // batch_size`` with ``drop_last`` else
            ``ceil(N / batch_size)``.
        epoch: epoch of the most recently returned batch (0 before the first).

    Raises:
        ValueError: empty ``rows``; a row without ``prompt_key``; bad ``batch_size`` /
            ``max_prompt_length`` / ``seed``; ``truncation`` not in ``("error", "left", "right")``.
        DataFileError (a ValueError): an overlong prompt with ``truncation="error"`` (names its file and
            row when ``origins`` are given, its dataset index, length, the limit and the three ways out); no
            rows left after filtering (how many were dropped, the longest length, the limit); fewer rows than
            ``batch_size`` with ``drop_last``.
    """

    def __init__(
        self,
        rows: list[dict],
        tokenizer: Any,
        *,
        batch_size: int,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        filter_overlong_prompts: bool = True,
        truncation: str = "error",
        shuffle: bool = True,
        seed: int = 1,
        drop_last: bool = True,
        apply_chat_template: bool | None = None,
        origins: list[str] | None = None,
        split: str | None = None,
    ):
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation={truncation!r} is not valid; use one of {TRUNCATION_MODES}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if not isinstance(max_prompt_length, int) or max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be an int >= 1, got {max_prompt_length!r}")
        if not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
        if not rows:
            raise ValueError("rows is empty; the prompt dataset needs at least one row")
        if origins is not None and len(origins) != len(rows):
            raise ValueError(f"origins has {len(origins)} entries for {len(rows)} rows; expected one per row")
        for i, r in enumerate(rows):
            if not isinstance(r, Mapping) or prompt_key not in r:
                keys = sorted(r) if isinstance(r, Mapping) else type(r).__name__
                raise ValueError(f"row {i} has no prompt_key={prompt_key!r} (has {keys})")

        self._rows = rows
        self._origins = origins
        self._where = f"{SPLIT_KEYS[split]} " if split in SPLIT_KEYS else ""
        self.batch_size = batch_size
        self.max_prompt_length = max_prompt_length
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last

        all_ids = tokenize_prompts(
            [r[prompt_key] for r in rows], tokenizer, apply_chat_template=apply_chat_template
        )
        self._kept = self._limit_lengths(all_ids, filter_overlong_prompts, truncation)
        self._pos_of: dict[int, int] | None = None  # dataset row index -> kept position (batch_of, built on first use)
        self.num_rows = len(self._kept.indices)
        self.num_filtered = len(rows) - self.num_rows
        if self.num_filtered:
            logger.info(
                "filtered %d of %d prompts longer than max_prompt_length=%d tokens",
                self.num_filtered,
                len(rows),
                max_prompt_length,
            )
        if self.num_rows == 0:
            longest = max(len(ids) for ids in all_ids)
            raise DataFileError(
                f"no prompts left in {self._rows_from()}: all {len(rows)} are longer than "
                f"max_prompt_length={max_prompt_length} tokens and were filtered (data.filter_overlong_prompts="
                f"true; the longest has {longest} tokens); raise data.max_prompt_length (to {longest} keeps them "
                "all) or set data.filter_overlong_prompts=false with data.truncation=left|right"
            )
        if drop_last and self.num_rows < batch_size:
            raise DataFileError(
                f"only {self.num_rows} prompts in {self._rows_from()} for batch_size={batch_size} "
                f"(data.train_batch_size, or data.gen_batch_size with DAPO) and drop_last=True "
                f"({self.num_filtered} filtered as overlong): an epoch "
                "would have no batch; lower data.train_batch_size or give more prompts"
            )
        self._order = EpochOrder(self.num_rows, batch_size=batch_size, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
        self.steps_per_epoch = self._order.steps_per_epoch

    def _limit_lengths(self, all_ids: list[list[int]], filt: bool, truncation: str) -> _Kept:
        kept, limit = _Kept(), self.max_prompt_length
        for i, ids in enumerate(all_ids):
            if len(ids) > limit:
                if filt:
                    continue
                if truncation == "error":
                    where = " ".join(x for x in (self._where.strip(), self._origins[i] if self._origins else "") if x)
                    where = f"{where}: " if where else ""
                    raise DataFileError(
                        f"{where}prompt at dataset index {i} has {len(ids)} tokens > max_prompt_length="
                        f"{limit} and data.truncation='error'; set data.filter_overlong_prompts=true (drop such "
                        f"prompts), data.truncation=left|right (cut them), or data.max_prompt_length>={len(ids)}"
                    )
                ids = ids[-limit:] if truncation == "left" else ids[:limit]
            kept.indices.append(i)
            kept.ids.append(ids)
        return kept

    def _rows_from(self) -> str:
        """Where the rows came from, for messages: ``data.train_files (a.jsonl, b.jsonl)`` / the files / ``the
        dataset``."""
        files = ", ".join(dict.fromkeys(o.rsplit(":", 1)[0] for o in self._origins)) if self._origins else ""
        if self._where and files:
            return f"{self._where}({files})"
        return files or self._where.strip() or "the dataset"

    # ----- batches ---------------------------------------------------------------------------
    def _element(self, pos: int) -> tuple[int, list[int], dict]:
        i = self._kept.indices[pos]
        return i, self._kept.ids[pos], dict(self._rows[i])

    @staticmethod
    def _collate(elements, epoch: int = 0) -> PromptBatch:
        return PromptBatch(
            prompt_ids=[list(e[1]) for e in elements],
            rows=[e[2] for e in elements],
            indices=[e[0] for e in elements],
            epoch=epoch,
        )

    # ----- training iteration ---------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """Epoch of the most recently returned batch (0 before the first)."""
        return self._order.epoch

    def next_batch(self) -> PromptBatch:
        """The next batch; rolls over to the next (reshuffled) epoch after ``steps_per_epoch`` batches.

        Returns:
            :class:`PromptBatch` with ``batch_size`` prompts (fewer only for the last batch of an
            epoch when ``drop_last=False``).
        """
        positions = self._order.next_positions()
        return self._collate([self._element(p) for p in positions], self._order.epoch)

    def batch_of(self, indices: Sequence[int], epoch: int) -> PromptBatch:
        """The batch of the dataset rows ``indices`` (a :attr:`PromptBatch.indices` saved earlier) again, without
        moving the iterator; ``epoch`` is what its ``epoch`` says.

        Raises:
            ValueError: an index that is not a kept row.
        """
        if self._pos_of is None:
            self._pos_of = {i: pos for pos, i in enumerate(self._kept.indices)}
        missing = [i for i in indices if i not in self._pos_of]
        if missing:
            raise ValueError(f"dataset rows {missing[:5]} are not among the {self.num_rows} kept prompts")
        return self._collate([self._element(self._pos_of[i]) for i in indices], epoch)

    def __iter__(self) -> Iterator[PromptBatch]:
        """Infinite iterator over :meth:`next_batch`."""
        while True:
            yield self.next_batch()

    @property
    def global_step(self) -> int:
        """Batches returned so far over all epochs."""
        return self._order.global_step

    def get_state(self) -> dict:
        """JSON-serialisable iterator state (position plus a fingerprint of the pipeline settings)."""
        return self._order.get_state()

    def prompts_digest(self) -> str:
        """SHA-256 (hex) of the kept prompts' token ids in dataset order.

        Two pipelines with the same digest, ``seed``, ``shuffle`` and ``batch_size`` serve the same batches from
        the same :meth:`get_state`; the digest changes with the data files' content, ``max_prompt_length``
        filtering/truncation and the tokenizer (used by the checkpoint fingerprint, :mod:`jaxrl.fingerprint`).
        """
        h = hashlib.sha256()
        for ids in self._kept.ids:
            h.update(len(ids).to_bytes(4, "little"))
            h.update(np.asarray(ids, dtype=np.int64).tobytes())
        return h.hexdigest()

    def set_state(self, state: Mapping) -> None:
        """Resume from :meth:`get_state`: the next batch equals the one an uninterrupted run would give.

        Raises:
            ValueError: the state is malformed, or it was saved by a pipeline with different
                ``seed`` / ``shuffle`` / ``num_rows`` / ``batch_size`` / ``drop_last`` (the names and
                both values are given).
        """
        self._order.set_state(state)

    # ----- validation -----------------------------------------------------------------------
    def iter_batches_once(self, batch_size: int | None = None) -> Iterator[PromptBatch]:
        """One ordered pass over all kept rows (no shuffle, last partial batch kept), for validation.

        Does not touch the training position.

        Args:
            batch_size: rows per batch; default the pipeline's ``batch_size``.

        Raises:
            ValueError: ``batch_size`` < 1.
        """
        bs = self.batch_size if batch_size is None else batch_size
        if not isinstance(bs, int) or bs < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {bs!r}")
        n = self.num_rows
        return (self._collate([self._element(p) for p in range(k, min(k + bs, n))]) for k in range(0, n, bs))
