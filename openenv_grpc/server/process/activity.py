"""What a server process has done since it started, always counted (plain integers on the
event loop), for the Info RPC: steps and sessions without scraping Prometheus.
"""

from __future__ import annotations

import time

from openenv_grpc.server.process.limiter import SessionLimiter
from openenv_grpc.v1 import session_pb2 as pb

__all__ = ["Activity"]


class Activity:
    """Counters fed through the ``Metrics`` calls."""

    __slots__ = ("_started", "sessions_ended", "sessions_refused", "steps")

    def __init__(self) -> None:
        self._started = time.monotonic()
        self.steps = 0
        self.sessions_ended = 0
        self.sessions_refused = 0

    def session_refused(self, reason: str) -> None:
        self.sessions_refused += 1

    def session_ended(self, seconds: float, reason: str) -> None:
        self.sessions_ended += 1

    def step(self, seconds: float) -> None:
        self.steps += 1

    def env_steps(self, count: int, seconds: float) -> None:
        self.steps += count

    def request_error(self, code: str) -> None: ...
    def pool_saturated(self) -> None: ...

    def fill(self, target: pb.Activity, limiter: SessionLimiter) -> None:
        """Write the counters into an Info response's ``activity``; sessions opened are the
        slots ``limiter`` ever admitted (ended + active would count an env held after its
        session ended twice)."""
        target.steps = self.steps
        target.sessions_opened = limiter.admitted
        target.sessions_refused = self.sessions_refused
        target.uptime_seconds = time.monotonic() - self._started
