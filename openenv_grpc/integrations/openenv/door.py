"""``serve ... --openenv-port PORT``: OpenEnv's protocol served by the server process
itself, on its own event loop, from its own session core.

:class:`OpenEnvDoor` is a door of :class:`~openenv_grpc.server.app.EnvServer`: it starts
once the gRPC server is up and runs uvicorn on the same loop. Every WebSocket and HTTP
session is a Session stream of the core run in process (:mod:`.streams`), so
the limiter, the idle reaper, the drain, the byte budget and the metrics are the gRPC
port's, with no loopback hop; the token check is the gRPC port's too
(:class:`~openenv_grpc.server.process.auth.TokenAuthInterceptor`). What the door adds at the
connection level (connection cap, silent connections closed, message size, no
permessage-deflate) is :mod:`.gateway_limits`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import uvicorn

from openenv_grpc.integrations.openenv.gateway import OpenEnvGateway
from openenv_grpc.integrations.openenv.gateway_limits import GatewayLimits, uvicorn_settings
from openenv_grpc.server.app import say
from openenv_grpc.v1 import session_pb2 as pb

if TYPE_CHECKING:
    from openenv_grpc.server.app import EnvServer
    from openenv_grpc.server.config import ServerConfig

__all__ = ["GATEWAY_LINE", "OpenEnvDoor"]

log = logging.getLogger("openenv_grpc.gateway")

#: The line the serve process prints once the OpenEnv protocol listens (tests wait for it).
GATEWAY_LINE = "openenv-grpc: OpenEnv protocol on http://{host}:{port} (ws://{host}:{port}/ws)"

#: Seconds uvicorn gets to finish its connections once the sessions have drained.
_SHUTDOWN_SECONDS = 1


class _Uvicorn(uvicorn.Server):
    """uvicorn on a loop it does not own: the server process handles the signals (a
    SIGTERM drains the gRPC port and this door together)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class OpenEnvDoor:
    """OpenEnv's protocol on ``host:port``, for the server it is started with.

    Args:
        host: Where to listen (the gRPC address's host).
        port: The port (0: any free one; the bound one is announced).
        announce: Prints :data:`GATEWAY_LINE` (default: stdout, one write).
    """

    def __init__(self, host: str, port: int, announce: Callable[[str], None] | None = None) -> None:
        self.host = host
        self.port = port
        self._announce = announce or say
        self.gateway: OpenEnvGateway | None = None
        self._server: _Uvicorn | None = None
        self._serving: asyncio.Task[None] | None = None
        self._chores: list[asyncio.Task[None]] = []

    async def start(self, server: EnvServer) -> None:
        """Listen, once ``server`` serves; prints :data:`GATEWAY_LINE`.

        Raises:
            RuntimeError: the port could not be bound.
        """
        config: ServerConfig = server.config
        servicer = server.servicer
        info = await servicer.Info(pb.InfoRequest(), None)  # type: ignore[arg-type]
        limits = GatewayLimits.from_config(config, budget=server.sessions.budget)
        self.gateway = gateway = OpenEnvGateway(
            servicer.run_stream,
            servicer.open_session_view,
            info,
            config.auth_token or None,
            limits,
            limiter=server.sessions.limiter,
        )
        host = self.host.strip("[]")
        uvicorn_config = uvicorn.Config(
            gateway.asgi,
            host=host,
            port=self.port,
            log_level="warning",
            lifespan="off",
            interface="asgi3",
            ws_ping_interval=20.0,
            ws_ping_timeout=20.0,
            timeout_graceful_shutdown=_SHUTDOWN_SECONDS,
            **uvicorn_settings(limits),
        )
        self._server = uvicorn_server = _Uvicorn(uvicorn_config)
        self._serving = serving = asyncio.create_task(uvicorn_server.serve())
        while not uvicorn_server.started:
            if serving.done():  # it could not bind
                with contextlib.suppress(BaseException):
                    serving.result()
                raise RuntimeError(f"cannot listen on {self.host}:{self.port} (--openenv-port)")
            await asyncio.sleep(0.01)
        bound = uvicorn_server.servers[0].sockets[0].getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        self._announce(GATEWAY_LINE.format(host=shown, port=bound))
        self._chores.append(asyncio.create_task(gateway.reap_idle()))

    def stop_accepting(self) -> None:
        """The server drains: no new connections; sockets that end close with 1012."""
        if self.gateway is not None:
            self.gateway.start_draining()
        if self._server is not None:
            for listener in self._server.servers:
                listener.close()

    async def stop(self) -> None:
        """Close what is left (the core has ended every session by now) and stop."""
        for chore in self._chores:
            chore.cancel()
        if self.gateway is not None:
            await self.gateway.close_sockets()
        if self._server is not None and self._serving is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception, asyncio.TimeoutError):
                await asyncio.wait_for(self._serving, _SHUTDOWN_SECONDS + 1.0)


def door_for(port: int, config: ServerConfig) -> OpenEnvDoor:
    """The OpenEnv door ``--openenv-port PORT`` asks for, on the gRPC address's host.

    Raises:
        ValueError: the port is out of range, or with --workers > 1 or TLS.
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"--openenv-port must be from 0 to 65535, got {port}")
    if config.workers > 1:
        raise ValueError(
            "--openenv-port serves from one process: use --workers 1 (OpenEnv's clients "
            "then share that process's capacity), or run one server per port"
        )
    if config.tls_cert:
        raise ValueError("--openenv-port speaks plaintext HTTP: not with TLS (terminate TLS "
                         "in front of it, or use the gRPC port)")  # fmt: skip
    host = config.address.rpartition(":")[0]
    return OpenEnvDoor(host, port)
