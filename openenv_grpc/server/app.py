"""One server process, assembled and run: the gRPC server and everything around it.

:class:`EnvServer` builds what one process serves with (interceptors, limiter, byte budget,
env pools, session manager, EnvService, health, reflection, ``/metrics``, other doors),
starts it and drains it. :func:`serve` is ``openenv-grpc serve``: one process, or
``--workers`` forked ones, until SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import resource
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from openenv_grpc.metadata import SERVICE_NAME, serving_line
from openenv_grpc.server.config import ENV_VARS, ServerConfig
from openenv_grpc.server.isolated.env_process_pool import EnvProcessPool
from openenv_grpc.server.local.env_threads import EnvThreadPool, Lifecycle
from openenv_grpc.server.local.runner import contain_tasks
from openenv_grpc.server.model.snapshots import KeyRing, SnapshotSeal
from openenv_grpc.server.model.spec import EnvSpec
from openenv_grpc.server.process.activity import Activity
from openenv_grpc.server.process.auth import TokenAuthInterceptor
from openenv_grpc.server.process.budget import ByteBudget
from openenv_grpc.server.process.heap import start_heap_trimmer
from openenv_grpc.server.process.limiter import SessionLimiter
from openenv_grpc.server.process.metrics import PrometheusMetrics
from openenv_grpc.server.process.metrics_endpoint import MetricsEndpoint
from openenv_grpc.server.process.orphans import reclaim_orphans_quietly
from openenv_grpc.server.process.outsiders import OutsiderBudget
from openenv_grpc.server.process.request_deadline import UnaryRequestDeadline
from openenv_grpc.server.process.tls import server_credentials
from openenv_grpc.server.process.workers import serve_workers
from openenv_grpc.server.service import EnvServicer, add_env_service
from openenv_grpc.server.stream.session import SessionManager

__all__ = ["Door", "EnvServer", "serve"]

log = logging.getLogger(__name__)

#: The HTTP/2 flow-control window of each stream the server receives on.
STREAM_WINDOW_BYTES = 64 * 1024
#: How long a call may wait for the application before gRPC cancels it (its default: 30).
_MAX_UNREQUESTED_SECONDS = 3600
#: File descriptors kept from connections (env processes, files, the metrics port).
_FD_RESERVE_FRACTION = 8
_FD_RESERVE_MIN = 256


def raise_fd_limit() -> int:
    """Raise the open-file soft limit to the hard limit; returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):  # not allowed here: keep what we have
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft


