"""Admission control: how many env instances a server process holds, and whether it
admits new sessions (Session and VectorSession streams only).

A vector stream of N envs takes N slots, all or nothing. A slot is taken before an env is
created and given back when that env is closed, which can be after its session ended (a
cancelled open, a hung call), so the cap is a hard limit on live envs. Event-loop only.
"""

from __future__ import annotations

import asyncio
import enum

__all__ = ["Admission", "NoSlot", "SessionLimiter"]


class Admission(enum.Enum):
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
        #: Slots ever admitted (replacement envs not counted); only grows.
        self.admitted = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def free(self) -> int | None:
        """Slots free now (None: unlimited)."""
        return max(self.capacity - self.active, 0) if self.capacity else None

    def try_acquire(self, count: int = 1) -> Admission:
        """Take ``count`` slots if that many are free (all or none); release them once."""
        if self.draining:
            return Admission.DRAINING
        if self.capacity and self.active + count > self.capacity:
            return Admission.FULL
        self.active += count
        self.admitted += count
        self._idle.clear()
        return Admission.ADMITTED

    def acquire_for_replacement(self, count: int = 1) -> None:
        """Take ``count`` slots for a session's replacement envs, also while draining
        (NoSlot: fewer are free); release them once."""
        if self.capacity and self.active + count > self.capacity:
            raise NoSlot(f"server at {self.describe()} (an env stuck in a call holds its slot)")
        self.active += count
        self._idle.clear()

    def release(self, count: int = 1) -> None:
        if self.active < count:
            raise RuntimeError("SessionLimiter.release() without a matching acquire")
        self.active -= count
        if self.active == 0:
            self._idle.set()

    def start_draining(self) -> None:
        self.draining = True

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def describe(self) -> str:
        """``"capacity 64/64 sessions"``, as sent with RESOURCE_EXHAUSTED."""
        cap = self.capacity or "unlimited"
        return f"capacity {self.active}/{cap} sessions"
