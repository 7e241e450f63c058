"""What callers without a valid token may make the server buffer: a budget of their own.

grpc-core grants a stream the flow-control window for the whole message its length prefix
announces (up to the request limit) once the server asks to read it, and buffers the
message until it is complete. Before that read it holds at most the stream's first window
(64 KiB, app.py). Health calls are exempt from ``AUTH_TOKEN``, so anyone could announce
a request of the full limit on hundreds of streams and hold each one until the arrival
deadline: 192 health Checks held +3,120 MiB for 10 s (docs/reliability.md, round three).

So the read of an outsider's unary request (health, and Info from a caller without the
token), and of each request on an outsider's reflection stream, first reserves the
request limit from this budget: the grant is by the announced
length, which the server cannot see before it reads, and the server has no per-method
receive limit, so a smaller reservation would not be a bound. When the budget is used up,
a newcomer from a connection that holds none of it takes the place of the oldest read
that has waited at least :data:`EVICTABLE_AFTER_SECONDS`, waiting that long for one (that
call ends ``RESOURCE_EXHAUSTED``): an honest probe's request is in the server's buffers when its
call starts and is read within a turn of the loop, so only a request that is still
arriving is pushed out, and a flood of them cannot keep a probe on a connection of its own
waiting (one connection's burst of streams takes one place, not all). Otherwise the call
is refused at once (``RESOURCE_EXHAUSTED`` with pushback) without a byte read. An
outsider's request must also arrive within :data:`OUTSIDER_ARRIVAL_SECONDS`.

An outsider cannot grow this budget: a token-bearing caller never draws from it, and
nothing else does.
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

#: The longest an outsider's unary request may take to arrive (less if
#: ``--request-arrival-timeout`` says less). Health and Info requests are a few bytes.
OUTSIDER_ARRIVAL_SECONDS = 1.0
#: How long a read must have held its reservation before a newcomer may push it out.
EVICTABLE_AFTER_SECONDS = 0.005

Metadata = Sequence[tuple[str, str | bytes]] | None


class OutsiderBudget:
    """The bytes that reads of outsiders' requests may hold at once.

    ``insider`` tells whether a call's metadata carries a valid token (None: no token is
    configured, so every caller is an outsider).
    """

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
        # Reads holding a reservation, oldest first: the future a newcomer sets to push
        # one out, and when it took its bytes; and how many each connection holds.
        self._holders: dict[asyncio.Future[None], float] = {}
        self._peers: Counter[str] = Counter()

    def is_outsider(self, details: grpc.HandlerCallDetails) -> bool:
        """Whether the call comes without a valid token (always, when none is set)."""
        return self._insider is None or not self._insider(details.invocation_metadata)

    @asynccontextmanager
    async def reading(
        self, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[asyncio.Future[None]]:
        """Hold one read's reservation for the body of the ``async with``; yields a future
        that is done once a newer read has pushed this one out (the read must then end).

        Raises:
            grpc.aio.AbortError: the budget is used up and no read could be pushed out; the
                call ended RESOURCE_EXHAUSTED with a pushback hint, before any of its
                request was read.
        """
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
        """Push out the oldest read that has held its bytes long enough, waiting for it
        to be (at most :data:`EVICTABLE_AFTER_SECONDS`): True if ``n`` bytes are free
        now or will be once it ends; False if no read can be pushed out."""
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
