"""Read verl's tool-config YAML (``actor_rollout_ref.rollout.multi_turn.tool_config_path``) into tools.

The file's format is verl's::

    tools:
      - class_name: jaxrl.agent.tools.PythonTool        # import path of a jaxrl.agent.tools.Tool subclass
        config: {type: native, isolation: bwrap, wall_s: 5}
        tool_schema:                                     # OpenAI function schema (optional for built-ins)
          type: function
          function: {name: code_interpreter, description: ..., parameters: {...}}

``class_name`` is ``package.module.Class`` or ``package.module:Class``. verl's
``verl.tools.sandbox_fusion_tools.SandboxFusionTool`` is read as :class:`~jaxrl.agent.tools.PythonTool` (its
``sandbox_fusion_url`` config is honoured). No jax.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from jaxrl.agent.tools import Tool

ALIASES = {"verl.tools.sandbox_fusion_tools.SandboxFusionTool": "jaxrl.agent.tools.PythonTool"}


class ToolConfigError(ValueError):
    """A tool config that cannot be used; the one-line message names the file, the entry and what is valid."""


def import_object(path: str, *, what: str):
    """The object at ``package.module.Name`` / ``package.module:Name``.

    Raises:
      ToolConfigError: the module or the name cannot be imported (names ``path``).
    """
    mod_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not mod_name or not attr:
        raise ToolConfigError(f"{what} {path!r} is not an import path; use package.module.Name")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ToolConfigError(f"{what} {path!r}: cannot import module {mod_name!r} ({e})") from None
    if not hasattr(mod, attr):
        raise ToolConfigError(f"{what} {path!r}: module {mod_name!r} has no {attr!r}")
    return getattr(mod, attr)


def load_tools(path: str | Path) -> list[Tool]:
    """Build the tools a tool-config YAML names, in order.

    Raises:
      FileNotFoundError: no file at ``path``.
      ToolConfigError: a file that is not YAML, no ``tools`` list, an entry without ``class_name``, a class that
        is not a :class:`Tool` subclass, a bad schema, or two tools with the same function name.
    """
    import yaml

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"multi_turn.tool_config_path={str(path)!r} does not exist")
    try:
        doc = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ToolConfigError(f"tool config {p} is not valid YAML: {str(e).splitlines()[0]}") from None
    entries = doc.get("tools") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ToolConfigError(f"tool config {p} needs a non-empty 'tools:' list of {{class_name, config, "
                              "tool_schema}} entries")
    tools: list[Tool] = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("class_name"), str):
            raise ToolConfigError(f"tool config {p}: tools[{i}] needs a class_name (an import path)")
        name = ALIASES.get(e["class_name"], e["class_name"])
        cls = import_object(name, what=f"tool config {p}: tools[{i}].class_name")
        if not (isinstance(cls, type) and issubclass(cls, Tool)):
            raise ToolConfigError(f"tool config {p}: tools[{i}].class_name {name!r} is not a subclass of "
                                  "jaxrl.agent.tools.Tool")
        try:
            tool = cls(e.get("config") or {}, e.get("tool_schema"))
        except (ValueError, TypeError) as err:
            raise ToolConfigError(f"tool config {p}: tools[{i}] ({name}): {err}") from None
        tools.append(tool)
    names = [t.name for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ToolConfigError(f"tool config {p}: function names {dup} appear more than once")
    return tools


def load_env_class(path: str):
    """The :class:`jaxrl.agent.env.Environment` subclass at import path ``path`` (``multi_turn.env_class``).

    Raises:
      ToolConfigError: it cannot be imported or is not an Environment subclass.
    """
    from jaxrl.agent.env import Environment

    cls = import_object(path, what="multi_turn.env_class")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ToolConfigError(f"multi_turn.env_class={path!r} is not a subclass of jaxrl.agent.env.Environment")
    return cls


def check_multi_turn(mt_cfg) -> None:
    """Fail fast on a run's ``multi_turn`` section (``python -m jaxrl.train`` calls it before jax loads): the tool
    YAML loads, its classes import and build (a Python tool checks its sandbox), ``env_class`` imports.

    Raises:
      FileNotFoundError, ToolConfigError, jaxrl.sandbox.SandboxUnavailableError: see :func:`load_tools`.
    """
    if mt_cfg.tool_config_path:
        load_tools(mt_cfg.tool_config_path)
    if mt_cfg.env_class:
        load_env_class(mt_cfg.env_class)
