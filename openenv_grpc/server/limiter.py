"""Admission control: how many sessions a server process holds, and whether it admits any.

Only Session streams pass through here; health, reflection and Info never do. All calls
happen on the server's event loop thread, so plain integers need no lock.
"""

from __future__ import annotations

import asyncio
import enum

__all__ = ["Admission", "SessionLimiter"]


class Admission(enum.Enum):
    """The answer to a request for a session slot."""

    ADMITTED = "admitted"
    FULL = "full"
    DRAINING = "draining"


class SessionLimiter:
    """Counts open sessions against a cap (0 = unlimited) and stops admitting on drain."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(capacity, 0)
        self.active = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    def try_acquire(self) -> Admission:
        """Take a slot if one is free; the caller must :meth:`release` it exactly once."""
        if self.draining:
            return Admission.DRAINING
        if self.capacity and self.active >= self.capacity:
            return Admission.FULL
        self.active += 1
        self._idle.clear()
        return Admission.ADMITTED

    def release(self) -> None:
        """Give back a slot taken by :meth:`try_acquire`."""
        if self.active <= 0:
            raise RuntimeError("SessionLimiter.release() without a matching acquire")
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    def start_draining(self) -> None:
        """Admit nothing from now on; running sessions keep their slots."""
        self.draining = True

    async def wait_idle(self) -> None:
        """Return once no session holds a slot."""
        await self._idle.wait()

    def describe(self) -> str:
        """``"capacity 64/64 sessions"``, as sent with RESOURCE_EXHAUSTED."""
        cap = self.capacity or "unlimited"
        return f"capacity {self.active}/{cap} sessions"
