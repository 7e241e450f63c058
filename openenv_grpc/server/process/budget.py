"""The server's memory budget: one account of the request and answer bytes held for all
clients at once (per-request limits alone let a few requests hold gigabytes).

A holder takes bytes before it keeps them and gives them back when it lets them go; what it
does when the budget is short is its own policy. The account never blocks (but
:meth:`ByteBudget.take`) and never raises. Event-loop only, so no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

__all__ = ["ByteBudget"]


class ByteBudget:
    """Bytes a process may hold for its clients at once. Whoever took ``n`` gives ``n``
    back exactly once. A take larger than the budget succeeds only when nothing else is
    held, so one message up to the message limit always gets through on an idle server."""

    __slots__ = ("_total", "_used", "_waiters", "peak")

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError(f"a byte budget needs at least 1 byte, got {total}")
        self._total = total
        self._used = 0
        #: The most ever held at once.
        self.peak = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def total(self) -> int:
        return self._total

    @property
    def used(self) -> int:
        return self._used

    @property
    def free(self) -> int:
        """Bytes that may still be taken (0 when over, after an oversize take)."""
        return max(0, self._total - self._used)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def fits(self, n: int) -> bool:
        """Whether ``n`` more bytes may be taken now (nobody waiting ahead of them)."""
        return n <= 0 or (not self._waiters and (self._used + n <= self._total or self._used == 0))

    def try_take(self, n: int) -> bool:
        """Take ``n`` bytes if they fit now; False (nothing taken) if they do not. (As
        :meth:`fits` then :meth:`_add`, written out: it runs for every message.)"""
        if n <= 0:
            return True
        used = self._used + n
        if self._waiters or (used > self._total and self._used != 0):
            return False
        self._used = used
        if used > self.peak:
            self.peak = used
        return True

    def try_overdraw(self, n: int) -> bool:
        """Take ``n`` bytes into the reserve above the budget (half of it again), ahead of
        any waiter; False (nothing taken) past that."""
        if n > 0 and self._used + n > self._total + self._total // 2:
            return False
        self._add(n)
        return True

    def hold(self, n: int) -> None:
        """Count ``n`` bytes held already that cannot be refused (unsent answers)."""
        self._add(n)

    async def take(self, n: int) -> None:
        """Take ``n`` bytes, waiting (first come, first served) until they fit; a
        cancelled take has taken nothing."""
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
        if n <= 0:
            return
        self._used -= n
        if self._used < 0:  # a holder gave back more than it took: a bug, never hidden
            used, self._used = self._used, 0
            raise AssertionError(f"byte budget gave back {-used} bytes more than taken")
        if self._waiters:
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
