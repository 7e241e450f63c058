"""The OpenEnv door's bounds at the connection level: how many connections, how long one
may stay silent, how large a WebSocket message may grow (issue 37).

uvicorn leaves a connection that never sends a request open forever, and buffers a
fragmented WebSocket message as one Python ``bytes`` object per fragment (about 7 bytes
of memory per wire byte for 1-byte fragments). The two protocol classes here close the
first and assemble the second in one ``bytearray``; uvicorn's own settings (made by
:func:`uvicorn_settings`) cap the message size (close 1009) and turn permessage-deflate
off, so a compressed frame is a protocol error (close 1002) and never inflated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import resource
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

__all__ = ["GatewayLimits", "uvicorn_settings"]

#: What the door's largest message is when the server names none (gRPC's usual 4 MiB).
DEFAULT_REQUEST_BYTES = 4 * 1024 * 1024

#: File descriptors always left to the gRPC port, env processes, logs and health checks.
MIN_RESERVED_FDS = 256


def fd_limit() -> int:
    """The process's soft limit on open files (``ulimit -n``)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def default_max_connections(limit: int | None = None) -> int:
    """Connections the door may hold at once: the fd limit less a reserve of a quarter
    (at least :data:`MIN_RESERVED_FDS`), so the OpenEnv port can never take the fds the
    gRPC port needs; at least 16."""
    limit = fd_limit() if limit is None else limit
    return max(16, limit - max(MIN_RESERVED_FDS, limit // 4))


@dataclasses.dataclass(frozen=True)
class GatewayLimits:
    """The door's bounds, read off the server's settings.

    Attributes:
        request_bytes: Largest WebSocket message and ``/mcp`` body (``--max-request-bytes``).
        arrival_timeout: Seconds a connection may take to send a request's head, and a
            ``/mcp`` body to arrive (``--request-arrival-timeout``).
        idle_timeout: Seconds a WebSocket or a held ``/mcp`` session may stay silent
            (``--idle-timeout``; 0: forever).
        grace: Seconds WebSockets get once the server drains (``--grace``).
        max_connections: Connections held at once; more are closed as they are accepted.
    """

    request_bytes: int = DEFAULT_REQUEST_BYTES
    arrival_timeout: float = 10.0
    idle_timeout: float = 600.0
    grace: float = 25.0
    max_connections: int = dataclasses.field(default_factory=default_max_connections)

    @classmethod
    def from_config(cls, config: Any) -> GatewayLimits:
        """The limits of a :class:`~openenv_grpc.server.config.ServerConfig`."""
        return cls(
            request_bytes=config.request_limit,
            arrival_timeout=config.request_arrival_timeout,
            idle_timeout=config.idle_timeout,
            grace=config.grace_period,
        )


class _BoundedHttp(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, with a cap on connections at accept and a deadline for
    each request's head (a connection that sends nothing is closed)."""

    limits: GatewayLimits = GatewayLimits()
    _deadline: asyncio.TimerHandle | None = None
    _armed_for: Any = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            transport.abort()  # the fd goes at once: the gRPC port keeps its share
            self.transport = transport
            return
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        if getattr(self, "flow", None) is None:  # closed at accept: never made
            return
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # the next request's head has the same deadline

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._armed_for = self.cycle
        self._deadline = self.loop.call_later(self.limits.arrival_timeout, self._expire)

    def _expire(self) -> None:
        self._deadline = None
        if self.transport.get_protocol() is not self:  # upgraded to a WebSocket
            return
        if self.cycle is self._armed_for:  # no request began since the deadline was set
            self.transport.close()


class _BoundedWebSocket(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol assembling a fragmented message in one ``bytearray``
    (one byte of memory per byte received); its size is capped by websockets itself."""

    _parts: bytearray | None = None

    def handle_text(self, event: Any) -> None:
        self.curr_msg_data_type = "text"
        self._start(event)

    def handle_bytes(self, event: Any) -> None:
        self.curr_msg_data_type = "bytes"
        self._start(event)

    def _start(self, event: Any) -> None:
        if event.fin:
            self._parts = None
            self.frames = [event.data]
            self.send_receive_event_to_app()
        else:
            self._parts = bytearray(event.data)

    def handle_cont(self, event: Any) -> None:
        if self._parts is None:  # websockets refuses a continuation with nothing begun
            return
        self._parts += event.data
        if event.fin:
            self.frames, self._parts = [bytes(self._parts)], None
            self.send_receive_event_to_app()


def uvicorn_settings(limits: GatewayLimits) -> dict[str, Any]:
    """The ``uvicorn.Config`` keywords that enforce ``limits``."""
    http = type("BoundedHttp", (_BoundedHttp,), {"limits": limits})
    return {
        "http": http,
        "ws": _BoundedWebSocket,
        "ws_max_size": limits.request_bytes,
        "ws_per_message_deflate": False,  # no inflation: what arrives is what is held
        "timeout_keep_alive": max(1, min(5, int(limits.arrival_timeout))),
        "h11_max_incomplete_event_size": 16 * 1024,
    }
