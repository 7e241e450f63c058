"""Prometheus metrics of one server process (served by :mod:`.metrics_endpoint`).

A vector stream of N envs counts as N sessions and its steps one per env. Gauges are read
from the limiter and the byte budget when scraped, costing nothing per step.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from openenv_grpc.server.process.budget import ByteBudget
from openenv_grpc.server.process.limiter import SessionLimiter

__all__ = ["NO_METRICS", "ORPHANED_STEPS", "Metrics", "MetricsTee", "PrometheusMetrics"]

_STEP_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
_SESSION_BUCKETS = (0.1, 1.0, 10.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 24 * 3600.0)


class Metrics(Protocol):
    """What the server reports."""

    def session_refused(self, reason: str) -> None: ...
    def session_ended(self, seconds: float, reason: str) -> None: ...
    def step(self, seconds: float) -> None: ...
    def env_steps(self, count: int, seconds: float) -> None: ...
    def request_error(self, code: str) -> None: ...
    def pool_saturated(self) -> None: ...


class _NoMetrics:
    def session_refused(self, reason: str) -> None: ...
    def session_ended(self, seconds: float, reason: str) -> None: ...
    def step(self, seconds: float) -> None: ...
    def env_steps(self, count: int, seconds: float) -> None: ...
    def request_error(self, code: str) -> None: ...
    def pool_saturated(self) -> None: ...


#: The stand-in when metrics are off: the hot path never branches on the setting.
NO_METRICS: Metrics = _NoMetrics()

#: Where a driver counts steps completed after their request was given up (no answer
#: records them); set by ``SessionManager.run`` in the stream's task.
ORPHANED_STEPS: ContextVar[Metrics] = ContextVar("openenv_orphaned_steps", default=NO_METRICS)


class MetricsTee:
    """Reports to two sinks (the always-on activity counters and Prometheus)."""

    __slots__ = ("_first", "_second")

    def __init__(self, first: Metrics, second: Metrics) -> None:
        self._first = first
        self._second = second

    def session_refused(self, reason: str) -> None:
        self._first.session_refused(reason)
        self._second.session_refused(reason)

    def session_ended(self, seconds: float, reason: str) -> None:
        self._first.session_ended(seconds, reason)
        self._second.session_ended(seconds, reason)

    def step(self, seconds: float) -> None:
        self._first.step(seconds)
        self._second.step(seconds)

    def env_steps(self, count: int, seconds: float) -> None:
        self._first.env_steps(count, seconds)
        self._second.env_steps(count, seconds)

    def request_error(self, code: str) -> None:
        self._first.request_error(code)
        self._second.request_error(code)

    def pool_saturated(self) -> None:
        self._first.pool_saturated()
        self._second.pool_saturated()


class PrometheusMetrics:
    """Counters and histograms in their own registry (several servers can share a process)."""

    def __init__(
        self,
        limiter: SessionLimiter,
        env_name: str,
        budget: ByteBudget,
        hung_closes: Callable[[], int],
    ) -> None:
        self.registry = CollectorRegistry()
        labels = {"env": env_name}
        gauges = (
            ("openenv_env_closes_hung", "Env closes given up on at --lifecycle-timeout that "
             "have not returned: their threads are held and their envs keep their slots.",
             hung_closes),
            ("openenv_held_bytes", "Request and answer bytes held for clients now.",
             lambda: budget.used),
            ("openenv_held_bytes_peak", "The most bytes held for clients at once.",
             lambda: budget.peak),
            ("openenv_held_bytes_budget", "Bytes that may be held at once "
             "(--max-held-bytes).", lambda: budget.total),
            ("openenv_sessions_active", "Sessions open now.", lambda: limiter.active),
            ("openenv_sessions_capacity", "Most sessions admitted at once (0 = unlimited).",
             lambda: limiter.capacity),
        )  # fmt: skip
        for name, text, read in gauges:
            gauge = Gauge(name, text, labelnames=["env"], registry=self.registry)
            gauge.labels(**labels).set_function(read)
        self._refused = Counter(
            "openenv_sessions_refused", "Session opens refused, by reason.",
            labelnames=["env", "reason"], registry=self.registry,
        )  # fmt: skip
        self._ended = Histogram(
            "openenv_session_duration_seconds", "How long sessions lived, by how they ended.",
            labelnames=["env", "reason"], buckets=_SESSION_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self._errors = Counter(
            "openenv_request_errors", "In-band request errors, by gRPC code.",
            labelnames=["env", "code"], registry=self.registry,
        )  # fmt: skip
        self._saturated = Counter(
            "openenv_env_pool_saturated",
            "Env calls never run: every env thread was busy until the step timeout passed "
            "(answered RESOURCE_EXHAUSTED in-band, episode unchanged).",
            labelnames=["env"], registry=self.registry,
        ).labels(**labels)  # fmt: skip
        steps = Histogram(
            "openenv_step_seconds", "Time an env step took (the env call only).",
            labelnames=["env"], buckets=_STEP_BUCKETS, registry=self.registry,
        )  # fmt: skip
        # Bound once: labels() is a dict lookup under a lock, too slow for every step.
        self._steps = steps.labels(**labels)
        self._env = env_name

    def session_refused(self, reason: str) -> None:
        self._refused.labels(self._env, reason).inc()

    def session_ended(self, seconds: float, reason: str) -> None:
        self._ended.labels(self._env, reason).observe(seconds)

    def step(self, seconds: float) -> None:
        self._steps.observe(seconds)

    def env_steps(self, count: int, seconds: float) -> None:
        # A vector step: each env step counts, at the call's time shared among them.
        each = seconds / count if count else 0.0
        observe = self._steps.observe
        for _ in range(count):
            observe(each)

    def request_error(self, code: str) -> None:
        self._errors.labels(self._env, code).inc()

    def pool_saturated(self) -> None:
        self._saturated.inc()
