"""What a server process has done since it started, kept whatever the metrics setting.

The Info RPC reports these counters, so a console or dashboard can show steps per second
and sessions without scraping Prometheus. Counting is a plain integer increment on the
event loop thread (no lock), cheap enough to be always on.
"""

from __future__ import annotations

import time

from openenv_grpc.server.process.limiter import SessionLimiter
from openenv_grpc.v1 import session_pb2 as pb

__all__ = ["Activity"]


class Activity:
    """Counters fed through the :class:`~openenv_grpc.server.process.metrics.Metrics` calls."""

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

    def request_error(self, code: str) -> None:
        pass

    def pool_saturated(self) -> None:
        pass

    def fill(self, target: pb.Activity, limiter: SessionLimiter) -> None:
        """Write the counters into an Info response's ``activity``. Sessions opened are
        the slots ``limiter`` ever admitted, counted once at admission: not ended + active,
        which counts twice an env still held after its session ended (abandoned in a hung
        call, its client gone), and so went down once that env was closed."""
        target.steps = self.steps
        target.sessions_opened = limiter.admitted
        target.sessions_refused = self.sessions_refused
        target.uptime_seconds = time.monotonic() - self._started
