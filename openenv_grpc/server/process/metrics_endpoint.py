"""The Prometheus endpoint: ``GET /metrics`` over HTTP/1.1 on the server's event loop.

Bounded, since anyone who reaches the port can connect, and every scrape answered, since a
failed scrape marks the target down: no thread per connection, and the limits below.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import select
import socket
from http import HTTPStatus

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

__all__ = ["EVICT_AFTER", "MAX_CONNECTIONS", "REQUEST_TIMEOUT", "MetricsEndpoint"]

log = logging.getLogger(__name__)

#: Connections served at once; a Prometheus server scrapes one request at a time.
MAX_CONNECTIONS = 64
#: Connections the kernel holds for us, handshake done, while all of the above are busy.
BACKLOG = 1024
#: Seconds after which a connection without a whole request head gives way to one
#: waiting in the listen queue (a scraper sends its request at once).
EVICT_AFTER = 0.5
#: Seconds to send the request head, and again to take the answer (Prometheus: 10 s).
REQUEST_TIMEOUT = 5.0
#: Largest request head (request line and headers) accepted.
MAX_HEAD_BYTES = 8192

#: How often a full endpoint looks for a slow connection to close.
_EVICT_CHECK = 0.1


class MetricsEndpoint:
    """Serves ``registry`` at ``/metrics`` (with a token: ``Authorization: Bearer``
    required, else 401); :meth:`start` it, then :meth:`close` it."""

    def __init__(
        self,
        registry: CollectorRegistry,
        token: str = "",
        *,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self._registry = registry
        self._expected = f"Bearer {token}".encode() if token else None
        self._max_connections = max_connections
        #: Connections being served, oldest first.
        self._open: dict[_Connection, None] = {}
        self._slot_freed = asyncio.Event()
        self._sock: socket.socket | None = None
        self._acceptor: asyncio.Task[None] | None = None

    @property
    def connections(self) -> int:
        return len(self._open)

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port); returns the bound port (or OSError)."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(BACKLOG)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._acceptor = asyncio.create_task(self._accept_forever(sock))
        return int(sock.getsockname()[1])

    async def close(self) -> None:
        """Stop listening and drop the connections still open."""
        if self._acceptor is not None:
            self._acceptor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._acceptor
            self._acceptor = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        for connection in list(self._open):
            connection.abort()

    async def _accept_forever(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while len(self._open) >= self._max_connections:
                self._slot_freed.clear()
                # A closed connection is let go on a later loop turn: wait for it.
                self._evict_slow_if_others_wait(sock, loop.time())
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._slot_freed.wait(), _EVICT_CHECK)
            try:
                client, _ = await loop.sock_accept(sock)
            except OSError as exc:  # EMFILE and the like: try again shortly
                log.warning("metrics endpoint cannot accept: %s", exc)
                await asyncio.sleep(_EVICT_CHECK)
                continue
            connection = _Connection(self, loop.time())
            self._open[connection] = None
            try:
                await loop.connect_accepted_socket(functools.partial(_itself, connection), client)
            except OSError:
                self._open.pop(connection, None)
                client.close()

    def _evict_slow_if_others_wait(self, sock: socket.socket, now: float) -> None:
        """If a connection waits in the listen queue, close those still without a request
        head :data:`EVICT_AFTER` s after they were taken, but not one with unread bytes
        (they may be the rest of a scrape the loop has not read yet)."""
        slow = {c.fileno(): c for c in self._open if c.waiting and now - c.taken_at >= EVICT_AFTER}
        slow.pop(-1, None)
        if not slow or not _readable([sock.fileno()]):  # nobody waits to be accepted
            return
        unread = _readable(list(slow))
        for fd, connection in slow.items():
            if fd not in unread:
                connection.abort()

    def _release(self, connection: _Connection) -> None:
        if connection in self._open:
            del self._open[connection]
            self._slot_freed.set()

    def decide(self, head: bytes) -> tuple[int, bytes, dict[str, str]]:
        """The answer to one request head: (status, body, extra headers)."""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return 400, b"bad request line\n", {}
        method, target, _version = parts
        fields: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                fields[name.strip().lower()] = value.strip()
        if target.split("?", 1)[0] != "/metrics":
            return 404, b"not found: the metrics are at /metrics\n", {}
        if method != "GET":
            return 405, b"only GET\n", {"Allow": "GET"}
        if self._expected is not None and not hmac.compare_digest(
            fields.get("authorization", "").encode("latin-1"), self._expected
        ):
            return 401, b"missing or invalid bearer token\n", {"WWW-Authenticate": "Bearer"}
        encoder, content_type = choose_encoder(fields.get("accept", ""))
        return 200, encoder(self._registry), {"Content-Type": content_type}


def _itself(connection: _Connection) -> _Connection:
    return connection


def _readable(fds: list[int]) -> set[int]:
    """Those of ``fds`` with something to read now (poll, not select: the server may hold
    more than FD_SETSIZE descriptors)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return {fd for fd, events in poller.poll(0) if events & (select.POLLIN | select.POLLHUP)}


class _Connection(asyncio.Protocol):
    """One request per connection: read its head, answer, half-close, then read until the
    client closes (closing with unread bytes would reset the answer in flight)."""

    def __init__(self, endpoint: MetricsEndpoint, taken_at: float) -> None:
        self._endpoint = endpoint
        self.taken_at = taken_at
        #: Still waiting for a whole request head.
        self.waiting = True
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._restart_timer()

    def _restart_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(REQUEST_TIMEOUT, self.abort)

    def data_received(self, data: bytes) -> None:
        if not self.waiting:
            return  # after the answer: read and drop until the client closes
        self._buffer += data
        end = self._buffer.find(b"\r\n\r\n")
        if (end + 4 if end >= 0 else len(self._buffer)) > MAX_HEAD_BYTES:
            self._answer(400, b"request head too large\n", {})
        elif end >= 0:
            self._answer(*self._endpoint.decide(bytes(self._buffer[: end + 4])))

    def _answer(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.waiting = False
        self._buffer = bytearray()
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        fields = {"Content-Type": "text/plain; charset=utf-8", **headers}
        fields["Content-Length"] = str(len(body))
        fields["Connection"] = "close"
        head = f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n" + "".join(
            f"{name}: {value}\r\n" for name, value in fields.items()
        )
        self._restart_timer()  # the client now gets the timeout to take the answer
        transport.write(head.encode("latin-1") + b"\r\n" + body)
        if transport.can_write_eof():
            transport.write_eof()  # FIN once the answer is out; we read on until it closes
        else:  # pragma: no cover - TCP transports can always half-close
            transport.close()

    def fileno(self) -> int:
        if self._transport is None:
            return -1
        sock = self._transport.get_extra_info("socket")
        return -1 if sock is None else int(sock.fileno())

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._transport = None
        self._endpoint._release(self)
