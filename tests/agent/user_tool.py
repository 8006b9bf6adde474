"""A user's own tool class, named in a tool-config YAML by import path (tests/agent/test_tools.py)."""

from jaxrl.agent.tools import Tool, ToolResult


class EchoTool(Tool):
    def execute(self, arguments):
        return ToolResult(self.config.get("prefix", "") + str(arguments.get("text", "")))
