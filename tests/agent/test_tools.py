"""The Hermes tool-call parser, the calculator, the sandboxed Python tool and verl's tool-config YAML."""

from __future__ import annotations

import pytest

from jaxrl.agent.tool_config import ToolConfigError, load_tools
from jaxrl.agent.tool_parser import parse_tool_calls
from jaxrl.agent.tools import CalculatorTool, PythonTool, calculate


def test_parse_hermes_calls():
    text = ('I will compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>'
            '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call> trailing')
    content, calls = parse_tool_calls(text)
    assert content == "I will compute.\n trailing"
    assert [(c.name, c.arguments, c.error) for c in calls] == [("calculator", {"expression": "1+2"}, None),
                                                               ("f", {"x": 1}, None)]


@pytest.mark.parametrize("block, err", [
    ("{bad json}", "not valid JSON"), ('{"arguments": {}}', "needs {"), ('{"name": "f", "arguments": [1]}',
                                                                         "must be a JSON object")])
def test_malformed_calls_carry_an_error(block, err):
    _, calls = parse_tool_calls(f"<tool_call>{block}</tool_call>")
    assert len(calls) == 1 and err in calls[0].error


def test_no_call_and_unclosed_call():
    assert parse_tool_calls("just text") == ("just text", [])
    assert parse_tool_calls('<tool_call>{"name": "f"}')[1] == []
    with pytest.raises(ValueError, match="multi_turn.format='json' is not supported; valid: hermes"):
        parse_tool_calls("x", "json")


def test_calculator():
    assert calculate("(3 + 4) * 12 / 5") == pytest.approx(16.8)
    assert calculate("2 ** 10 - sqrt(16)") == 1020
    assert CalculatorTool().execute({"expression": "7*6"}).text == "42"
    for bad in ("__import__('os')", "1 if 1 else 2", "2 ** 100000", "1/0"):
        res = CalculatorTool().execute({"expression": bad})
        assert res.error and res.text.startswith("Error:")


def test_python_tool_runs_in_the_sandbox(bwrap_sandbox):
    tool = PythonTool({"isolation": "bwrap", "wall_s": 5})
    ok = tool.execute({"code": "print(sum(range(10)))"})
    assert ok.text == "45\n" and not ok.error
    bad = tool.execute({"code": "raise ValueError('nope')"})
    assert bad.error and "ValueError: nope" in bad.text and "exit code 1" in bad.text
    net = tool.execute({"code": "import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)"})
    assert net.error and "Network is unreachable" in net.text
    assert tool.execute({"code": 3}).error
    spin = PythonTool({"isolation": "bwrap", "wall_s": 1, "cpu_s": 5}).execute({"code": "while True: pass"})
    assert spin.error and spin.text == "Error: limit wall_time exceeded"


def test_load_tools_from_verl_yaml(tmp_path):
    p = tmp_path / "tools.yaml"
    p.write_text("""
tools:
  - class_name: jaxrl.agent.tools.CalculatorTool
    config: {type: native}
  - class_name: tests.agent.user_tool:EchoTool
    config: {prefix: ">> "}
    tool_schema:
      type: function
      function: {name: echo, description: echo text, parameters: {type: object, properties: {text: {type: string}}}}
""")
    tools = load_tools(p)
    assert [t.name for t in tools] == ["calculator", "echo"]
    assert tools[1].execute({"text": "hi"}).text == ">> hi"


@pytest.mark.parametrize("body, msg", [
    ("nothing: 1", "needs a non-empty 'tools:' list"),
    ("tools:\n  - config: {}", r"tools\[0\] needs a class_name"),
    ("tools:\n  - class_name: no.such.Mod", "cannot import module 'no.such'"),
    ("tools:\n  - class_name: jaxrl.agent.tools.ToolResult", "is not a subclass of jaxrl.agent.tools.Tool"),
    ("tools:\n  - class_name: jaxrl.agent.tools.Tool", "tool_schema must be an OpenAI function schema"),
    ("tools:\n  - class_name: jaxrl.agent.tools.CalculatorTool\n  - class_name: jaxrl.agent.tools.CalculatorTool",
     r"function names \['calculator'\] appear more than once"),
])
def test_bad_tool_configs(tmp_path, body, msg):
    p = tmp_path / "t.yaml"
    p.write_text(body)
    with pytest.raises(ToolConfigError, match=msg):
        load_tools(p)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tools(tmp_path / "missing.yaml")


def test_the_shipped_tool_config_loads():
    from pathlib import Path

    tools = load_tools(Path(__file__).resolve().parents[2] / "configs" / "tools" / "python_tool.yaml")
    assert [t.name for t in tools] == ["code_interpreter", "calculator"]
