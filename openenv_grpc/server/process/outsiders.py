"""What callers without a valid token (health probes; everyone when ``AUTH_TOKEN`` is
unset) may make the server buffer: a budget of their own.

grpc-core grants a read the window its length prefix announces (up to the request limit)
and buffers the message until complete, so each outsider's read reserves the whole request
limit first. When the budget is used up, a newcomer from a connection holding none of it
pushes out the oldest read that has waited :data:`EVICTABLE_AFTER_SECONDS` (an honest
probe's request is read within a loop turn, so only one still arriving is pushed out),
else it is refused ``RESOURCE_EXHAUSTED`` with pushback before a byte is read.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import grpc

from openenv_grpc.metadata import RETRY_PUSHBACK_KEY
from openenv_grpc.server.process.budget import ByteBudget

__all__ = ["EVICTABLE_AFTER_SECONDS", "OUTSIDER_ARRIVAL_SECONDS", "OutsiderBudget"]

#: The longest an outsider's request may take to arrive (health and Info: a few bytes).
OUTSIDER_ARRIVAL_SECONDS = 1.0
#: How long a read must have held its reservation before a newcomer may push it out.
EVICTABLE_AFTER_SECONDS = 0.005

Metadata = Sequence[tuple[str, str | bytes]] | None


class OutsiderBudget:
    """The bytes that reads of outsiders' requests may hold at once; ``insider`` tells
    whether a call's metadata carries a valid token (None: no token, all are outsiders)."""

    def __init__(
        self,
        total: int,
        per_read: int,
        insider: Callable[[Metadata], bool] | None = None,
        pushback_ms: int = 500,
    ) -> None:
        self.budget = ByteBudget(total)
        self._per_read = per_read
        self._insider = insider
        self._pushback = ((RETRY_PUSHBACK_KEY, str(pushback_ms)),)
        # Reads holding a reservation, oldest first (the future that pushes one out ->
        # when it took its bytes), and how many each connection holds.
        self._holders: dict[asyncio.Future[None], float] = {}
        self._peers: Counter[str] = Counter()

    def is_outsider(self, details: grpc.HandlerCallDetails) -> bool:
        return self._insider is None or not self._insider(details.invocation_metadata)

    @asynccontextmanager
    async def reading(
        self, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[asyncio.Future[None]]:
        """Hold one read's reservation; yields a future done once a newer read pushed
        this one out (the read must then end). With no room and none to push out, the
        call ends RESOURCE_EXHAUSTED with pushback (AbortError) before a byte is read."""
        n = self._per_read
        peer = context.peer()
        if not self.budget.try_take(n):
            if self._peers[peer] or not await self._make_room(n):
                await self._refuse(context)
            # The pushed-out read gives its bytes back as it ends, within a loop turn.
            try:
                await asyncio.wait_for(self.budget.take(n), OUTSIDER_ARRIVAL_SECONDS)
            except asyncio.TimeoutError:
                await self._refuse(context)
        loop = asyncio.get_running_loop()
        pushed_out: asyncio.Future[None] = loop.create_future()
        self._holders[pushed_out] = loop.time()
        self._peers[peer] += 1
        try:
            yield pushed_out
        finally:
            del self._holders[pushed_out]
            self._peers[peer] -= 1
            if not self._peers[peer]:
                del self._peers[peer]
            self.budget.give(n)

    async def _make_room(self, n: int) -> bool:
        """Push out the oldest read once it has held its bytes
        :data:`EVICTABLE_AFTER_SECONDS`: True if ``n`` bytes are free or will be."""
        loop = asyncio.get_running_loop()
        for second_look in (False, True):
            if second_look and self.budget.fits(n):
                return True  # room came back while we waited
            oldest = next((item for item in self._holders.items() if not item[0].done()), None)
            if oldest is None:
                return False  # every holder is on its way out already, for others
            pushed_out, since = oldest
            wait = since + EVICTABLE_AFTER_SECONDS - loop.time()
            if wait <= 0:
                pushed_out.set_result(None)
                return True
            if not second_look:
                await asyncio.sleep(wait)
        return False

    async def _refuse(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"unauthenticated calls are using all of their "
            f"{self.budget.total / 2**20:g} MiB; retry later",
            self._pushback,
        )
