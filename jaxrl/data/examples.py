"""Training sequences of the offline trainers: token ids with a loss mask, built from text or chat messages.

A :class:`SequenceExample` is one sequence (prompt and response, or a whole conversation) with a mask of the tokens
the model is trained to predict. The helpers here render chat messages with the tokenizer's chat template and find
which tokens a turn added (the template must render conversations prefix-consistently: the tokens of the first
``k`` messages are a prefix of the tokens of the first ``k + 1``), and cut sequences to ``data.max_length``.
Used by :mod:`jaxrl.data.sft` and :mod:`jaxrl.data.preference`. No jax import.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxrl.data.sources import SPLIT_KEYS, DataFileError

log = logging.getLogger(__name__)

__all__ = ["SequenceExample", "check_messages", "conversation_example", "encode_text", "eos_id", "fit_length",
           "has_chat_template", "kept_after_filter", "prompt_completion", "render_chat"]


@dataclass(frozen=True)
class SequenceExample:
    """One training sequence.

    Attributes:
      ids: ``[T]`` int32 token ids.
      loss_mask: ``[T]`` int8, 1 where the token is a training target (its log-probability given the tokens before
        it is in the loss), 0 on prompt / user / template tokens. ``loss_mask[0]`` is always 0 (nothing predicts the
        first token).
    """

    ids: np.ndarray
    loss_mask: np.ndarray

    def __post_init__(self):
        if self.ids.shape != self.loss_mask.shape or self.ids.ndim != 1:
            raise ValueError(f"ids {self.ids.shape} and loss_mask {self.loss_mask.shape} must be [T] of one length")

    @classmethod
    def of(cls, prompt: list[int], completion: list[int]) -> "SequenceExample":
        """``prompt + completion`` with the loss on the completion's tokens."""
        ids = np.asarray(list(prompt) + list(completion), np.int32)
        mask = np.concatenate([np.zeros(len(prompt), np.int8), np.ones(len(completion), np.int8)])
        mask[:1] = 0
        return cls(ids, mask)

    @property
    def num_targets(self) -> int:
        return int(self.loss_mask.sum())

    def __len__(self) -> int:
        return int(self.ids.shape[0])


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _ids(out: Any) -> list[int]:
    """Token ids of one sequence from a tokenizer call / ``apply_chat_template`` (a list or a BatchEncoding)."""
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    return [int(i) for i in out]


def render_chat(tokenizer: Any, messages: list[dict], *, add_generation_prompt: bool) -> list[int]:
    """The token ids of ``messages`` through the tokenizer's chat template."""
    return _ids(tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                              tokenize=True))


def encode_text(tokenizer: Any, text: str, *, add_special_tokens: bool) -> list[int]:
    """The token ids of plain ``text`` (``add_special_tokens``: the tokenizer's BOS, if it adds one)."""
    return _ids(tokenizer(text, add_special_tokens=add_special_tokens))


def eos_id(tokenizer: Any) -> int:
    """The tokenizer's end-of-sequence id (appended to a text response so the model learns to stop).

    Raises:
      ValueError: the tokenizer has none.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no eos_token_id; a response needs an end token "
                         "(set model.tokenizer_path to a tokenizer with one)")
    return int(eos)


def check_messages(value: Any, name: str, *, need_assistant: bool = False) -> str | None:
    """Why ``value`` is not a list of ``{"role": str, "content": str}`` chat messages (or holds no assistant turn
    when ``need_assistant``), or None."""
    if not isinstance(value, (list, tuple)) or not value:
        return f"{name!r} is {'an empty list' if isinstance(value, (list, tuple)) else type(value).__name__}; " \
               "expected a non-empty list of chat messages"
    for j, m in enumerate(value):
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return f"{name!r}[{j}] is not a {{'role': str, 'content': str}} message: {m!r:.80}"
    if need_assistant and not any(m["role"] == "assistant" for m in value):
        return f"{name!r} has no assistant message to train on (roles: {[m['role'] for m in value]})"
    return None


def _plain(messages: list[dict]) -> list[dict]:
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _check_prefix(prefix: list[int], full: list[int], where: str) -> None:
    if full[: len(prefix)] != prefix:
        raise DataFileError(
            f"{where}: the chat template does not render this conversation prefix-consistently (the tokens of its "
            "first turns change when a turn is added), so the trained turns cannot be located; use a template that "
            "appends each turn (data.chat_template), or give the row as prompt / response text")


def prompt_completion(tokenizer: Any, prompt: list[dict], completion: list[dict], where: str) -> SequenceExample:
    """``prompt`` rendered with the generation prompt, then the tokens ``completion`` (assistant message(s)) adds,
    the loss on the latter (TRL's conversational prompt-completion rows).

    Raises:
      DataFileError: the template is not prefix-consistent for these messages.
    """
    head = render_chat(tokenizer, _plain(prompt), add_generation_prompt=True)
    full = render_chat(tokenizer, _plain(prompt) + _plain(completion), add_generation_prompt=False)
    _check_prefix(head, full, where)
    return SequenceExample.of(head, full[len(head):])


def conversation_example(tokenizer: Any, messages: list[dict], where: str) -> SequenceExample:
    """A whole conversation with the loss on every assistant turn (the tokens the turn adds after the
    generation prompt, its end-of-turn tokens included: verl's ``MultiTurnSFTDataset``).

    Raises:
      DataFileError: the template is not prefix-consistent for these messages.
    """
    messages = _plain(messages)
    full = render_chat(tokenizer, messages, add_generation_prompt=False)
    mask = np.zeros(len(full), np.int8)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = render_chat(tokenizer, messages[:i], add_generation_prompt=True) if i else []
        upto = render_chat(tokenizer, messages[: i + 1], add_generation_prompt=False)
        _check_prefix(head, upto, where)
        _check_prefix(upto, full, where)
        mask[len(head): len(upto)] = 1
    mask[:1] = 0
    return SequenceExample(np.asarray(full, np.int32), mask)


def fit_length(example: SequenceExample, max_length: int, truncation: str, where: str) -> SequenceExample:
    """``example`` cut to ``max_length`` tokens: ``"left"`` keeps the last ones, ``"right"`` the first ones.

    Raises:
      DataFileError: it is longer and ``truncation="error"`` (names the length, the limit and the ways out).
    """
    n = len(example)
    if n <= max_length:
        return example
    if truncation == "error":
        raise DataFileError(
            f"{where}: a sequence of {n} tokens > data.max_length={max_length} and data.truncation='error'; raise "
            f"data.max_length (>= {n}) or set data.truncation=left|right (keep the end / the start)")
    keep = slice(n - max_length, n) if truncation == "left" else slice(0, max_length)
    mask = example.loss_mask[keep].copy()
    mask[:1] = 0
    return SequenceExample(example.ids[keep], mask)


def kept_after_filter(kept: list, dropped: int, total: int, max_length: int, split: str) -> list:
    """``kept`` after ``data.filter_overlong`` dropped ``dropped`` of ``total`` rows (logged).

    Raises:
      DataFileError: every row was dropped (names the split, the count and the limit).
    """
    if dropped:
        log.info("%s: left out %d of %d rows longer than data.max_length=%d tokens (data.filter_overlong=true)",
                 SPLIT_KEYS[split], dropped, total, max_length)
    if not kept:
        raise DataFileError(f"{SPLIT_KEYS[split]}: all {total} rows are longer than data.max_length={max_length} "
                            "tokens and data.filter_overlong=true left none; raise data.max_length")
    return kept
