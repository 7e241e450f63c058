"""Channels and stubs for clients: what a target string becomes, with sane options."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc

from openenv_grpc.client.errors import CapacityError
from openenv_grpc.metadata import SERVICE_NAME

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "INITIAL_RECONNECT_BACKOFF_MS",
    "KEEPALIVE_TIMEOUT_MS",
    "KEEPALIVE_TIME_MS",
    "MAX_RECONNECT_BACKOFF_MS",
    "AioChannelPool",
    "aio_channel",
    "auth_metadata",
    "balancing_options",
    "channel_options",
    "round_robin_options",
    "sync_channel",
    "tls_credentials",
]

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class _Openable(Protocol):
    async def open(self) -> None: ...


SessionT = TypeVar("SessionT", bound=_Openable)


#: Seconds between keepalive pings on an idle connection, and how long any ping may go
#: unanswered: a frozen server (SIGSTOPped, its kernel still ACKing) is noticed within
#: their sum, 25 s. The server accepts pings 10 s apart (its
#: ``grpc.http2.min_ping_interval_without_data_ms``), so 15 s draws no GOAWAY.
KEEPALIVE_TIME_MS = 15_000
KEEPALIVE_TIMEOUT_MS = 10_000


#: After a failed connect a channel waits this long before the next, then 1.6 times as
#: long each time (gRPC's multiplier and 20 % jitter), up to ``MAX_RECONNECT_BACKOFF_MS``.
#: gRPC's defaults (1 s, up to 120 s) are made for clients of a shared internet service;
#: here a server that restarts is waited for by recovery, which tries again at most 1 s
#: apart and gives up after ``within``, and every attempt it makes while its channel
#: waits out a backoff fails although the server is back: after a 15 s outage a session
#: on a given channel recovered 1.2-11.1 s after the new server served (0.8-1.4 s with
#: these). With these a channel reconnects within 1.2 s of its server's return; the cost
#: is one refused connect a second per address while a server is down. (Not
#: ``grpc.min_reconnect_backoff_ms``: grpc-core's subchannel reads it as the time a
#: connect attempt is given, 20 s by default; lowered, it would cut slow TLS handshakes.)
INITIAL_RECONNECT_BACKOFF_MS = 250
MAX_RECONNECT_BACKOFF_MS = 1_000


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Message limits matching the server's, keepalive so a dead server is noticed
    within ``KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS`` (25 s), and a reconnect backoff
    short enough that a restarted server is reached within 1.2 s of its return."""
    return [
        ("grpc.initial_reconnect_backoff_ms", INITIAL_RECONNECT_BACKOFF_MS),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # grpc-core sends no keepalive ping while another ping (a BDP probe, sent as data
        # arrives) is unanswered, and waits for that one up to the *ping* timeout, 60 s
        # by default: a server frozen mid-answer stalled its sessions 60.3 s. The same
        # bound as the keepalive timeout, as the server sets it for its clients.
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


#: A fleet's service config: each new stream goes to the next READY address, and an
#: address is READY only while its env service answers SERVING (a draining node drops out).
_ROUND_ROBIN = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": SERVICE_NAME},
    }
)


def round_robin_options() -> list[tuple[str, Any]]:
    """Channel arguments for round robin per stream over the healthy addresses."""
    return [("grpc.service_config", _ROUND_ROBIN)]


def balancing_options(target: str) -> list[tuple[str, Any]]:
    """:func:`round_robin_options` when ``target`` lists several addresses
    (``ipv4:a:p1,b:p2``, as :class:`~openenv_grpc.client.fleet.Fleet` makes); else none
    (gRPC's default, pick_first)."""
    if target.startswith(("ipv4:", "ipv6:")) and "," in target:
        return round_robin_options()
    return []


def aio_channel(
    target: str, credentials: grpc.ChannelCredentials | None = None, **kwargs: Any
) -> grpc.aio.Channel:
    """An asyncio channel to ``target`` ("host:port"): TLS with ``credentials``, else
    plaintext."""
    options = [*channel_options(**kwargs), *balancing_options(target)]
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, credentials, options=options)


def sync_channel(
    target: str, credentials: grpc.ChannelCredentials | None = None, **kwargs: Any
) -> grpc.Channel:
    """A blocking channel to ``target``: TLS with ``credentials``, else plaintext."""
    options = [*channel_options(**kwargs), *balancing_options(target)]
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=options)


def tls_credentials(
    ca: str | Path | None = None, cert: str | Path | None = None, key: str | Path | None = None
) -> grpc.ChannelCredentials:
    """TLS channel credentials from PEM files: ``ca`` to trust (default: system roots),
    ``cert`` and ``key`` to present a client certificate (mutual TLS).

    Raises:
        OSError: a file cannot be read.
    """
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes() if ca else None,
        private_key=Path(key).read_bytes() if key else None,
        certificate_chain=Path(cert).read_bytes() if cert else None,
    )


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token`` as a bearer token (empty without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class AioChannelPool:
    """A few asyncio channels to one target, handed out in turn.

    A server with several workers shares its port with SO_REUSEPORT, and the kernel
    balances *connections*: sessions that all ride one channel (one connection) land on
    one worker. Each channel of the pool keeps its own connection, so sessions opened
    with ``pool.next()`` spread over the workers. Close the pool to close its channels.
    """

    def __init__(
        self,
        target: str,
        size: int = 4,
        credentials: grpc.ChannelCredentials | None = None,
        **kwargs: Any,
    ) -> None:
        if size < 1:
            raise ValueError(f"pool size must be >= 1, got {size}")
        # A local subchannel pool per channel: otherwise gRPC shares one connection
        # between identical channels in a process, and the pool would balance nothing.
        self._channels = [
            _aio_channel_with(target, credentials, ("grpc.use_local_subchannel_pool", 1), kwargs)
            for _ in range(size)
        ]
        self._next = 0

    @property
    def channels(self) -> list[grpc.aio.Channel]:
        return list(self._channels)

    def next(self) -> grpc.aio.Channel:
        """The next channel, round robin."""
        channel = self._channels[self._next % len(self._channels)]
        self._next += 1
        return channel

    async def open_session(self, client_class: Callable[..., SessionT], **kwargs: Any) -> SessionT:
        """An open session of ``client_class`` (``AsyncEchoEnv``, ...) on the next channel.

        When the server process behind that channel is full, the next channel is tried,
        each once: with ``--workers`` the capacity is split among the processes, and this
        finds the room any of them has left. ``kwargs`` go to the constructor.

        Raises:
            CapacityError: every channel's process is full (the last refusal).
            SessionRefused: a process refused for another reason (unreachable, draining).
        """
        tries = len(self._channels)
        while True:
            session = client_class(self.next(), **kwargs)
            try:
                await session.open()
                return session
            except CapacityError:
                tries -= 1
                if tries == 0:
                    raise

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self) -> AioChannelPool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def _aio_channel_with(
    target: str,
    credentials: grpc.ChannelCredentials | None,
    extra: tuple[str, Any],
    kwargs: dict[str, Any],
) -> grpc.aio.Channel:
    options = [*channel_options(**kwargs), extra]
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, credentials, options=options)
