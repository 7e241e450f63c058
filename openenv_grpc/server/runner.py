"""Runs one environment instance's methods where its execution mode says they belong.

No thread per session: inline and async envs run on the event loop, blocking sync envs
share one bounded thread pool. Calls on one instance never overlap because a session
awaits each call before reading its next request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any

from openenv_grpc.environment import AnyEnvironment
from openenv_grpc.server.spec import EnvSpec, ExecutionMode

__all__ = ["EnvRunner", "RunnerFactory"]

log = logging.getLogger(__name__)


class EnvRunner:
    """One live environment instance and the way to call it."""

    __slots__ = ("_closed", "_inflight", "_mode", "_pool", "env")

    def __init__(self, env: AnyEnvironment, mode: ExecutionMode, pool: Executor) -> None:
        self.env = env
        self._mode = mode
        self._pool = pool
        self._closed = False
        #: The last call submitted to the pool; a cancelled session may leave it running.
        self._inflight: concurrent.futures.Future[Any] | None = None

    @classmethod
    async def create(cls, spec: EnvSpec, pool: Executor) -> EnvRunner:
        """Make a fresh instance with the spec's factory (on the pool for pooled envs).

        Raises:
            Exception: whatever the factory raised.
        """
        if spec.mode is ExecutionMode.POOL:
            future = pool.submit(spec.factory)
            try:
                env = await asyncio.wrap_future(future)
            except asyncio.CancelledError:
                # The session is gone but the env may still be born: close it then.
                future.add_done_callback(_close_orphan)
                raise
        else:
            env = spec.factory()
        if not isinstance(env, spec.env_class):
            raise TypeError(
                f"factory returned {type(env).__qualname__}, not {spec.env_class.__qualname__}"
            )
        return cls(env, spec.mode, pool)

    async def call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call one of the env's methods and return its result (awaited if async)."""
        if self._mode is ExecutionMode.INLINE:
            return method(*args, **kwargs)
        if self._mode is ExecutionMode.ASYNC:
            return await method(*args, **kwargs)
        self._inflight = future = self._pool.submit(method, *args, **kwargs)
        return await asyncio.wrap_future(future)

    async def call_within(
        self, timeout: float | None, method: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """:meth:`call`, giving up after ``timeout`` seconds (None: wait for ever).

        Inline envs run on the event loop and cannot be interrupted: no timeout applies.
        After a timeout the instance is unusable; see :meth:`abandon`.

        Raises:
            TimeoutError: the call did not return in time (it may still be running).
        """
        if timeout is None or self._mode is ExecutionMode.INLINE:
            return await self.call(method, *args, **kwargs)
        if self._mode is ExecutionMode.ASYNC:
            awaitable = method(*args, **kwargs)  # cancelled on timeout
        else:
            self._inflight = future = self._pool.submit(method, *args, **kwargs)
            awaitable = asyncio.wrap_future(future)  # a future: wait_for makes no task for it
        try:
            return await asyncio.wait_for(awaitable, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no answer within {timeout:g}s") from None

    def abandon(self) -> None:
        """Give up on this instance after a timeout: close it once its running call ends,
        without waiting for that here. Counts as closed."""
        if self._closed:
            return
        self._closed = True
        inflight = self._inflight
        if self._mode is ExecutionMode.POOL and inflight is not None and not inflight.done():
            # Runs on the pool thread that finishes the hung call.
            inflight.add_done_callback(lambda _: _close_quietly(self.env))
            return
        if self._mode is ExecutionMode.ASYNC:
            task = asyncio.get_running_loop().create_task(_aclose_quietly(self.env))
            _background.add(task)
            task.add_done_callback(_background.discard)
            return
        self._pool.submit(_close_quietly, self.env)

    async def close(self) -> None:
        """Close the env exactly once; later calls do nothing.

        Raises:
            Exception: whatever the env's ``close`` raised (it still counts as closed).
        """
        if self._closed:
            return
        self._closed = True
        inflight = self._inflight
        if inflight is not None and not inflight.done():
            # Never overlap close() with a call a cancelled session left running.
            await asyncio.wait([asyncio.wrap_future(inflight)])
        await self.call(self.env.close)

    async def close_quietly(self) -> None:
        """:meth:`close`, shielded from a second cancellation (a server stopping must not
        skip it), logging what the env's ``close`` raised instead of raising it."""
        try:
            await asyncio.shield(self.close())
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("environment close() raised; its session ended anyway")


#: Makes a fresh env instance wrapped in a runner (the session's factory).
RunnerFactory = Callable[[], Awaitable[EnvRunner]]


#: Closes of abandoned async envs, referenced until done so they are not collected.
_background: set[asyncio.Task[Any]] = set()


def _close_orphan(future: concurrent.futures.Future[Any]) -> None:
    """Close an env whose session ended while its factory ran (runs on a pool thread)."""
    if not future.cancelled() and future.exception() is None:
        _close_quietly(future.result())


def _close_quietly(env: Any) -> None:
    try:
        env.close()
    except Exception:
        log.exception("closing an abandoned environment raised")


async def _aclose_quietly(env: Any) -> None:
    try:
        await env.close()
    except Exception:
        log.exception("closing an abandoned environment raised")
