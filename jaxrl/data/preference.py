"""Preference rows -> (chosen, rejected) training sequences, in TRL's dataset formats (its column names
``prompt`` / ``chosen`` / ``rejected``, set by ``data.prompt_key`` / ``chosen_key`` / ``rejected_key``):

- *standard*: prompt, chosen and rejected are text; the prompt is encoded as plain text (with the tokenizer's BOS),
  each response without special tokens plus EOS;
- *conversational*: the prompt is a list of chat messages and chosen / rejected are the assistant message(s) that
  follow it (a string is taken as one assistant message); rendered with the chat template, the prompt with the
  generation prompt (:func:`jaxrl.data.examples.prompt_completion`);
- *implicit prompt* (no prompt column): chosen and rejected are whole conversations; their common leading
  messages are the prompt (TRL's ``extract_prompt``), the rest the responses.

The loss of each sequence is on its response's tokens. No jax import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxrl.data.examples import (SequenceExample, check_messages, encode_text, eos_id, fit_length,
                                 has_chat_template, kept_after_filter, prompt_completion)
from jaxrl.data.sources import SPLIT_KEYS, DataFileError, LoadedRows

__all__ = ["build_preference_examples", "preference_example", "preference_row_check", "split_prompt"]


def split_prompt(chosen: list[dict], rejected: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """``(prompt, chosen response, rejected response)`` of two conversations: the prompt is their longest common
    run of leading messages that ends before an assistant turn of either."""
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    while k > 0 and (chosen[k - 1]["role"] == "assistant"):
        k -= 1  # the responses start at an assistant turn
    return list(chosen[:k]), list(chosen[k:]), list(rejected[k:])


def _as_turns(value: Any) -> list[dict]:
    return [{"role": "assistant", "content": value}] if isinstance(value, str) else list(value)


def preference_row_check(d) -> Callable[[dict], str | None]:
    """The row check of a DPO data section: ``row -> why it is malformed, or None``."""

    def check(row: dict) -> str | None:
        for key in (d.chosen_key, d.rejected_key):
            if key not in row or row[key] is None:
                return f"missing {key!r} (keys: {sorted(row)})"
        prompt = row.get(d.prompt_key)
        chosen, rejected = row[d.chosen_key], row[d.rejected_key]
        if prompt is None:
            for key, value in ((d.chosen_key, chosen), (d.rejected_key, rejected)):
                why = check_messages(value, key)
                if why is not None:
                    return (f"no {d.prompt_key!r} column, so {key!r} must be a whole conversation (TRL's implicit "
                            f"prompt); {why}")
            prompt_turns, c, r = split_prompt(chosen, rejected)
            if not prompt_turns or not c or not r:
                return (f"{d.chosen_key!r} and {d.rejected_key!r} share no leading messages to take as the prompt "
                        "(or one has no response after them)")
            return None
        if isinstance(prompt, str):
            if not prompt:
                return f"{d.prompt_key!r} is an empty string"
            for key, value in ((d.chosen_key, chosen), (d.rejected_key, rejected)):
                if not (isinstance(value, str) and value):
                    return f"{key!r} must be a non-empty string like the text prompt, got {type(value).__name__}"
            return None
        why = check_messages(prompt, d.prompt_key)
        if why is not None:
            return why
        for key, value in ((d.chosen_key, chosen), (d.rejected_key, rejected)):
            if isinstance(value, str):
                if not value:
                    return f"{key!r} is an empty string"
                continue
            why = check_messages(value, key)
            if why is not None:
                return why
        return None

    return check


def preference_example(row: dict, tokenizer: Any, d, where: str) -> tuple[SequenceExample, SequenceExample]:
    """One row (checked by :func:`preference_row_check`) as ``(chosen, rejected)`` sequences, before
    :func:`~jaxrl.data.examples.fit_length`.

    Raises:
      DataFileError: chat messages without a chat template, or a template that is not prefix-consistent.
    """
    prompt = row.get(d.prompt_key)
    chosen, rejected = row[d.chosen_key], row[d.rejected_key]
    if isinstance(prompt, str):
        head = encode_text(tokenizer, prompt, add_special_tokens=True)
        eos = eos_id(tokenizer)
        return tuple(SequenceExample.of(head, encode_text(tokenizer, text, add_special_tokens=False) + [eos])
                     for text in (chosen, rejected))
    if not has_chat_template(tokenizer):
        raise DataFileError(f"{where}: chat-message rows need a chat template; the tokenizer has none (set "
                            "data.chat_template, or give prompt / chosen / rejected as text)")
    if prompt is None:
        prompt, chosen, rejected = split_prompt(list(chosen), list(rejected))
    return (prompt_completion(tokenizer, prompt, _as_turns(chosen), where),
            prompt_completion(tokenizer, prompt, _as_turns(rejected), where))


def build_preference_examples(loaded: LoadedRows, tokenizer: Any, d,
                              split: str) -> list[tuple[SequenceExample, SequenceExample]]:
    """Every row of a split as a ``(chosen, rejected)`` pair of sequences of at most ``data.max_length`` tokens
    (``data.truncation``; with ``data.filter_overlong`` pairs with a longer sequence are left out and counted).

    Raises:
      DataFileError: an overlong sequence with ``truncation="error"``, chat rows the template cannot split (each
        names the split's key, the file and the line).
    """
    out, dropped = [], 0
    for row, origin in zip(loaded.rows, loaded.origins, strict=True):
        where = f"{SPLIT_KEYS[split]} {origin}"
        c, r = preference_example(row, tokenizer, d, where)
        if d.filter_overlong and max(len(c), len(r)) > d.max_length:
            dropped += 1
            continue
        out.append((fit_length(c, d.max_length, d.truncation, where), fit_length(r, d.max_length, d.truncation, where)))
    return kept_after_filter(out, dropped, len(loaded.rows), d.max_length, split)
