"""Tools a model calls during a multi-turn rollout (verl's ``BaseTool`` idea, in our own small form).

A tool has an OpenAI function ``schema`` (what the chat template shows the model) and ``execute(arguments)``
returning a :class:`ToolResult`. Built in: :class:`PythonTool` (runs the model's code in :mod:`jaxrl.sandbox`)
and :class:`CalculatorTool` (arithmetic, no code execution). A user's tool subclasses :class:`Tool` and is named in
the tool-config YAML by import path (:mod:`jaxrl.agent.tool_config`). No jax.
"""

from __future__ import annotations

import ast
import math
import operator
import threading
from dataclasses import dataclass


@dataclass
class ToolResult:
    """What one call gives back: ``text`` (the tool message's content), ``error`` (True when the call failed:
    bad arguments, the program failed, the sandbox failed), ``reward`` (a per-call reward; 0 unless the tool
    scores), ``seconds`` (wall time, filled by the loop)."""

    text: str
    error: bool = False
    reward: float = 0.0
    seconds: float = 0.0


class Tool:
    """Base class of tools.

    Args:
      config: the ``config`` mapping of the tool's YAML entry (tool-specific settings).
      schema: the ``tool_schema`` mapping (OpenAI function format: ``{"type": "function", "function": {"name",
        "description", "parameters"}}``); a subclass may define ``default_schema`` instead.

    Subclasses implement :meth:`execute`. One instance serves every row of a rollout, from several threads at once:
    keep no per-row state in it (per-row state belongs in an :class:`jaxrl.agent.env.Environment`).
    """

    default_schema: dict | None = None

    def __init__(self, config: dict | None = None, schema: dict | None = None):
        self.config = dict(config or {})
        schema = schema or self.default_schema
        if not isinstance(schema, dict) or not isinstance((schema.get("function") or {}).get("name"), str):
            raise ValueError(f"{type(self).__name__}: tool_schema must be an OpenAI function schema "
                             "{type: function, function: {name, description, parameters}}; got "
                             f"{schema!r:.120}")
        self.schema = schema

    @property
    def name(self) -> str:
        """The function name the model calls."""
        return self.schema["function"]["name"]

    def execute(self, arguments: dict) -> ToolResult:
        """Run one call with the model's ``arguments``; never raises for bad model input (returns an error
        :class:`ToolResult` instead)."""
        raise NotImplementedError


class PythonTool(Tool):
    """Runs the model's Python ``code`` in :mod:`jaxrl.sandbox` (bubblewrap by default) and returns its stdout
    (and stderr when it failed).

    Config: ``isolation`` (``"bwrap"`` | ``"none"``, as ``reward_model.sandbox.isolation``), ``sandbox_fusion_url``
    (run on a Sandbox Fusion server instead), ``wall_s``, ``cpu_s``, ``memory_mb`` (:class:`jaxrl.sandbox.Limits`).

    Raises:
      jaxrl.sandbox.SandboxUnavailableError: bubblewrap cannot run here (the message says what to install).
      ValueError: a bad ``isolation`` / limit value.
    """

    default_schema = {
        "type": "function",
        "function": {
            "name": "code_interpreter",
            "description": "Run a Python program and return what it prints to stdout.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "The Python program to run."}},
                "required": ["code"],
            },
        },
    }

    def __init__(self, config: dict | None = None, schema: dict | None = None):
        super().__init__(config, schema)
        from jaxrl.sandbox import Limits, make_sandbox

        c = self.config
        self.sandbox = make_sandbox(isolation=c.get("isolation", "bwrap"), fusion_url=c.get("sandbox_fusion_url"))
        self.sandbox.check()  # no bubblewrap here: SandboxUnavailableError now, saying what to install
        self.limits = Limits(wall_s=float(c.get("wall_s", 10.0)), cpu_s=float(c.get("cpu_s", 10.0)),
                             memory_mb=int(c.get("memory_mb", 1024)))

    def execute(self, arguments: dict) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            return ToolResult("Error: the 'code' argument must be a non-empty string of Python code.", error=True)
        res = self.sandbox.run_code(code, "", self.limits)
        if res.ok:
            return ToolResult(res.stdout if res.stdout else "(no output)")
        detail = res.error or (f"limit {res.limit} exceeded" if res.limit else f"exit code {res.exit_code}")
        return ToolResult(f"{res.stdout}{res.stderr}\nError: {detail}".strip(), error=True)


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max, "log": math.log, "exp": math.exp}


# The loop runs a turn's tool calls in threads; CPython 3.11's ast.parse keeps one recursion counter per interpreter
# (cpython#106905) and can raise "AST constructor recursion depth mismatch" when two threads parse at once.
_PARSE_LOCK = threading.Lock()


def calculate(expression: str) -> float | int:
    """Evaluate an arithmetic expression (numbers, ``+ - * / // % **``, parentheses, ``sqrt abs round min max log
    exp``) without executing code: the expression's syntax tree is walked.

    Raises:
      ValueError: anything else in the expression, or an exponent above 1000 (names the problem).
      ZeroDivisionError: division by zero.
    """
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 1000:
                raise ValueError(f"exponent {right} is too large (at most 1000)")
            return _BINOPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
            return _UNOPS[type(node.op)](ev(node.operand))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS
                and not node.keywords):
            return _FUNCS[node.func.id](*[ev(a) for a in node.args])
        raise ValueError(f"unsupported element {ast.dump(node)[:60]!r}; use numbers, + - * / // % ** and "
                         f"{', '.join(_FUNCS)}")

    try:
        with _PARSE_LOCK:
            tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r:.80} ({e.msg})") from None
    return ev(tree)


class CalculatorTool(Tool):
    """Evaluates an arithmetic ``expression`` (:func:`calculate`); no code runs."""

    default_schema = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression, e.g. (3 + 4) * 12 / 5.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "The arithmetic expression."}},
                "required": ["expression"],
            },
        },
    }

    def execute(self, arguments: dict) -> ToolResult:
        expr = arguments.get("expression")
        if not isinstance(expr, str):
            return ToolResult("Error: the 'expression' argument must be a string.", error=True)
        try:
            value = calculate(expr)
        except (ValueError, ZeroDivisionError, OverflowError, TypeError) as e:
            return ToolResult(f"Error: {e}", error=True)
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
            value = int(value)
        return ToolResult(str(value))
