"""Server settings: one dataclass, filled from arguments and environment variables.

Precedence: an explicit argument, then the environment variable, then the default.
Nothing is read at import time; :meth:`ServerConfig.from_env` reads the environment when
the server starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["STREAM_HEADROOM", "ServerConfig"]

_INT32_MAX = 2**31 - 1
#: Streams a connection gets beyond the session capacity by default: room for Info,
#: health and reflection calls, and for refused opens on their way out, while one
#: client's connection holds every session.
STREAM_HEADROOM = 32

#: Field name -> environment variable that sets it.
ENV_VARS: dict[str, str] = {
    "host": "HOST",
    "port": "PORT",
    "max_concurrent_envs": "MAX_CONCURRENT_ENVS",
    "idle_timeout": "IDLE_TIMEOUT",
    "grace_period": "GRACE_PERIOD",
    "max_message_bytes": "MAX_MESSAGE_BYTES",
    "env_threads": "ENV_THREADS",
    "retry_pushback_ms": "RETRY_PUSHBACK_MS",
    "keepalive_time": "KEEPALIVE_TIME",
    "keepalive_timeout": "KEEPALIVE_TIMEOUT",
    "step_timeout": "STEP_TIMEOUT",
    "auth_token": "AUTH_TOKEN",
    "tls_cert": "TLS_CERT",
    "tls_key": "TLS_KEY",
    "tls_client_ca": "TLS_CLIENT_CA",
    "metrics_port": "METRICS_PORT",
    "metrics_host": "METRICS_HOST",
    "metrics_token": "METRICS_TOKEN",
    "max_streams_per_connection": "MAX_STREAMS_PER_CONNECTION",
    "max_pending_calls": "MAX_PENDING_CALLS",
    "workers": "WORKERS",
    "isolated": "ISOLATED",
    "reuse_port": "REUSE_PORT",
}


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """How a server listens, admits sessions and reclaims them.

    Attributes:
        host: Address to listen on; ``127.0.0.1`` keeps the server local, ``0.0.0.0`` or
            ``[::]`` exposes it (containers).
        port: TCP port; 0 picks a free one (the chosen port is printed at start).
        max_concurrent_envs: Sessions (= env instances) this process admits at once;
            0 or a negative number means unlimited.
        idle_timeout: Seconds a session may wait for its client's next request before the
            server closes it; 0 disables. Reclaims slots of vanished clients.
        grace_period: Seconds running sessions get to finish after SIGTERM/SIGINT.
        max_message_bytes: Largest message accepted or sent, in bytes.
        env_threads: Threads in the shared pool that runs blocking sync envs.
        retry_pushback_ms: The retry hint sent with RESOURCE_EXHAUSTED.
        keepalive_time: Seconds between HTTP/2 pings to each client; a peer that does not
            answer within ``keepalive_timeout`` is dropped and its sessions closed.
        keepalive_timeout: Seconds to wait for a ping's answer.
        step_timeout: Seconds an env's reset, step or state may take before the client gets
            DEADLINE_EXCEEDED and the env is replaced; 0 uses the env's own
            ``step_timeout`` (none by default). Inline envs cannot be interrupted.
        auth_token: When set, every call but health checks needs the metadata
            ``authorization: Bearer <token>``; others get UNAUTHENTICATED.
        tls_cert: PEM certificate chain file; with ``tls_key``, the server speaks TLS.
        tls_key: PEM private key file.
        tls_client_ca: PEM CA file; when set, clients must present a certificate it
            signed (mutual TLS).
        metrics_port: Port of the Prometheus ``/metrics`` endpoint (on ``metrics_host``);
            -1 turns metrics off, 0 picks a free port (printed at start). With workers,
            worker i serves on ``metrics_port + i``.
        metrics_host: Address of the metrics endpoint: loopback unless told otherwise
            (``0.0.0.0`` for a Prometheus outside the pod), whatever ``host`` is.
        metrics_token: When set, a scrape needs ``authorization: Bearer <metrics_token>``;
            when empty, ``auth_token`` (if set) guards the endpoint instead.
        max_streams_per_connection: HTTP/2 streams (sessions and other calls) one client
            connection may have open at once; 0 (the default) means the session capacity
            plus :data:`STREAM_HEADROOM`, or no limit when the capacity is unlimited.
            gRPC clients queue calls beyond it until one ends, and every channel of a
            process to one target shares a connection, so it must not be below the
            capacity. It bounds what one connection's reset streams cost (rapid reset).
        max_pending_calls: Calls gRPC holds for the server before its handlers pick them
            up; beyond it gRPC itself refuses calls (not the limiter). Must cover the
            largest burst of session opens expected at once; it also bounds what a
            rapid-reset flood over many connections costs.
        workers: Server processes sharing the port (SO_REUSEPORT); the kernel balances
            connections, not streams, so clients open several channels to use them all.
            ``max_concurrent_envs`` is split evenly among them.
        isolated: When > 0, env instances run in this many worker processes instead of
            the server process: a crash in env code ends only the sessions on its worker
            (UNAVAILABLE "session lost") and the worker is replaced.
        reuse_port: 1 lets other server processes bind the same port (SO_REUSEPORT) even
            with one worker, e.g. swarm replicas sharing a host network; the kernel then
            balances connections among them. 0 (the default) makes binding a taken port
            fail loudly. Workers always share their port.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    max_concurrent_envs: int = 1024
    idle_timeout: float = 600.0
    grace_period: float = 25.0
    max_message_bytes: int = 16 * 1024 * 1024
    env_threads: int = field(default_factory=lambda: min(32, (os.cpu_count() or 1) + 4))
    retry_pushback_ms: int = 500
    keepalive_time: float = 30.0
    keepalive_timeout: float = 10.0
    step_timeout: float = 0.0
    auth_token: str = field(default="", repr=False)  # a secret: never printed
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    metrics_port: int = -1
    metrics_host: str = "127.0.0.1"
    metrics_token: str = field(default="", repr=False)  # a secret: never printed
    max_streams_per_connection: int = 0
    max_pending_calls: int = 32768
    workers: int = 1
    isolated: int = 0
    reuse_port: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in -1..65535, got {self.metrics_port}")
        for name in (
            "idle_timeout", "grace_period", "retry_pushback_ms", "step_timeout", "isolated",
            "max_streams_per_connection",
        ):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in (
            "max_message_bytes", "env_threads", "keepalive_time", "keepalive_timeout", "workers",
            "max_pending_calls",
        ):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_streams_per_connection", "max_pending_calls"):
            if getattr(self, name) > _INT32_MAX:  # gRPC channel arguments are C ints
                raise ValueError(f"{name} must be <= {_INT32_MAX}, got {getattr(self, name)}")
        if self.reuse_port not in (0, 1):
            raise ValueError(f"reuse_port must be 0 or 1, got {self.reuse_port}")

    @property
    def capacity(self) -> int:
        """The session cap, with 0 meaning unlimited."""
        return max(self.max_concurrent_envs, 0)

    @property
    def streams_per_connection(self) -> int:
        """The HTTP/2 stream limit per connection, 0 meaning none (see the attribute)."""
        if self.max_streams_per_connection:
            return self.max_streams_per_connection
        return self.capacity + STREAM_HEADROOM if self.capacity else 0

    @property
    def address(self) -> str:
        """``host:port`` as gRPC wants it (IPv6 hosts bracketed)."""
        host = self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{self.port}"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> ServerConfig:
        """Build a config from ``environ`` (default: ``os.environ``), then ``overrides``.

        Overrides whose value is None are ignored, so CLI arguments can be passed as-is.

        Raises:
            ValueError: a variable or override does not parse or is out of range.
        """
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for spec in fields(cls):
            var = ENV_VARS.get(spec.name)
            if var is not None and environ.get(var, "").strip():
                values[spec.name] = _parse(var, environ[var].strip(), spec.type)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _parse(var: str, raw: str, annotation: Any) -> Any:
    kind = {"int": int, "float": float, "str": str}[str(annotation)]
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{var}={raw!r} is not a valid {kind.__name__}") from None
