"""Admission control: how many env instances a server process holds, and whether it
admits new sessions.

Only Session and VectorSession streams pass through here; health, reflection and Info
never do. A vector stream of N envs takes N slots at once, all or nothing: it counts as N
sessions. A slot is taken before a session's env is created and given back when that env
is closed -- which
can be after its session ended: an open cancelled while the factory runs, or an env
abandoned in a hung call, keeps its slot until the factory or the call returns and the
env is closed. So the cap is a hard limit on live envs. All calls happen on the server's
event loop thread, so plain integers need no lock.
"""

from __future__ import annotations

import asyncio
import enum

__all__ = ["Admission", "NoSlot", "SessionLimiter"]


class Admission(enum.Enum):
    """The answer to a request for a session slot."""

    ADMITTED = "admitted"
    FULL = "full"
    DRAINING = "draining"


class NoSlot(Exception):
    """No slot is free for a replacement env; the message says the capacity."""


class SessionLimiter:
    """Counts live envs against a cap (0 = unlimited) and stops admitting on drain."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(capacity, 0)
        self.active = 0
        #: Slots ever admitted (a vector stream of N counts N); only grows. Replacement
        #: envs are not counted: they belong to a session already admitted.
        self.admitted = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        #: Refusals waiting for their client's first request (:meth:`refuse`).

    @property
    def free(self) -> int | None:
        """Slots free now (None: unlimited)."""
        return max(self.capacity - self.active, 0) if self.capacity else None

    def try_acquire(self, count: int = 1) -> Admission:
        """Take ``count`` slots if that many are free (all or none); the caller must
        :meth:`release` them exactly once."""
        if self.draining:
            return Admission.DRAINING
        if self.capacity and self.active + count > self.capacity:
            return Admission.FULL
        self.active += count
        self.admitted += count
        self._idle.clear()
        return Admission.ADMITTED

    def acquire_for_replacement(self, count: int = 1) -> None:
        """Take ``count`` slots for a session's replacement envs (also while draining: the
        session is already admitted); the caller must :meth:`release` them exactly once.

        Raises:
            NoSlot: fewer than ``count`` slots are free.
        """
        if self.capacity and self.active + count > self.capacity:
            raise NoSlot(f"server at {self.describe()} (an env stuck in a call holds its slot)")
        self.active += count
        self._idle.clear()

    def release(self, count: int = 1) -> None:
        """Give back ``count`` slots taken by :meth:`try_acquire`."""
        if self.active < count:
            raise RuntimeError("SessionLimiter.release() without a matching acquire")
        self.active -= count
        if self.active == 0:
            self._idle.set()

    def start_draining(self) -> None:
        """Admit nothing from now on; running sessions keep their slots."""
        self.draining = True

    async def wait_idle(self) -> None:
        """Return once no env holds a slot."""
        await self._idle.wait()

    def describe(self) -> str:
        """``"capacity 64/64 sessions"``, as sent with RESOURCE_EXHAUSTED."""
        cap = self.capacity or "unlimited"
        return f"capacity {self.active}/{cap} sessions"
