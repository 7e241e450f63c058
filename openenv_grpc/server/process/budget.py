"""The server's memory budget, by bytes: one account that every buffer of request or
answer bytes held for clients draws from (answers waiting for a slow reader, requests
being read, isolated frames, states and snapshots being gathered).

Per-request limits alone do not bound memory: a few small requests, each within its
limit, can make the server hold gigabytes (docs/reliability.md, round three). So the
sum is bounded here, across every stream of the process: a holder takes bytes before it
keeps them and gives them back when it lets them go. What a holder does when the budget
is short is its own policy (refuse in-band with pushback, or stop reading until bytes come
back); the account itself never blocks and never raises.

All calls happen on the server's event loop (one thread), so there are no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

__all__ = ["ByteBudget"]


class ByteBudget:
    """Bytes a process may hold for its clients at once, and how many it holds now.

    ``take`` and ``give`` must pair up: whoever took ``n`` gives ``n`` back exactly once
    (``try/finally``). A take larger than the whole budget succeeds only when nothing
    else is held, so one legitimate message up to the message limit always gets through
    on an idle server (the limit itself bounds it).
    """

    __slots__ = ("_total", "_used", "_waiters", "peak")

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError(f"a byte budget needs at least 1 byte, got {total}")
        self._total = total
        self._used = 0
        #: The most ever held at once (for tests and /metrics).
        self.peak = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def total(self) -> int:
        """The budget: bytes that may be held at once."""
        return self._total

    @property
    def used(self) -> int:
        """Bytes held now."""
        return self._used

    @property
    def free(self) -> int:
        """Bytes that may still be taken (0 when over, after an oversize take)."""
        return max(0, self._total - self._used)

    @property
    def waiting(self) -> int:
        """Takers waiting for bytes now."""
        return len(self._waiters)

    def fits(self, n: int) -> bool:
        """Whether ``n`` more bytes may be taken now (nobody waiting ahead of them)."""
        return n <= 0 or (not self._waiters and (self._used + n <= self._total or self._used == 0))

    def try_take(self, n: int) -> bool:
        """Take ``n`` bytes if they fit now; False (nothing taken) if they do not."""
        if not self.fits(n):
            return False
        self._add(n)
        return True

    def try_overdraw(self, n: int) -> bool:
        """Take ``n`` bytes into the reserve above the budget (half of it again), ahead of
        any waiter; False (nothing taken) past that. For answers small enough that
        refusing them would stop honest neighbours while stalled streams are ended."""
        if n > 0 and self._used + n > self._total + self._total // 2:
            return False
        self._add(n)
        return True

    def hold(self, n: int) -> None:
        """Count ``n`` bytes that are held already and cannot be refused (a transport's
        buffer of unsent answers): they make later takes wait or fail."""
        self._add(n)

    async def take(self, n: int) -> None:
        """Take ``n`` bytes, waiting (first come, first served) until they fit.

        Raises:
            asyncio.CancelledError: the waiter was cancelled; nothing was taken.
        """
        if self.try_take(n):
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, waiter)
        self._waiters.append(entry)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.give(n)  # granted as we were cancelled: hand it on
            else:
                # Still queued, unless _wake already dropped it as done (cancelled).
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
                self._wake()
            raise

    def give(self, n: int) -> None:
        """Give back ``n`` bytes taken earlier."""
        if n <= 0:
            return
        self._used -= n
        if self._used < 0:  # a holder gave back more than it took: a bug, never hidden
            used, self._used = self._used, 0
            raise AssertionError(f"byte budget gave back {-used} bytes more than taken")
        self._wake()

    def _add(self, n: int) -> None:
        if n > 0:
            self._used += n
            if self._used > self.peak:
                self.peak = self._used

    def _wake(self) -> None:
        waiters = self._waiters
        while waiters:
            n, waiter = waiters[0]
            if waiter.done():
                waiters.popleft()
                continue
            if self._used + n > self._total and self._used != 0:
                return
            waiters.popleft()
            self._add(n)
            waiter.set_result(None)

    def __repr__(self) -> str:
        return f"ByteBudget({self._used}/{self._total} bytes held)"
