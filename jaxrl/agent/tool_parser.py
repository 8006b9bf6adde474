"""Parse the Hermes tool-call format that Qwen2.5 / Qwen3 / ChatML chat templates ask for.

A model turn calls tools with one or more blocks ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(the format the Qwen2.5/Qwen3 templates describe in their system prompt; verl's ``multi_turn.format=hermes``).
Standard library only.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

FORMATS = ("hermes",)
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``name`` and ``arguments`` (a dict), or ``error`` when the block is not a valid call
    (bad JSON, no ``name``, arguments not an object); ``raw`` is the block's text."""

    name: str = ""
    arguments: dict = field(default_factory=dict)
    error: str | None = None
    raw: str = ""


def parse_tool_calls(text: str, fmt: str = "hermes") -> tuple[str, list[ToolCall]]:
    """Split a model turn into its plain content and its tool calls.

    Args:
      text: the decoded model turn (special tokens removed).
      fmt: the call format; only ``"hermes"``.

    Returns:
      ``(content, calls)``: ``content`` is ``text`` with the ``<tool_call>`` blocks removed (stripped);
      ``calls`` the blocks in order, each a :class:`ToolCall` (malformed blocks carry ``error``). An unclosed
      ``<tool_call>`` is not a call.

    Raises:
      ValueError: an unknown ``fmt``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"multi_turn.format={fmt!r} is not supported; valid: {', '.join(FORMATS)}")
    calls = []
    for m in _CALL.finditer(text):
        raw = m.group(1).strip()
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(error=f"tool call is not valid JSON ({e.msg})", raw=raw))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            calls.append(ToolCall(error='tool call needs {"name": <string>, "arguments": <object>}', raw=raw))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models emit the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(name=obj["name"], error="tool call arguments must be a JSON object", raw=raw))
            continue
        calls.append(ToolCall(name=obj["name"], arguments=args, raw=raw))
    content = _CALL.sub("", text).strip()
    return content, calls
