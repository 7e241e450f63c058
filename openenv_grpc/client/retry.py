"""Retry-with-backoff for opening a session against a full server."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["OpenRetry"]


@dataclass(frozen=True, slots=True)
class OpenRetry:
    """How often and how patiently to retry a session refused with RESOURCE_EXHAUSTED.

    Each wait is the larger of the server's pushback hint and an exponential backoff
    with full jitter, capped at ``max_backoff``.
    """

    attempts: int = 5
    initial_backoff: float = 0.1
    max_backoff: float = 5.0
    multiplier: float = 2.0

    def delays(self) -> Iterator[float]:
        """Upper bounds of the backoff before each retry (``attempts - 1`` of them)."""
        ceiling = self.initial_backoff
        for _ in range(self.attempts - 1):
            yield min(ceiling, self.max_backoff)
            ceiling *= self.multiplier

    @staticmethod
    def wait(bound: float, pushback: float | None) -> float:
        """The actual sleep: jittered backoff, never shorter than the server's hint."""
        return max(random.uniform(0, bound), pushback or 0.0)
