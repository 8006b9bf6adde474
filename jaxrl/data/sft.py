"""SFT rows -> training sequences, as verl's SFT datasets build them (``verl/utils/dataset/sft_dataset.py``,
``multiturn_sft_dataset.py``).

Single-turn rows (``data.multiturn.enable=false``): the prompt is ``row[data.prompt_key]`` followed into
``data.prompt_dict_keys`` (e.g. ``prompt_key=extra_info, prompt_dict_keys=[question]``), the response likewise
(``response_key`` / ``response_dict_keys``). A text prompt becomes one user message through the chat template with
the generation prompt (a list of chat messages is rendered as it is); without a chat template it is encoded as plain
text (messages joined by newlines). The response text is encoded without special tokens and ends with the
tokenizer's EOS, so the model learns to stop. The loss is on the response's tokens only.

Conversations (``data.multiturn.enable=true``): ``row[data.multiturn.messages_key]`` is a list of chat messages;
the loss is on every assistant turn (:func:`jaxrl.data.examples.conversation_example`).

No jax import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxrl.data.examples import (SequenceExample, check_messages, conversation_example, encode_text, eos_id,
                                 fit_length, has_chat_template, kept_after_filter, render_chat)
from jaxrl.data.sources import SPLIT_KEYS, DataFileError, LoadedRows

__all__ = ["build_sft_examples", "nested_value", "sft_example", "sft_row_check"]


def nested_value(row: dict, key: str, dict_keys: list[str] | None) -> Any:
    """``row[key]``, then ``[k]`` for each of ``dict_keys`` in turn (verl's ``*_dict_keys``).

    Raises:
      KeyError: a key is missing (the message names the path and the keys present).
    """
    value, path = row, []
    for k in [key] + list(dict_keys or []):
        path.append(k)
        if not isinstance(value, dict) or k not in value:
            have = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise KeyError(f"missing {'.'.join(path)!r} (has {have})")
        value = value[k]
    return value


def sft_row_check(d) -> Callable[[dict], str | None]:
    """The row check of an SFT data section (``data.*`` of :class:`~jaxrl.config.offline_schema.SFTConfig`):
    ``row -> why it is malformed, or None``."""
    if d.multiturn.enable:
        return lambda row: check_messages(row.get(d.multiturn.messages_key), d.multiturn.messages_key,
                                          need_assistant=True)

    def check(row: dict) -> str | None:
        try:
            prompt = nested_value(row, d.prompt_key, d.prompt_dict_keys)
            response = nested_value(row, d.response_key, d.response_dict_keys)
        except KeyError as e:
            return e.args[0]
        if not (isinstance(prompt, str) and prompt) and check_messages(prompt, "prompt") is not None:
            return f"the prompt ({d.prompt_key}) is {type(prompt).__name__}; expected a string or a list of chat " \
                   "messages"
        if not (isinstance(response, str) and response):
            return f"the response ({d.response_key}) is {type(response).__name__!s:.40}; expected a non-empty string"
        return None

    return check


def sft_example(row: dict, tokenizer: Any, d, where: str) -> SequenceExample:
    """One row (already checked by :func:`sft_row_check`) as a sequence, before :func:`fit_length`.

    Raises:
      DataFileError: a conversation the chat template does not render prefix-consistently, or a conversation
        without a chat template.
    """
    if d.multiturn.enable:
        if not has_chat_template(tokenizer):
            raise DataFileError(f"{where}: data.multiturn.enable=true needs a chat template; the tokenizer has none "
                                "(set data.chat_template)")
        return conversation_example(tokenizer, row[d.multiturn.messages_key], where)
    prompt = nested_value(row, d.prompt_key, d.prompt_dict_keys)
    response = nested_value(row, d.response_key, d.response_dict_keys)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if has_chat_template(tokenizer):
        prompt_ids = render_chat(tokenizer, messages, add_generation_prompt=True)
    else:
        prompt_ids = encode_text(tokenizer, "\n".join(m["content"] for m in messages), add_special_tokens=True)
    response_ids = encode_text(tokenizer, response, add_special_tokens=False) + [eos_id(tokenizer)]
    return SequenceExample.of(prompt_ids, response_ids)


def build_sft_examples(loaded: LoadedRows, tokenizer: Any, d, split: str) -> list[SequenceExample]:
    """Every row of a split as a sequence of at most ``data.max_length`` tokens (``data.truncation``; with
    ``data.filter_overlong`` longer ones are left out and counted in the log).

    Args:
      loaded: the split's rows and their ``file:line`` origins.
      tokenizer: the run's tokenizer (with ``data.chat_template`` applied).
      d: the ``data`` section.
      split: ``"train"`` or ``"val"``.

    Raises:
      DataFileError: an overlong sequence with ``truncation="error"``, a conversation the template cannot split
        (each names the split's key, the file and the line).
    """
    out, dropped = [], 0
    for row, origin in zip(loaded.rows, loaded.origins, strict=True):
        where = f"{SPLIT_KEYS[split]} {origin}"
        example = sft_example(row, tokenizer, d, where)
        if d.filter_overlong and len(example) > d.max_length:
            dropped += 1
            continue
        out.append(fit_length(example, d.max_length, d.truncation, where))
    return kept_after_filter(out, dropped, len(loaded.rows), d.max_length, split)
