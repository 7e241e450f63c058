"""What every provider shares: a server somewhere, reachable at ``target``.

A provider starts servers (a local process, pods in a cluster), says where to reach them
(``target``), hands out channels and sessions to them, and stops them. It is a context
manager: ``with LocalProcessProvider("echo") as p: with p.session(EchoEnv) as env: ...``.
:meth:`Provider.session` is the one way to get a session on a provider's servers;
``EchoEnv.launch(provider)`` gives one that owns (and stops) the provider.

With ``credentials`` a provider speaks TLS to its servers, for its health waits and every
channel and session it hands out; it never falls back to plaintext.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from openenv_grpc.client.channel import channel_options
from openenv_grpc.client.fleet import fleet_options, fleet_target
from openenv_grpc.client.sync_session import Session

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Provider", "ProviderError", "wait_serving"]

ClientT = TypeVar("ClientT")

SERVING = health_pb2.HealthCheckResponse.SERVING


class ProviderError(RuntimeError):
    """A provider could not start, reach or stop its servers."""


class Provider(ABC):
    """Servers of one environment, started by :meth:`start` and ended by :meth:`stop`.

    ``credentials`` (see :func:`openenv_grpc.client.channel.tls_credentials`): the servers
    speak TLS; health waits, channels and sessions use it.
    """

    def __init__(self, *, credentials: grpc.ChannelCredentials | None = None) -> None:
        self._channels: list[grpc.Channel] = []
        #: TLS to the servers (None: plaintext).
        self.credentials = credentials

    @property
    @abstractmethod
    def target(self) -> str:
        """The gRPC target of the servers (``host:port`` or ``dns:///name:port``).

        Raises:
            ProviderError: the provider has not been started.
        """

    @abstractmethod
    def start(self) -> None:
        """Start the servers and return once they report SERVING.

        Raises:
            ProviderError: they did not start or did not become healthy in time (nothing
                is left running then).
        """

    @abstractmethod
    def _stop_servers(self) -> None:
        """Stop what :meth:`start` started (idempotent)."""

    def extra_channel_options(self) -> list[tuple[str, Any]]:
        """Extra channel arguments for this provider's channels (none by default)."""
        return []

    def channel(self) -> grpc.Channel:
        """A blocking channel to ``target``, owned by the provider: :meth:`stop` closes it.

        Returns:
            A new ``grpc.Channel``; many sessions may share it.
        """
        options = [*channel_options(), *self.extra_channel_options()]
        if self.credentials is None:
            channel = grpc.insecure_channel(self.target, options=options)
        else:
            channel = grpc.secure_channel(self.target, self.credentials, options=options)
        self._channels.append(channel)
        return channel

    def session(self, client_class: type[ClientT], **kwargs: Any) -> ClientT:
        """A session of ``client_class`` (``EchoEnv``, ``AsyncEchoEnv``, ...) on these
        servers, not yet open: use it in a ``with`` / ``async with`` block.

        Blocking sessions share one provider-owned channel (so they follow the provider's
        balancing settings); asyncio sessions get ``target`` and own their channel, since
        an asyncio channel belongs to the event loop that uses it (with the provider's
        ``credentials`` unless ``kwargs`` give others).

        Returns:
            ``client_class(channel_or_target, **kwargs)``.
        """
        make: Callable[..., ClientT] = client_class
        if isinstance(client_class, type) and issubclass(client_class, Session):
            return make(self.channel(), **kwargs)
        if self.credentials is not None:
            kwargs.setdefault("credentials", self.credentials)
        return make(self.target, **kwargs)

    def stop(self) -> None:
        """Close the provider's channels and stop the servers. Safe to call twice.

        The channels go first: sessions opened through :meth:`session` (blocking ones)
        end at once, so the servers' drain does not wait for them.
        """
        channels, self._channels = self._channels, []
        for channel in channels:
            channel.close()
        self._stop_servers()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def wait_serving(
    target: str,
    service: str = "",
    timeout: float = 30.0,
    alive: Any = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Poll ``grpc.health.v1`` Check on ``target`` until ``service`` is SERVING.

    Args:
        target: ``host:port`` of the server.
        service: The health service name ("" is the whole server).
        timeout: Seconds to wait in all.
        alive: Optional callable; when it returns False the wait stops early (the
            server process died).
        credentials: TLS to the server (None: plaintext); never falls back.

    Raises:
        ProviderError: not SERVING within ``timeout``, or ``alive()`` turned False.
    """
    deadline = time.monotonic() + timeout
    last = "no answer"
    channel = (
        grpc.insecure_channel(target)
        if credentials is None
        else grpc.secure_channel(target, credentials)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=service)
        while True:
            if alive is not None and not alive():
                raise ProviderError(f"server at {target} exited before it was healthy")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ProviderError(f"{target} not SERVING after {timeout}s ({last})")
            try:
                response = stub.Check(request, timeout=min(2.0, remaining))
                if response.status == SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
            except grpc.RpcError as exc:
                last = str(exc.code())
            time.sleep(0.05)


class FleetProvider(Provider):
    """A provider of several servers (one per node or task) in :attr:`servers`, offered
    as one target balanced per stream (see :mod:`openenv_grpc.client.fleet`)."""

    #: Each server's facts, in start order; ``"target"`` is its ``host:port``.
    servers: list[dict[str, Any]]

    @property
    def targets(self) -> list[str]:
        """``host:port`` of every server, in start order."""
        if not self.servers:
            raise ProviderError("the provider has not been started")
        return [server["target"] for server in self.servers]

    @property
    def target(self) -> str:
        """Every server as one gRPC target, balanced per stream (``ipv4:a:p,b:q``)."""
        return fleet_target(self.targets)

    def extra_channel_options(self) -> list[tuple[str, Any]]:
        return fleet_options()
