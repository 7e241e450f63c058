"""Where an OpenEnv env's methods run, as OpenEnv's own server runs them: the adapter's
``reset`` / ``step`` / ``state`` / ``close``, sync (the server's thread pool) or async
(awaited on an event loop; sync calls in a thread; one shared thread for
``REQUIRES_SINGLE_THREAD_EXECUTOR``; an MCP session held open for the whole session).

An async env's coroutines run on an event loop of its own, on a thread of its own
(:class:`OwnLoop`), never on the server's: an env that blocks inside ``reset_async``
(``time.sleep``, a blocking socket) would otherwise freeze health checks, every other
session and the drain. The server awaits the env's calls across threads, so its step
timeout and drain bound hold; a blocked env holds only its own thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from google.protobuf.message import Message
from pydantic import BaseModel

from openenv_grpc.integrations.openenv.bridge import Bridge
from openenv_grpc.integrations.openenv.signatures import has_mcp, overrides
from openenv_grpc.server.errors import contained
from openenv_grpc.server.local.runner import contain_tasks

__all__ = ["OwnLoop", "async_methods", "sync_methods"]

T = TypeVar("T")


def sync_methods(bridge: Bridge) -> dict[str, Any]:
    def __init__(self: Any) -> None:
        self._env = bridge.factory()

    def reset(self: Any, *, seed: int | None, episode_id: str, options: Message | None) -> Any:
        return bridge.transition(self._env.reset(**bridge.reset_kwargs(seed, episode_id, options)))

    def step(self: Any, action: Message | BaseModel) -> Any:
        native = isinstance(action, BaseModel)  # the door's native lane
        return bridge.transition(self._env.step(bridge.action_in(action)), native)

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
        self._env = bridge.factory()
        self._mcp = None  # the MCP session held open, once a call needs it
        self._loop = OwnLoop(f"openenv-{env_class.__name__}")

    async def open_mcp(self: Any) -> None:
        if self._mcp is None and has_mcp(env_class):
            self._mcp = _HeldContext(self._env.mcp_session)
            await self._mcp.enter()

    async def env_reset(self: Any, kwargs: dict[str, Any]) -> Any:
        await open_mcp(self)
        if reset_is_async:
            return await self._env.reset_async(**kwargs)
        return await in_thread(self._env.reset, **kwargs)

    async def env_step(self: Any, model: Any) -> Any:
        await open_mcp(self)
        if step_is_async:
            return await self._env.step_async(model)
        return await in_thread(self._env.step, model)

    async def env_state(self: Any) -> Message:
        return bridge.state_out(self._env)

    async def env_close(self: Any) -> None:
        try:
            if self._mcp is not None:
                await self._mcp.exit()
        finally:
            await in_thread(self._env.close)

    async def reset(
        self: Any, *, seed: int | None, episode_id: str, options: Message | None
    ) -> Any:
        kwargs = bridge.reset_kwargs(seed, episode_id, options)
        return bridge.transition(await self._loop.run(env_reset(self, kwargs)))

    async def step(self: Any, action: Message | BaseModel) -> Any:
        native = isinstance(action, BaseModel)  # the door's native lane
        model = bridge.action_in(action)
        return bridge.transition(await self._loop.run(env_step(self, model)), native)

    async def state(self: Any) -> Message:
        return await self._loop.run(env_state(self))  # type: ignore[no-any-return]

    async def close(self: Any) -> None:
        try:
            await self._loop.run(env_close(self))
        finally:
            self._loop.stop()

    return {"__init__": __init__, "reset": reset, "step": step, "state": state, "close": close}


class OwnLoop:
    """An event loop on a daemon thread of its own, started at the first call."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    async def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """``coroutine``'s result, run on this loop; cancelling the caller cancels it
        there (when that loop is free to notice). Its ``SystemExit`` comes back as an
        ``EnvExit``: left bare, it would stop this loop for good."""
        future = asyncio.run_coroutine_threadsafe(contained(coroutine), self._started())
        return await asyncio.wrap_future(future)

    def stop(self) -> None:
        """Stop the loop (its thread ends once the loop is free); idempotent."""
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                contain_tasks(loop)  # the tasks the env starts there, too
                threading.Thread(
                    target=_run_forever, args=(loop,), name=self._name, daemon=True
                ).start()
                self._loop = loop
            return self._loop


def _run_forever(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        with contextlib.suppress(Exception):
            loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


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
