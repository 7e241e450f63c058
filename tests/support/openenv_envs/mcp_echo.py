"""OpenEnv's own ``echo_env`` (envs/echo_env/server/echo_environment.py): a pure MCP env
whose tools are FastMCP functions; actions are ListToolsAction / CallToolAction. One tool
are ours (``repeat``, ``type_of``): int arguments, which must reach the tool as ints."""

from typing import Any
from uuid import uuid4

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Action, Observation, State


class EchoMCPEnvironment(MCPEnvironment):
    """A pure MCP echo environment that echoes back messages."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("echo_env")

        @mcp.tool
        def echo_message(message: str) -> str:
            """Echo back the provided message."""
            return message

        @mcp.tool
        def echo_with_length(message: str) -> dict:
            """Echo back the message with its length."""
            return {"message": message, "length": len(message)}

        @mcp.tool
        def repeat(message: str, times: int) -> dict:
            """Repeat the message (times must arrive as an int)."""
            return {"text": message * times, "input_type": type(times).__name__}

        @mcp.tool
        def type_of(value: Any) -> str:
            """The Python type the value arrived as (an untyped argument: nothing coerces)."""
            return type(value).__name__

        super().__init__(mcp)
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        **kwargs: Any,
    ) -> Observation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return Observation(
            done=False,
            reward=0.0,
            metadata={"status": "ready", "message": "Echo environment ready!"},
        )

    def _step_impl(
        self,
        action: Action,
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> Observation:
        return Observation(
            done=False,
            reward=0.0,
            metadata={"error": f"Unknown action type: {type(action).__name__}."},
        )

    def step(
        self,
        action: Action,
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> Observation:
        self._state.step_count += 1
        return super().step(action, timeout_s=timeout_s, **kwargs)

    async def step_async(
        self,
        action: Action,
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> Observation:
        self._state.step_count += 1
        return await super().step_async(action, timeout_s=timeout_s, **kwargs)

    @property
    def state(self) -> State:
        return self._state
