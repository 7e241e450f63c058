"""One asyncio loop in a daemon thread, and the channel its sessions share.

TRL calls environments from its own threads: ``reset`` from the training loop, async
tools from a loop of its own. gRPC's asyncio channels belong to one loop, so every
session of one factory lives on this runtime's loop and the callers hand it coroutines.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc

from openenv_grpc.client import aio_channel

__all__ = ["Runtime"]

T = TypeVar("T")


class Runtime:
    """A loop thread plus one ``grpc.aio`` channel to ``target``; stopped when the last
    reference goes (a finalizer) or by :meth:`stop`."""

    def __init__(self, target: str, credentials: grpc.ChannelCredentials | None = None) -> None:
        self.target = target
        self.loop = asyncio.new_event_loop()
        thread = threading.Thread(
            target=self.loop.run_forever, name="openenv-grpc-trl", daemon=True
        )
        thread.start()

        async def make_channel() -> grpc.aio.Channel:
            return aio_channel(target, credentials)

        self.channel = asyncio.run_coroutine_threadsafe(make_channel(), self.loop).result()
        self._finalizer = weakref.finalize(self, _stop, self.loop, self.channel, thread)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (from any other thread).

        Raises:
            TimeoutError: no result within ``timeout`` seconds (the coroutine is cancelled).
            RuntimeError: the runtime was stopped (its factory was closed).
        """
        future = self._submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no answer within {timeout}s") from None

    async def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on the runtime's loop from a coroutine on another loop.

        Raises:
            RuntimeError: the runtime was stopped (its factory was closed).
        """
        if asyncio.get_running_loop() is self.loop:
            return await coro
        return await asyncio.wrap_future(self._submit(coro))

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if not self.alive:  # a stopped loop would never run it: fail instead of hanging
            coro.close()
            raise RuntimeError("this environment was closed (its factory was closed)")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def stop(self) -> None:
        """Close the channel and stop the loop thread. Safe to call twice."""
        self._finalizer()


def _stop(
    loop: asyncio.AbstractEventLoop, channel: grpc.aio.Channel, thread: threading.Thread
) -> None:
    if not loop.is_running():
        return
    # The interpreter may be exiting: the process ends the channel anyway.
    with contextlib.suppress(Exception):
        asyncio.run_coroutine_threadsafe(channel.close(), loop).result(5.0)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5.0)
