"""Token ids of a multi-turn conversation through the model's own chat template (``apply_chat_template``).

* :meth:`ChatCodec.prompt_ids` -- the first prompt, with the tool schemas (a template that does not render
  ``tools``, such as SmolLM2's plain ChatML, gets them as a Hermes-style system message instead);
* :meth:`ChatCodec.turn_ids` -- the tokens that follow a model turn: the template's end-of-turn text after the
  model's stop token, the tool / user messages, and the next assistant header. They are the difference between a
  fixed two-message conversation rendered with and without the new messages (verl renders the same difference),
  so they never depend on how the template re-renders earlier assistant turns (Qwen3 drops their thinking).
"""

from __future__ import annotations

import json

_BASE = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi."}]
_MARK = "\u2063MODEL-TURN\u2063"


def tools_system_text(schemas: list[dict]) -> str:
    """The Hermes tool instructions for templates that do not render ``tools`` themselves."""
    lines = "\n".join(json.dumps(s) for s in schemas)
    return ("You can call functions to help answer. The available functions, one JSON schema per line, are "
            f"inside <tools></tools>:\n<tools>\n{lines}\n</tools>\nTo call a function, write a JSON object with "
            'its name and arguments inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, '
            '"arguments": <args-json-object>}\n</tool_call>\nThe result comes back in the next message.')


def as_messages(prompt) -> list[dict]:
    """A row's prompt as chat messages (a string becomes one user message).

    Raises:
      ValueError: neither a string nor a list of ``{role, content}`` dicts.
    """
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if hasattr(prompt, "tolist"):  # numpy object array from parquet
        prompt = prompt.tolist()
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
        return [dict(m) for m in prompt]
    raise ValueError(f"multi-turn rollout needs each prompt as a string or a list of {{role, content}} messages; "
                     f"got {prompt!r:.80}")


class ChatCodec:
    """Renders conversations to token ids with ``tokenizer``'s chat template.

    Args:
      tokenizer: a Hugging Face tokenizer with a ``chat_template``.
      schemas: the tools' OpenAI function schemas (may be empty).

    Raises:
      ValueError: the tokenizer has no chat template, or its template does not render a tool message after the
        base conversation as an append (the message names the tokenizer).
    """

    def __init__(self, tokenizer, schemas: list[dict]):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"multi-turn rollout needs a tokenizer with a chat template; "
                             f"{type(tokenizer).__name__} has none")
        self.tok = tokenizer
        self.schemas = list(schemas)
        probe = [{"role": "user", "content": "x"}]
        self.template_renders_tools = bool(schemas) and (
            self._render(probe, tools=self.schemas, gen=True) != self._render(probe, gen=True))
        with_mark = self._render(_BASE + [{"role": "assistant", "content": _MARK}], gen=False)
        self.after_turn = with_mark[with_mark.index(_MARK) + len(_MARK):]  # e.g. "<|im_end|>\n"
        self._base_text = self._render(_BASE, gen=False)

    def _render(self, messages, *, gen: bool, tools=None) -> str:
        kw = {"tools": tools} if tools else {}
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kw)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with no BOS / special tokens added."""
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first prompt ``[P]``: ``messages`` (+ the tools) and the assistant header."""
        if self.schemas and not self.template_renders_tools:
            extra = tools_system_text(self.schemas)
            if messages and messages[0].get("role") == "system":
                messages = [{"role": "system", "content": f"{messages[0]['content']}\n\n{extra}"}] + messages[1:]
            else:
                messages = [{"role": "system", "content": extra}] + messages
            return self.encode(self._render(messages, gen=True))
        return self.encode(self._render(messages, gen=True, tools=self.schemas or None))

    def turn_ids(self, messages: list[dict], last_model_token: int | None) -> list[int]:
        """Tokens after a model turn that ended with ``last_model_token`` (None: it did not end with a stop token):
        the rest of the template's end-of-turn text, ``messages`` (tool / user) and the next assistant header.

        Raises:
          ValueError: the template rewrites the base conversation when messages are appended (cannot be diffed).
        """
        full = self._render(_BASE + messages, gen=True)
        if not full.startswith(self._base_text):
            raise ValueError(f"the chat template of {type(self.tok).__name__} does not render appended "
                             f"{[m['role'] for m in messages]} messages as an append; multi-turn cannot use it")
        glue = self.after_turn
        if last_model_token is not None:
            stop_text = self.tok.decode([last_model_token], skip_special_tokens=False)
            if glue.startswith(stop_text):
                glue = glue[len(stop_text):]
        return self.encode(glue + full[len(self._base_text):])