def connection_limit(config: ServerConfig) -> int:
    """``max_connections``, else the open-file limit less its reserve (at least 1)."""
    if config.max_connections:
        return config.max_connections
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 2**31 - 2
    return max(1, soft - max(_FD_RESERVE_MIN, soft // _FD_RESERVE_FRACTION))


def grpc_options(config: ServerConfig) -> list[tuple[str, Any]]:
    """Channel arguments: message limits, keepalive, and the bounds on what a hostile
    HTTP/2 peer can make the server hold (docs/reliability.md, "Hostile HTTP/2")."""
    keepalive_timeout_ms = int(config.keepalive_timeout * 1000)
    options: list[tuple[str, Any]] = [
        # What one stalled sender can pin per stream (grpc-core buffers a whole message).
        ("grpc.max_receive_message_length", config.request_limit),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", int(config.keepalive_time * 1000)),
        ("grpc.keepalive_timeout_ms", keepalive_timeout_ms),
        # grpc-core drops an unanswered ping after this (60 s by default), not keepalive's.
        ("grpc.http2.ping_timeout_ms", keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        # Off unless shared on purpose, so that binding a taken port fails loudly.
        ("grpc.so_reuseport", 1 if config.workers > 1 or config.reuse_port else 0),
        # Past its default 1,000 gRPC cancels waiting calls at random (soft = hard: never).
        ("grpc.server.max_pending_requests", config.pending_calls),
        ("grpc.server.max_pending_requests_hard_limit", config.pending_calls),
        # Not 30 s: the client's deadline decides how long a call waits for a handler.
        ("grpc.server_max_unrequested_time_in_server", _MAX_UNREQUESTED_SECONDS),
        # What a client that never reads its answers can park per stream (BDP: 32 MiB).
        ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.server_handshake_timeout_ms", int(config.handshake_timeout * 1000)),
        ("grpc.max_allowed_incoming_connections", connection_limit(config)),
    ]
    streams = config.streams_per_connection
    if streams:
        # Reset streams count until let go: bounds what one connection's resets hold.
        options.append(("grpc.max_concurrent_streams", streams))
    return options


class Door(Protocol):
    """Another protocol's listener on the same sessions (``--openenv-port``): started once
    the gRPC port serves (RuntimeError: cannot bind), told to stop accepting when the drain
    begins, and stopped once the sessions have drained."""

    async def start(self, server: EnvServer) -> None: ...
    def stop_accepting(self) -> None: ...
    async def stop(self) -> None: ...


class EnvServer:
    """One gRPC server hosting one environment; start it, then drain it. ``keys`` sign
    snapshots (default: the config's). TypeError: unusable env; ValueError, OSError: bad keys."""

    def __init__(
        self,
        factory: Callable[[], Any],
        config: ServerConfig | None = None,
        keys: KeyRing | None = None,
        doors: Sequence[Door] = (),
    ) -> None:
        self.config = config or ServerConfig.from_env()
        self._doors = tuple(doors)
        self.spec = EnvSpec.from_factory(
            factory, inline_threshold=self.config.inline_threshold_ms / 1000
        )
        limit = getattr(self.spec.env_class, "max_sessions", None)
        if limit is not None and not 0 < self.config.capacity <= limit:
            # The env's own bound (an OpenEnv env that is not concurrency-safe: 1).
            self.config = dataclasses.replace(self.config, max_concurrent_envs=limit)
        keys = keys if keys is not None else KeyRing.from_config(self.config)
        self.snapshots = SnapshotSeal(
            self.spec.name, self.spec.version, keys, self.config.snapshot_limit
        )
        self._pool = EnvThreadPool(self.config.env_threads, "openenv-env")
        # Pools of their own: a fresh env never waits behind hung calls or closes.
        threads = self.config.env_threads
        self._lifecycle = Lifecycle(
            EnvThreadPool(threads, "openenv-env-create", spare=threads),
            EnvThreadPool(threads, "openenv-env-close", spare=threads),
            self.config.lifecycle_timeout or None,
        )
        self._server: grpc.aio.Server | None = None
        self._health: health_aio.HealthServicer | None = None
        self._sessions: SessionManager | None = None
        self._servicer: EnvServicer | None = None
        self._processes: EnvProcessPool | None = None
        self.port = 0
        self.metrics_port: int | None = None
        self._metrics_endpoint: MetricsEndpoint | None = None

    @property
    def sessions(self) -> SessionManager:
        if self._sessions is None:
            raise RuntimeError("the server has not started")
        return self._sessions

    @property
    def servicer(self) -> EnvServicer:
        if self._servicer is None:
            raise RuntimeError("the server has not started")
        return self._servicer

    async def start(self) -> int:
        """Bind, serve and return the bound port. RuntimeError: cannot bind; ValueError,
        OSError: bad TLS settings or files, or the env's ``check_settings`` refused."""
        credentials = server_credentials(self.config)  # before binding: bad files fail early
        raise_fd_limit()  # before the options: the connection limit follows it
        self.spec.env_class.check_settings()  # the env's own settings, before any session
        await asyncio.to_thread(reclaim_orphans_quietly, self.spec.env_class)
        # Auth first: a refused call is never read.
        auth = TokenAuthInterceptor(self.config.auth_token) if self.config.auth_token else None
        interceptors: list[grpc.aio.ServerInterceptor] = [auth] if auth else []
        outsiders = OutsiderBudget(
            self.config.outsider_held_bytes, self.config.request_limit,
            auth.allows if auth else None, self.config.retry_pushback_ms,
        )  # fmt: skip
        interceptors.append(UnaryRequestDeadline(self.config.request_arrival_timeout, outsiders))
        limiter = SessionLimiter(self.config.capacity)
        budget = ByteBudget(self.config.max_held_bytes)
        prometheus: PrometheusMetrics | None = None
        if self.config.metrics_port >= 0:
            lifecycle = self._lifecycle
            prometheus = PrometheusMetrics(
                limiter, self.spec.name, budget, hung_closes=lambda: lifecycle.closes_hung
            )
            token = self.config.metrics_token or self.config.auth_token
            self._metrics_endpoint = MetricsEndpoint(prometheus.registry, token)
            host = self.config.metrics_host.strip("[]")
            self.metrics_port = await self._metrics_endpoint.start(host, self.config.metrics_port)
        if self.config.isolated:
            call_timeout = self.config.call_timeout(self.spec.env_class.step_timeout)
            self._processes = EnvProcessPool(
                self.spec.factory, self.config.isolated, call_timeout,
                max_env_bytes=self.config.max_env_bytes, budget=budget,
            )  # fmt: skip
            self._processes.start()
        self._sessions = SessionManager(
            self.spec, self.config, self._pool, limiter,
            activity=Activity(), prometheus=prometheus, lifecycle=self._lifecycle,
            snapshots=self.snapshots, budget=budget,
        )  # fmt: skip
        server = grpc.aio.server(options=grpc_options(self.config), interceptors=interceptors)
        self._servicer = EnvServicer(self._sessions, self._processes)
        add_env_service(self._servicer, server)
        self._health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        health = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        reflection.enable_server_reflection([SERVICE_NAME, health, reflection.SERVICE_NAME], server)
        try:
            if credentials is None:
                self.port = server.add_insecure_port(self.config.address)
            else:
                self.port = server.add_secure_port(self.config.address, credentials)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot listen on {self.config.address}: {exc}") from exc
        await server.start()
        start_heap_trimmer()
        self._server = server
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._sessions.start()
        for door in self._doors:
            await door.start(self)
        return self.port

    async def drain(self, grace: float | None = None) -> int:
        """Report NOT_SERVING, let running sessions finish within ``grace`` s (default:
        the config's), close every env, stop the server; returns the number of envs stuck
        in env code (left to the process exit). At most grace + ``CLOSE_BUDGET`` + 0.5 s."""
        if self._server is None or self._health is None or self._sessions is None:
            return 0
        grace = self.config.grace_period if grace is None else grace
        await self._health.enter_graceful_shutdown()
        for door in self._doors:
            door.stop_accepting()
        if self._processes is not None:
            self._processes.start_draining(grace)  # hung calls cannot outlast the grace
        stuck = await self._sessions.drain(grace)
        for door in self._doors:
            await door.stop()
        # Every stream has ended: this only bounds what is still being sent.
        await self._server.stop(grace=0.5)
        self._server = None
        if self._processes is not None:
            self._processes.stop()
        if self._metrics_endpoint is not None:
            await self._metrics_endpoint.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._lifecycle.shutdown(wait=False, cancel_futures=True)
        return stuck

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


def say(line: str) -> None:
    """One status line on stdout in one write: workers sharing the pipe never interleave."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"{line}\n".encode())


def _announce(name: str, host: str, port: int) -> None:
    # Tests and tools wait for this line; it carries the port actually bound.
    say(serving_line(name, host, port))


async def _serve(
    factory: Callable[[], Any],
    config: ServerConfig,
    keys: KeyRing,
    on_ready: Callable[[str, str, int], None] = _announce,
    doors: Sequence[Door] = (),
) -> int:
    """Serve until SIGTERM/SIGINT, then drain; returns the number of envs left unclosed."""
    server = EnvServer(factory, config, keys, doors)
    # Handlers first: a SIGTERM as soon as the server is up must drain it.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    contain_tasks(loop)  # env code's own tasks cannot stop the loop
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    port = await server.start()
    host = config.address.rpartition(":")[0]
    if server.metrics_port is not None:
        metrics_host = config.metrics_host
        if ":" in metrics_host and not metrics_host.startswith("["):
            metrics_host = f"[{metrics_host}]"
        say(f"openenv-grpc: metrics on http://{metrics_host}:{server.metrics_port}/metrics")
    on_ready(server.spec.name, host, port)
    await stop.wait()
    log.info("signal received: draining (grace %.1fs)", config.grace_period)
    stuck = await server.drain()
    left = f"{stuck} environment(s) stuck in env code left unclosed" if stuck else ""
    say(f"openenv-grpc: drained, {left or 'every environment closed'}")
    return stuck


def serve(
    factory: Callable[[], Any], config: ServerConfig | None = None, doors: Sequence[Door] = ()
) -> int:
    """Serve ``factory``'s environment until SIGTERM or SIGINT, then drain; returns the
    exit code. Forks ``workers > 1`` (``doors``: one process only). Raises as EnvServer."""
    config = config or ServerConfig.from_env()
    spec = EnvSpec.from_factory(factory)  # fail before forking
    # Once, before any fork: workers share the ring; env code never inherits the secrets.
    keys = KeyRing.from_config(config)
    os.environ.pop(ENV_VARS["snapshot_keys"], None)
    if config.workers > 1:

        def run_worker(worker: ServerConfig, on_ready: Callable[[], None]) -> None:
            # The parent announces the server; workers end with os._exit.
            asyncio.run(_serve(factory, worker, keys, lambda *_: on_ready()))

        def announce(port: int) -> None:
            host = config.address.rpartition(":")[0]
            say(serving_line(spec.name, host, port, f" with {config.workers} workers"))

        return serve_workers(run_worker, config, announce)
    if asyncio.run(_serve(factory, config, keys, doors=doors)):
        # Envs stuck in env code: a normal exit would join their non-daemon threads until
        # Docker or Kubernetes SIGKILLs us.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
