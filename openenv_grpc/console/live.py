"""Live figures for open pages: one poller reads the server's Info once a period and
hands each open page the capacity, sessions and steps per second.

The poller runs only while at least one page listens, so a console nobody looks at costs
the env server nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import grpc

from openenv_grpc.console.target import EnvTarget, capacity_view

__all__ = ["LiveFigures"]


class LiveFigures:
    """Polls ``target`` every ``period`` seconds while someone subscribes."""

    def __init__(self, target: EnvTarget, period: float = 1.0) -> None:
        self._target = target
        self._period = period
        self._subscribers: set[asyncio.Queue[dict[str, Any]]] = set()
        self._task: asyncio.Task[None] | None = None
        #: The previous reading (pid, steps, uptime), for the rate.
        self._last: tuple[int, int, float] | None = None

    def subscribe(self) -> asyncio.Queue[dict[str, Any]]:
        """A queue that receives every new reading (only the newest is kept)."""
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=1)
        self._subscribers.add(queue)
        if self._task is None:
            self._task = asyncio.create_task(self._poll(), name="openenv-console-live")
        return queue

    def unsubscribe(self, queue: asyncio.Queue[dict[str, Any]]) -> None:
        self._subscribers.discard(queue)
        if not self._subscribers and self._task is not None:
            self._task.cancel()
            self._task = None

    async def stop(self) -> None:
        self._subscribers.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _poll(self) -> None:
        while True:
            reading = await self.read()
            for queue in list(self._subscribers):
                if queue.full():  # a slow page skips a reading rather than queueing them
                    queue.get_nowait()
                queue.put_nowait(reading)
            await asyncio.sleep(self._period)

    async def read(self) -> dict[str, Any]:
        """One reading: ``{"ok": True, ...capacity, "steps_per_second"}`` or, when the
        server does not answer, ``{"ok": False, "code", "message"}``."""
        try:
            info = await self._target.fetch_info(timeout=max(self._period, 2.0))
        except grpc.aio.AioRpcError as exc:
            self._last = None
            return {"ok": False, "code": exc.code().name, "message": exc.details() or ""}
        view = capacity_view(info)
        view["ok"] = True
        view["time"] = time.time()
        activity = info.activity
        now = (info.server_pid, activity.steps, activity.uptime_seconds)
        rate = None
        last = self._last
        # Another process (a restarted server, another worker) starts a new baseline.
        if last is not None and last[0] == now[0] and now[2] > last[2]:
            rate = (now[1] - last[1]) / (now[2] - last[2])
        view["steps_per_second"] = rate
        self._last = now
        return view
