"""Tool calling, the way LLM agents use it: see :mod:`openenv_grpc.tools.toolbox`."""

from openenv_grpc.tools.toolbox import Toolbox, tool
from openenv_grpc.tools.v1.tools_pb2 import ListToolsCall, Tool, ToolCall, ToolList, ToolResult

__all__ = ["ListToolsCall", "Tool", "ToolCall", "ToolList", "ToolResult", "Toolbox", "tool"]
