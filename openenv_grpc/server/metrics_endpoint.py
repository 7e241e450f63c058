"""The Prometheus endpoint: ``GET /metrics`` over HTTP/1.1 on the server's event loop.

Bounded, because anyone who reaches the port can open connections to it (prometheus_client's
own server gives each connection a thread and waits on it for ever):

* no thread per connection: the handler is a coroutine on the gRPC server's loop;
* at most :data:`MAX_CONNECTIONS` connections at once: a new one evicts the oldest
  connection still waiting for its request (a slow client must not keep a scraper out);
  when every connection is past that point, the new one gets ``503`` and is closed;
* the request head must arrive within :data:`REQUEST_TIMEOUT` seconds and fit in
  :data:`MAX_HEAD_BYTES`; the answer must be taken within the same time; one request per
  connection (``Connection: close``);
* only ``GET /metrics``; with a token, a scrape needs ``Authorization: Bearer <token>``
  (compared in constant time), else ``401``.

The exposition itself (text or OpenMetrics, chosen from ``Accept``) is prometheus_client's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

__all__ = ["MAX_CONNECTIONS", "MAX_HEAD_BYTES", "REQUEST_TIMEOUT", "MetricsEndpoint"]

log = logging.getLogger(__name__)

#: Connections served at once. A Prometheus server scrapes a target one request at a time;
#: 16 leaves room for a few more scrapers and people with curl.
MAX_CONNECTIONS = 16
#: Seconds a client gets to send its request head, and again to take the answer.
#: Prometheus sends the whole request at once and its scrape timeout defaults to 10 s.
REQUEST_TIMEOUT = 5.0
#: Largest request head (request line and headers) accepted.
MAX_HEAD_BYTES = 8192

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    503: "Service Unavailable",
}


class MetricsEndpoint:
    """Serves ``registry`` at ``/metrics``; :meth:`start` it, then :meth:`close` it.

    Args:
        registry: The metrics to expose.
        token: When set, every request needs ``Authorization: Bearer <token>``.
        max_connections: Connections served at once; more are answered 503.
        timeout: Seconds for the request head to arrive, and for the answer to be taken.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        token: str = "",
        *,
        max_connections: int = MAX_CONNECTIONS,
        timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        self._registry = registry
        self._expected = f"Bearer {token}".encode() if token else None
        self._max_connections = max_connections
        self._timeout = timeout
        self._open = 0
        #: Connections still waiting for their request head, oldest first.
        self._waiting: dict[asyncio.StreamWriter, None] = {}
        self._server: asyncio.Server | None = None

    @property
    def connections(self) -> int:
        """Connections open now (those being served)."""
        return self._open

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0 picks a free port); returns the bound port.

        Raises:
            OSError: the address cannot be bound.
        """
        self._server = await asyncio.start_server(
            self._serve, host, port, limit=MAX_HEAD_BYTES, reuse_address=True
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening and drop the connections still open."""
        if self._server is not None:
            self._server.close()
            close_clients = getattr(self._server, "close_clients", None)  # Python >= 3.13
            if close_clients is not None:
                close_clients()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= self._max_connections:
            if not self._waiting:
                await self._finish(writer, 503, b"too many connections\n")
                return
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            oldest.transport.abort()  # its pending read fails and its handler ends
        self._open += 1
        self._waiting[writer] = None
        try:
            status, body, headers = await self._answer(reader)
            self._waiting.pop(writer, None)
            await self._finish(writer, status, body, headers)
        finally:
            self._waiting.pop(writer, None)
            self._open -= 1

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, bytes, dict[str, str]]:
        """Read one request head and decide the answer: (status, body, extra headers)."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._timeout)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            return 0, b"", {}  # 0: say nothing, just close
        except asyncio.LimitOverrunError:
            return 400, b"request head too large\n", {}
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

    async def _finish(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        body: bytes,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Write the answer (unless ``status`` is 0) within the timeout, then close."""
        try:
            if status:
                fields = {"Content-Type": "text/plain; charset=utf-8", **(headers or {})}
                fields["Content-Length"] = str(len(body))
                fields["Connection"] = "close"
                head = f"HTTP/1.1 {status} {_REASONS[status]}\r\n" + "".join(
                    f"{name}: {value}\r\n" for name, value in fields.items()
                )
                writer.write(head.encode("latin-1") + b"\r\n" + body)
                await asyncio.wait_for(writer.drain(), self._timeout)
        except (asyncio.TimeoutError, ConnectionError) as exc:
            log.debug("metrics client dropped: %s", exc)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), self._timeout)
