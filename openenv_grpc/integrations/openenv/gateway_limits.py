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
import contextlib
import dataclasses
import logging
import resource
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from openenv_grpc.server.process.budget import ByteBudget
from openenv_grpc.server.stream.session import STALLED_AFTER

log = logging.getLogger("openenv_grpc.gateway")

#: Reads this small may use the byte budget's reserve (a neighbour's ordinary frames go
#: on while stalled connections are closed): the session core's rule for small answers.
SMALL_BYTES = _SMALL = 64 * 1024
#: Messages one connection's app may take in a row before the others get the loop: a
#: client that pipelines thousands of frames in one read does not stall its neighbours.
_BURST = 16
#: Bytes of one read parsed at a time. Once a message waits for the app, the rest of the
#: read stays unparsed (a byte of memory per byte, on the budget) until the app takes it:
#: a read of 256 KiB of tiny frames was 14,000+ queued messages, ~5 bytes of memory per
#: byte received, parsed in one call that held the loop ~0.3 s.
_PARSE_CHUNK = 4 * 1024
#: Seconds a peer has to answer our close frame before its connection is dropped (uvicorn:
#: 10, which let refused sockets hold a connection slot and keep sending for that long).
_CLOSE_TIMEOUT = 1.0
#: Connections waiting to be accepted: each accept turn takes at most this many, so the
#: connection cap is overshot by at most this many fds for a moment.
LISTEN_BACKLOG = 128

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
        response_bytes: Largest answer to one call of a session (``--max-message-bytes``,
            as for a gRPC answer).
        max_connections: Connections held at once; more are closed as they are accepted.
        budget: The server's byte budget (``--max-held-bytes``): what the door holds of
            clients' bytes (bodies and messages arriving, answers a client has not
            taken) is drawn from it. None: uncounted (a door without a server).
    """

    request_bytes: int = DEFAULT_REQUEST_BYTES
    arrival_timeout: float = 10.0
    idle_timeout: float = 600.0
    grace: float = 25.0
    response_bytes: int = DEFAULT_REQUEST_BYTES
    max_connections: int = dataclasses.field(default_factory=default_max_connections)
    budget: ByteBudget | None = None

    @classmethod
    def from_config(cls, config: Any, budget: ByteBudget | None = None) -> GatewayLimits:
        """The limits of a :class:`~openenv_grpc.server.config.ServerConfig`, drawing
        from ``budget``."""
        return cls(
            request_bytes=config.request_limit,
            arrival_timeout=config.request_arrival_timeout,
            idle_timeout=config.idle_timeout,
            grace=config.grace_period,
            response_bytes=config.max_message_bytes,
            budget=budget,
        )


class _Unsent:
    """Answers a connection's client has not taken: what its transport holds past the
    high-water mark is counted against the byte budget while it is paused, and a client
    that takes nothing for :data:`STALLED_AFTER` seconds while the budget is spent loses
    its connection (the session core's rule for a stalled stream)."""

    __slots__ = ("budget", "held", "stall", "transport")

    def __init__(self) -> None:
        self.held = 0
        self.budget: ByteBudget | None = None
        self.stall: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None

    def hold(self, transport: asyncio.Transport, budget: ByteBudget | None) -> None:
        if budget is None or self.held:
            return
        self.held = transport.get_write_buffer_size()
        self.budget, self.transport = budget, transport
        budget.hold(self.held)  # they exist already: counted, never refused
        self.stall = asyncio.get_running_loop().call_later(STALLED_AFTER, self._stalled)

    def give(self) -> None:
        if self.stall is not None:
            self.stall.cancel()
            self.stall = None
        if self.budget is not None and self.held:
            self.budget.give(self.held)
            self.held = 0

    def _stalled(self) -> None:
        self.stall = None
        budget, transport = self.budget, self.transport
        if budget is None or transport is None or not self.held:
            return
        if budget.used <= budget.total:  # nobody needs the bytes: wait on
            self.stall = asyncio.get_running_loop().call_later(STALLED_AFTER / 4, self._stalled)
            return
        log.warning(
            "closing an OpenEnv connection whose client took no answer for %.0fs while the "
            "byte budget is spent: %d bytes unsent", STALLED_AFTER, self.held,
        )  # fmt: skip
        transport.abort()


class _CountsUnsent:
    """What both protocols share: while the transport is paused (its buffer past the
    high-water mark), the answers in it are counted in :class:`_Unsent`."""

    limits: GatewayLimits
    transport: Any
    _unsent: _Unsent

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        self._unsent.hold(self.transport, self.limits.budget)

    def resume_writing(self) -> None:
        super().resume_writing()  # type: ignore[misc]
        self._unsent.give()


class _BoundedHttp(_CountsUnsent, H11Protocol):
    """uvicorn's HTTP/1.1 protocol, with a cap on connections at accept and a deadline for
    each request's head (a connection that sends nothing is closed)."""

    limits: GatewayLimits = GatewayLimits()
    _deadline: asyncio.TimerHandle | None = None
    _armed_for: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._unsent = _Unsent()

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
        self._unsent.give()
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


class _BoundedWebSocket(_CountsUnsent, WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol assembling a fragmented message in one ``bytearray``
    (one byte of memory per byte received); its size is capped by websockets itself.

    What a connection holds of its client's bytes is drawn from the server's byte budget:
    bytes received until the app takes the message they make (uvicorn queues one message
    and stops reading), and answers its client has not taken (what the transport buffers
    past its high-water mark). Bytes that do not fit close the connection (1013, try
    again later); small reads may use the budget's reserve, as small gRPC answers do. A
    client that takes no answer for :data:`STALLED_AFTER` seconds while the budget is
    spent is disconnected, as a stalled gRPC stream is ended.
    """

    limits: GatewayLimits = GatewayLimits()
    _parts: bytearray | None = None
    #: Bytes received and not yet taken by the app.
    _arriving = 0
    #: Bytes received after our close frame (the peer's close is a few bytes).
    _after_close = 0
    #: Messages taken in a row without waiting for one (a pipelining client).
    _taken = 0
    #: Bytes received and not yet parsed: what came after a message the app has not taken
    #: or after a chunk of control frames.
    _backlog: bytearray | None = None
    #: Control frames handled since the parse of a read began.
    _control = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._unsent = _Unsent()
        self.close_timeout = _CLOSE_TIMEOUT

    def data_received(self, data: bytes) -> None:
        if self.close_sent:  # closing: nothing more is read, nothing counted
            self._after_close += len(data)
            if self._after_close > _SMALL:
                self.transport.abort()
                return
            super().data_received(data)
            return
        budget = self.limits.budget
        if budget is not None and data:
            size = len(data)
            if not (budget.try_take(size) or (size <= _SMALL and budget.try_overdraw(size))):
                self._refuse_bytes(budget, size)
                return
            self._arriving += size
        self._parse(data)
        self._settle()

    def _parse(self, data: bytes) -> None:
        """Parse ``data`` a chunk at a time. Once a message waits for the app, the rest is
        kept for :meth:`receive`; once a chunk held control frames (each a ping answered
        here, no message), for the loop's next turn (:meth:`_resume`). Reading stays
        paused while any is kept."""
        if self._backlog is not None:  # older bytes first
            self._backlog += data
            return
        self._control = 0
        if len(data) <= _PARSE_CHUNK:  # most reads: one frame
            super().data_received(data)
            return
        for start in range(0, len(data), _PARSE_CHUNK):
            if start and (self._control or not self.queue.empty()):
                self._backlog = bytearray(data[start:])
                if not self.read_paused:
                    self.read_paused = True
                    self.transport.pause_reading()
                if self.queue.empty():
                    self.loop.call_soon(self._resume_and_settle)
                return
            super().data_received(data[start : start + _PARSE_CHUNK])
            if self.transport.is_closing():
                return

    def _resume(self) -> None:
        """Parse on what was kept, unless a message waits for the app (then this runs again
        once :meth:`receive` has taken it); reading stays paused while bytes are kept."""
        backlog = self._backlog
        if backlog is None or self.transport.is_closing() or not self.queue.empty():
            return
        self._backlog = None
        self._parse(bytes(backlog))
        if self._backlog is not None:
            if not self.read_paused:  # uvicorn resumes reading once the queue is empty
                self.read_paused = True
                self.transport.pause_reading()
        elif self.read_paused and self.queue.qsize() <= 1:
            self.read_paused = False
            self.transport.resume_reading()

    def _resume_and_settle(self) -> None:
        self._resume()
        self._settle()

    def _settle(self) -> None:
        """Give back to the budget the bytes that made no message: once nothing waits for
        the app, what is held is only a frame or message still arriving and the kept
        bytes (a read of pings held its bytes until the socket's next message)."""
        if self.queue.empty():
            self._give_back()

    def _give_back(self) -> None:
        """Hold on the budget only what is still arriving or kept unparsed."""
        budget = self.limits.budget
        kept = len(self.conn.reader.buffer) + len(self._parts or b"") + len(self._backlog or b"")
        if budget is not None and self._arriving > kept:
            budget.give(self._arriving - kept)
            self._arriving = kept

    def handle_ping(self) -> None:
        self._control += 1
        super().handle_ping()

    def handle_pong(self, event: Any) -> None:
        self._control += 1
        super().handle_pong(event)

    async def receive(self) -> Any:
        # The next request is taken once the last answer has left (the transport is below
        # its high-water mark): one answer in flight, as on a gRPC Session. A client that
        # never reads is closed by _stalled.
        await self.writable.wait()
        if self.handshake_complete and self.transport.is_closing():
            # Gone (a reset, our close): what it queued is never answered (thousands of
            # frames of one read would each be written to a dead transport, each logged).
            return {"type": "websocket.disconnect", "code": 1006}
        if self._taken >= _BURST:  # let the other connections have the loop
            self._taken = 0
            await asyncio.sleep(0)
        queue = self.queue
        if queue.empty():
            self._taken = 0
        else:
            self._taken += 1
        # uvicorn's receive, inline (a coroutine less a message; a test pins its source)
        event = await queue.get()
        if self.read_paused and queue.empty():
            self.read_paused = False
            self.transport.resume_reading()
        if self._backlog is not None:
            self._resume()  # parse on to the next message
        if self._arriving:
            self._give_back()  # the app holds the message now
        return event

    async def send(self, message: Any) -> None:
        if message["type"] == "websocket.close" and not self.writable.is_set():
            # The client takes nothing: a close frame would wait for ever behind the
            # answers it has not taken (a drain, an idle socket). The connection goes.
            self.transport.abort()
            return
        await super().send(message)
        if message["type"] == "websocket.close" and self.close_timer is not None:
            # uvicorn's timer closes gracefully, which waits for unsent bytes to leave.
            self.close_timer.cancel()
            self.close_timer = self.loop.call_later(self.close_timeout, self.transport.abort)

    def connection_lost(self, exc: Exception | None) -> None:
        self._backlog = None
        budget = self.limits.budget
        if budget is not None and self._arriving:
            budget.give(self._arriving)
            self._arriving = 0
        self._unsent.give()
        super().connection_lost(exc)

    def _refuse_bytes(self, budget: ByteBudget, size: int) -> None:
        log.warning(
            "closing an OpenEnv WebSocket: %d more bytes do not fit the byte budget "
            "(%d of %d held, --max-held-bytes)", size, budget.used, budget.total,
        )  # fmt: skip
        with contextlib.suppress(Exception):
            self.conn.fail(1013, "server busy: the byte budget is spent, try again later")
            self.transport.write(b"".join(self.conn.data_to_send()))
        self.transport.close()

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

    def send_receive_event_to_app(self) -> None:
        # uvicorn stops reading after every message and starts again when the app takes
        # it: two epoll changes per message. Here reading stops only once a second message
        # waits: a client that waits for its answers is never paused, one that pipelines
        # is, and what arrives meanwhile is on the byte budget (data_received).
        if self.curr_msg_data_type == "text" and not self.close_sent:
            data = self.frames[0]  # one part: _start and handle_cont join them
            if not data.isascii() and not _utf8(data):
                # uvicorn logs a traceback for each such message: a log flood.
                log.debug("closing an OpenEnv WebSocket: a text message is not UTF-8 (1007)")
                self.frames = []
                self.conn.send_close(1007)
                self.handle_parser_exception()
                return
        queue, paused = self.queue, self.read_paused
        self.read_paused = True  # so uvicorn's own pause is skipped
        try:
            super().send_receive_event_to_app()
        finally:
            self.read_paused = paused
        if not paused and queue.qsize() > 1:
            self.read_paused = True
            self.transport.pause_reading()

    def handle_cont(self, event: Any) -> None:
        if self._parts is None:  # websockets refuses a continuation with nothing begun
            return
        self._parts += event.data
        if event.fin:
            self.frames, self._parts = [bytes(self._parts)], None
            self.send_receive_event_to_app()


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def uvicorn_settings(limits: GatewayLimits) -> dict[str, Any]:
    """The ``uvicorn.Config`` keywords that enforce ``limits``."""
    http = type("BoundedHttp", (_BoundedHttp,), {"limits": limits})
    ws = type("BoundedWebSocket", (_BoundedWebSocket,), {"limits": limits})
    return {
        "http": http,
        "ws": ws,
        "ws_max_size": limits.request_bytes,
        "ws_per_message_deflate": False,  # no inflation: what arrives is what is held
        "timeout_keep_alive": max(1, min(5, int(limits.arrival_timeout))),
        "backlog": LISTEN_BACKLOG,
        "h11_max_incomplete_event_size": 16 * 1024,
        # The door reads no client address; the middleware would be one more frame
        # resumed at every message of every socket.
        "proxy_headers": False,
    }
