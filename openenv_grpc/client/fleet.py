"""``Fleet``: many servers of one environment behind one client-side target, balanced
per new stream, with unhealthy servers skipped.

``with Fleet(provider) as fleet, fleet.session(EchoEnv, recovery=fleet.recovery(every=8))
as env: env.reset(seed=1)``

The nodes (``host:port`` each, from a plain list or a provider's ``targets``) become one
gRPC target listing every address (``ipv4:10.0.0.1:5000,10.0.0.2:5000``) and one channel
with gRPC's ``round_robin`` policy and client-side health checking: each new stream
(a Session or VectorSession open) goes to the next address whose env service answers
SERVING, and stays there for its life. A node that dies (its connection drops) or drains
(NOT_SERVING) leaves the rotation at once and comes back when it serves again; one that
freezes with its connections up (SIGSTOP, a hung host) is noticed by the channel's
keepalive within 25 s (:data:`~openenv_grpc.client.channel.KEEPALIVE_TIME_MS` +
:data:`~openenv_grpc.client.channel.KEEPALIVE_TIMEOUT_MS`), its streams end and it leaves
the rotation until it answers again. Balance
is per stream, not per connection: every node shares one channel, so no proxy and no
pool of channels is needed.

With ``recovery=fleet.recovery(every=K)`` an episode whose node dies reopens on the
fleet -- the surviving nodes -- restores its last snapshot and goes on (see
:mod:`openenv_grpc.client.recovery`). Every node must serve the same env and version
with the same ``SNAPSHOT_KEYS``.

Blocking sessions share the fleet's channel; asyncio sessions made on an event loop share
the fleet's asyncio channel of that loop (a channel belongs to one loop). Each is an exact
rotation over the healthy nodes once it reaches them all: :meth:`Fleet.wait_ready` waits
for that on the blocking channel, ``await`` :meth:`Fleet.wait_ready_async` on the
asyncio one. (A channel of each session's own would start its rotation wherever it
connects first: twelve such sessions on three nodes were seen all on one.)
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from openenv_grpc.client.channel import auth_metadata, channel_options, round_robin_options
from openenv_grpc.client.errors import InfoUnavailable
from openenv_grpc.client.info import fetch_info
from openenv_grpc.client.recovery import Recovery, run_blocking
from openenv_grpc.client.sync_session import SyncStream
from openenv_grpc.metadata import SERVICE_NAME
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Fleet", "HasTargets", "fleet_target"]

ClientT = TypeVar("ClientT")


class HasTargets(Protocol):
    """Anything that lists its servers (``RayProvider``, ``SlurmProvider``, ...)."""

    @property
    def targets(self) -> Sequence[str]:
        """``host:port`` of every server."""
        ...


def _address(node: str) -> tuple[int, str]:
    """(IP version, ``addr:port`` as a gRPC ipv4/ipv6 URI writes it) of ``host:port``;
    a host name is resolved now.

    Raises:
        ValueError: not ``host:port``, or the host does not resolve.
    """
    host, sep, port = node.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"a fleet node must be host:port, got {node!r}")
    host = host.strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError as exc:
            raise ValueError(f"fleet node {node!r} does not resolve: {exc}") from None
        ip = ipaddress.ip_address(str(infos[0][4][0]))
    if ip.version == 6:
        return 6, f"[{ip}]:{port}"
    return 4, f"{ip}:{port}"


def fleet_target(nodes: Sequence[str]) -> str:
    """The one gRPC target of ``nodes`` (``ipv4:a:p,b:q``); any session, vector session
    or channel made from it balances per stream over the healthy ones.

    Raises:
        ValueError: no nodes, a node is not ``host:port``, or IPv4 and IPv6 are mixed.
    """
    if not nodes:
        raise ValueError("a fleet needs at least one node")
    addresses = [_address(node) for node in nodes]
    versions = {version for version, _ in addresses}
    if len(versions) != 1:
        raise ValueError(f"a fleet's nodes must all be IPv4 or all IPv6: {list(nodes)}")
    scheme = "ipv6" if versions == {6} else "ipv4"
    return f"{scheme}:{','.join(address for _, address in addresses)}"


class Fleet:
    """Servers of one environment as one target (see the module's docstring).

    Args:
        nodes: ``host:port`` of each server, or something with ``targets`` (a provider):
            its targets are read now and again on :meth:`refresh`.
        credentials: TLS to the servers (None: plaintext).
        token: Bearer token for the fleet's own Info calls.
        health_service: The health service whose SERVING puts a node in the rotation.

    Raises:
        ValueError: as :func:`fleet_target`.
    """

    def __init__(
        self,
        nodes: Sequence[str] | HasTargets,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        health_service: str = SERVICE_NAME,
    ) -> None:
        self._source = None if isinstance(nodes, Sequence) else nodes
        self.credentials = credentials
        self.token = token
        self.health_service = health_service
        self._nodes: tuple[str, ...] = ()
        self._target = ""
        self._channel: grpc.Channel | None = None
        #: Channels of earlier node lists: sessions may still run on them.
        self._retired: list[grpc.Channel] = []
        #: The asyncio channel of each event loop that made sessions (see aio_channel).
        self._aio: dict[asyncio.AbstractEventLoop, grpc.aio.Channel] = {}
        self._aio_retired: list[tuple[asyncio.AbstractEventLoop, grpc.aio.Channel]] = []
        self._set_nodes(list(nodes) if isinstance(nodes, Sequence) else list(nodes.targets))

    def _set_nodes(self, nodes: list[str]) -> None:
        target = fleet_target(nodes)
        self._nodes = tuple(nodes)
        if target != self._target:
            if self._channel is not None:
                self._retired.append(self._channel)
                self._channel = None
            self._aio_retired.extend(self._aio.items())
            self._aio = {}
        self._target = target

    # -- where the nodes are -------------------------------------------------------------

    @property
    def nodes(self) -> tuple[str, ...]:
        """``host:port`` of every node, healthy or not."""
        return self._nodes

    @property
    def target(self) -> str:
        """The fleet as one gRPC target string (``ipv4:a:p,b:q``): a session made from it
        makes its own balanced channel."""
        return self._target

    def refresh(self) -> None:
        """Read the provider's targets again (a restarted server may have a new port);
        sessions opened from now on use the new list. No-op for a plain list."""
        if self._source is not None:
            self._set_nodes(list(self._source.targets))

    def channel(self) -> grpc.Channel:
        """The fleet's blocking channel, owned by the fleet (:meth:`close` closes it):
        every stream opened on it goes to the next healthy node."""
        if self._channel is None:
            options = [*channel_options(), *fleet_options()]
            self._channel = (
                grpc.insecure_channel(self._target, options=options)
                if self.credentials is None
                else grpc.secure_channel(self._target, self.credentials, options=options)
            )
        return self._channel

    def aio_channel(self) -> grpc.aio.Channel:
        """The fleet's asyncio channel on the running event loop, owned by the fleet
        (:meth:`close` or :meth:`aclose` closes it): every stream opened on it goes to the
        next healthy node.

        Raises:
            RuntimeError: no event loop is running.
        """
        loop = asyncio.get_running_loop()
        channel = self._aio.get(loop)
        if channel is None:
            self._close_orphans()
            options = [*channel_options(), *fleet_options()]
            channel = (
                grpc.aio.insecure_channel(self._target, options=options)
                if self.credentials is None
                else grpc.aio.secure_channel(self._target, self.credentials, options=options)
            )
            self._aio[loop] = channel
        return channel

    # -- health --------------------------------------------------------------------------

    def healthy(self, timeout: float = 2.0) -> list[str]:
        """The nodes whose health service answers SERVING now (each asked once)."""
        return [node for node in self._nodes if self._serving(node, timeout)]

    def _serving(self, node: str, timeout: float) -> bool:
        with self._node_channel(node) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                answer = stub.Check(
                    health_pb2.HealthCheckRequest(service=self.health_service), timeout=timeout
                )
            except grpc.RpcError:
                return False
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)

    def _node_channel(self, node: str) -> grpc.Channel:
        if self.credentials is None:
            return grpc.insecure_channel(node)
        return grpc.secure_channel(node, self.credentials)

    def loads(self, timeout: float = 5.0) -> dict[str, int | None]:
        """Sessions each node holds now (its Info's ``active_sessions``; None: no answer)."""
        loads: dict[str, int | None] = {}
        for node in self._nodes:
            try:
                info = fetch_info(node, timeout, credentials=self.credentials, token=self.token)
            except InfoUnavailable:
                loads[node] = None
                continue
            loads[node] = info.capacity.active_sessions
        return loads

    def wait_ready(self, timeout: float = 30.0, nodes: int | None = None) -> list[str]:
        """Wait until ``nodes`` nodes (default: all) are SERVING and the fleet's channel
        reaches every one of them, so that the next streams spread over all; returns the
        healthy nodes.

        Raises:
            TimeoutError: fewer were healthy, or the channel did not reach them all,
                within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        healthy = self._wait_healthy(nodes, timeout, deadline)
        # round_robin starts picking as soon as one address is READY: until every healthy
        # one is, new streams would crowd onto the first. Successive Info calls go to
        # successive READY addresses; once a round of them meets as many server processes
        # as there are healthy nodes, the rotation is complete.
        stub = pb_grpc.EnvServiceStub(self.channel())
        metadata = auth_metadata(self.token)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"the fleet's channel did not reach all of {healthy}")
            try:
                seen = {
                    stub.Info(
                        pb.InfoRequest(), timeout=remaining, wait_for_ready=True,
                        metadata=metadata,
                    ).server_pid
                    for _ in healthy
                }  # fmt: skip
            except grpc.RpcError:
                seen = set()
            if len(seen) >= len(healthy):
                return healthy
            time.sleep(0.02)

    async def wait_ready_async(self, timeout: float = 30.0, nodes: int | None = None) -> list[str]:
        """:meth:`wait_ready` for the asyncio sessions of the running event loop: wait
        until ``nodes`` nodes (default: all) are SERVING and this loop's
        :meth:`aio_channel` reaches every one of them; returns the healthy nodes.

        Raises:
            TimeoutError: as :meth:`wait_ready`.
        """
        deadline = time.monotonic() + timeout
        healthy = await asyncio.to_thread(self._wait_healthy, nodes, timeout, deadline)
        stub = pb_grpc.EnvServiceStub(self.aio_channel())
        metadata = auth_metadata(self.token)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"the fleet's asyncio channel did not reach all of {healthy}")
            try:
                seen = {
                    (await stub.Info(
                        pb.InfoRequest(), timeout=remaining, wait_for_ready=True,
                        metadata=metadata,
                    )).server_pid
                    for _ in healthy
                }  # fmt: skip
            except grpc.RpcError:
                seen = set()
            if len(seen) >= len(healthy):
                return healthy
            await asyncio.sleep(0.02)

    def _wait_healthy(self, nodes: int | None, timeout: float, deadline: float) -> list[str]:
        """The healthy nodes, once ``nodes`` (default: all) are.

        Raises:
            TimeoutError: fewer were by ``deadline``.
        """
        want = len(self._nodes) if nodes is None else nodes
        while len(healthy := self.healthy()) < want:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(healthy)} of {len(self._nodes)} fleet nodes SERVING after "
                    f"{timeout}s (wanted {want}): {healthy}"
                )
            time.sleep(0.1)
        return healthy

    def envoy_endpoints(self) -> list[dict[str, Any]]:
        """The nodes as Envoy ``lb_endpoints``, for a proxy in front of the fleet:
        ``deploy/envoy/envoy.template.yaml`` takes them as ``LB_ENDPOINTS`` (JSON)."""
        endpoints = []
        for node in self._nodes:
            host, _, port = node.rpartition(":")
            address = {"address": host.strip("[]"), "port_value": int(port)}
            endpoints.append({"endpoint": {"address": {"socket_address": address}}})
        return endpoints

    # -- sessions ----------------------------------------------------------------------

    def recovery(self, every: int = 1, within: float = 30.0) -> Recovery:
        """A :class:`Recovery` whose fallback is the fleet: a lost episode reopens on the
        next healthy node, restores its last snapshot (taken every ``every`` steps) and
        goes on. Share it among the fleet's sessions.

        Raises:
            ValueError: as :class:`Recovery`.
        """
        return Recovery(every=every, targets=[self._target], within=within)

    def session(self, client_class: type[ClientT], **kwargs: Any) -> ClientT:
        """An unopened session of ``client_class`` on the fleet: blocking ones (Session,
        VectorSession) share :meth:`channel`; asyncio ones share the running event loop's
        :meth:`aio_channel` (made outside a loop, one gets :attr:`target` and makes a
        channel of its own). Asyncio ones also get the fleet's ``credentials`` (unless
        ``kwargs`` give others), for a recovery's channels.

        Returns:
            ``client_class(channel_or_target, **kwargs)``.
        """
        make: Callable[..., ClientT] = client_class
        if isinstance(client_class, type) and issubclass(client_class, SyncStream):
            return make(self.channel(), **kwargs)
        if self.credentials is not None:
            kwargs.setdefault("credentials", self.credentials)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return make(self._target, **kwargs)
        return make(self.aio_channel(), **kwargs)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Wait for every node (see :meth:`wait_ready`); the fleet starts no server.

        Raises:
            TimeoutError: as :meth:`wait_ready`.
        """
        self.wait_ready()

    def _close_orphans(self) -> None:
        """Close the asyncio channels, current or retired, of loops that are closed: no
        session can use them any more, yet each holds its connections until closed."""
        orphans = [(loop, channel) for loop, channel in self._aio.items() if loop.is_closed()]
        for loop, _ in orphans:
            del self._aio[loop]
        orphans += [(loop, channel) for loop, channel in self._aio_retired if loop.is_closed()]
        self._aio_retired = [(o, c) for o, c in self._aio_retired if not o.is_closed()]
        for _, channel in orphans:
            _close_off_loop(channel)

    def stop(self) -> None:
        """Close the fleet's channels (their streams end). Safe to call twice. An asyncio
        channel whose loop is running is closed by a task on it (``await``
        :meth:`aclose` to wait for it); one whose loop is closed or not running is
        closed here."""
        channels = [*self._retired, *([self._channel] if self._channel else [])]
        self._retired, self._channel = [], None
        for channel in channels:
            channel.close()
        aio, self._aio, self._aio_retired = [*self._aio_retired, *self._aio.items()], {}, []
        for loop, aio_channel in aio:
            if loop.is_running():
                loop.call_soon_threadsafe(loop.create_task, aio_channel.close())
            else:
                # Not loop.run_until_complete: another loop may be running in this thread
                # (``aclose`` on a second loop comes here), and a closed loop cannot run.
                _close_off_loop(aio_channel)

    async def aclose(self) -> None:
        """Close the fleet's channels, waiting for the running loop's asyncio channels."""
        loop = asyncio.get_running_loop()
        mine = [
            channel for owner, channel in [*self._aio_retired, *self._aio.items()] if owner is loop
        ]
        self._aio_retired = [(o, c) for o, c in self._aio_retired if o is not loop]
        self._aio.pop(loop, None)
        for channel in mine:
            await channel.close()
        self.stop()

    close = stop

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def _close_off_loop(channel: grpc.aio.Channel) -> None:
    """Close an asyncio channel whose loop is not running. Without a grace its close
    awaits nothing (it cancels the channel's calls and destroys it), so it runs to its
    end here, with no loop."""
    run_blocking(channel.close())


def fleet_options() -> list[tuple[str, Any]]:
    """Channel arguments of a fleet's channel, after :func:`channel_options` (whose short
    reconnect backoff has a node that comes back rejoin within 1.2 s): round robin over
    the healthy addresses (also for a fleet of one)."""
    return round_robin_options()
