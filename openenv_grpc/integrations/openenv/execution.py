"""Where an OpenEnv env's methods run, as OpenEnv's own server runs them: the adapter's
``reset`` / ``step`` / ``state`` / ``close``, sync (the server's thread pool) or async
(awaited on the event loop; sync calls in a thread; one shared thread for
``REQUIRES_SINGLE_THREAD_EXECUTOR``; an MCP session held open for the whole session)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
from collections.abc import Callable
from typing import Any

from google.protobuf.message import Message

from openenv_grpc.integrations.openenv.bridge import Bridge
from openenv_grpc.integrations.openenv.signatures import has_mcp, overrides

__all__ = ["async_methods", "sync_methods"]


def sync_methods(bridge: Bridge) -> dict[str, Any]:
    def __init__(self: Any) -> None:
        self._env = bridge.env_class()

    def reset(self: Any, *, seed: int | None, episode_id: str, options: Message | None) -> Any:
        return bridge.transition(self._env.reset(**bridge.reset_kwargs(seed, episode_id, options)))

    def step(self: Any, action: Message) -> Any:
        return bridge.transition(self._env.step(bridge.action_in(action)))

    def state(self: Any) -> Message:
        return bridge.state_out(self._env)

    def close(self: Any) -> None:
        self._env.close()

    return {"__init__": __init__, "reset": reset, "step": step, "state": state, "close": close}


def async_methods(
    bridge: Bridge, executor: concurrent.futures.ThreadPoolExecutor | None
) -> dict[str, Any]:
    env_class = bridge.env_class
    reset_is_async = overrides(env_class, "reset_async")
    step_is_async = overrides(env_class, "step_async")

    async def in_thread(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor, functools.partial(function, *args, **kwargs))

    def __init__(self: Any) -> None:
        self._env = env_class()
        self._mcp = None  # the MCP session held open, once a call needs it

    async def open_mcp(self: Any) -> None:
        if self._mcp is None and has_mcp(env_class):
            self._mcp = _HeldContext(self._env.mcp_session)
            await self._mcp.enter()

    async def reset(
        self: Any, *, seed: int | None, episode_id: str, options: Message | None
    ) -> Any:
        await open_mcp(self)
        kwargs = bridge.reset_kwargs(seed, episode_id, options)
        if reset_is_async:
            observation = await self._env.reset_async(**kwargs)
        else:
            observation = await in_thread(self._env.reset, **kwargs)
        return bridge.transition(observation)

    async def step(self: Any, action: Message) -> Any:
        await open_mcp(self)
        model = bridge.action_in(action)
        if step_is_async:
            return bridge.transition(await self._env.step_async(model))
        return bridge.transition(await in_thread(self._env.step, model))

    async def state(self: Any) -> Message:
        return bridge.state_out(self._env)

    async def close(self: Any) -> None:
        try:
            if self._mcp is not None:
                await self._mcp.exit()
        finally:
            await in_thread(self._env.close)

    return {"__init__": __init__, "reset": reset, "step": step, "state": state, "close": close}


class _HeldContext:
    """An async context manager held open by a task of its own: entered and exited in
    that task (anyio, under FastMCP, insists), whichever task asks."""

    def __init__(self, factory: Callable[[], contextlib.AbstractAsyncContextManager[Any]]) -> None:
        self._factory = factory
        self._entered: asyncio.Future[None] | None = None
        self._release = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def enter(self) -> None:
        self._entered = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._hold())
        await self._entered

    async def _hold(self) -> None:
        assert self._entered is not None
        try:
            async with self._factory():
                self._entered.set_result(None)
                await self._release.wait()
        except BaseException as exc:
            if not self._entered.done():
                self._entered.set_exception(exc)
            raise

    async def exit(self) -> None:
        self._release.set()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task
