"""``RayProvider``: servers of one environment as Ray actors, one per node of a Ray
cluster, behind one balanced target.

``with RayProvider("echo", address="10.0.0.1:6379") as p, p.session(EchoEnv) as env:``

:meth:`start` connects to the cluster (``ray.init(address=...)``, or the one this process
already joined), reserves one bundle per server in a placement group with the ``SPREAD``
strategy (so the servers land on distinct nodes while there are nodes to spare), and
starts one :class:`ServerActor` per bundle. Each actor runs ``openenv-grpc serve`` as a
child process on a free port of its node's IP (as Ray sees it) and reports its target;
:meth:`start` returns once every one answers ``grpc.health.v1`` SERVING. The provider's
:attr:`target` is all of them as one gRPC target, balanced per stream over the healthy
ones (see :mod:`openenv_grpc.client.fleet`).

Restarts: an actor whose server exits ends itself, and Ray restarts it (``max_restarts``)
in its bundle -- a new server on a new port; :meth:`refresh` reads the targets again.
A node lost with its raylet takes its actor and its server: the actor watches its raylet
(its parent) and drains the server when it goes, and the parent-death signal covers an
actor that dies first.
:meth:`stop` drains every server (SIGTERM: NOT_SERVING, sessions get the grace period)
and then kills the actors and removes the placement group; nothing is left on the
cluster. Needs the ``ray`` extra.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from openenv_grpc.metadata import SERVICE_NAME, SERVING_LINE
from openenv_grpc.providers.base import FleetProvider, ProviderError, wait_serving

__all__ = ["RayProvider", "ServerActor"]

_PR_SET_PDEATHSIG = 1
#: How often an actor looks whether its raylet is still its parent.
_RAYLET_POLL_SECONDS = 0.25


def _die_with_parent() -> None:
    """In the server child before exec: SIGTERM it (a drain) when the actor dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ServerActor:
    """One ``openenv-grpc serve`` child on this actor's node (a Ray actor class: wrapped
    by ``ray.remote`` in :meth:`RayProvider.start`).

    Args:
        command: The serve command without ``--host``/``--port``.
        extra_env: Added to the worker's environment for the child.
        host: Listen address (None: this node's IP as Ray sees it).
        start_timeout: Seconds to wait for the child's serving line.
        stop_timeout: Seconds the child may drain when the raylet is lost.
    """

    def __init__(
        self,
        command: Sequence[str],
        extra_env: Mapping[str, str],
        host: str | None,
        start_timeout: float,
        stop_timeout: float = 30.0,
    ) -> None:
        import ray

        self._host = host or ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self._stopping = False
        self._proc = subprocess.Popen(
            [*command, "--host", self._host, "--port", "0"],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **extra_env},
            text=True,
            preexec_fn=_die_with_parent,
        )
        self._port = 0
        announced = threading.Event()
        threading.Thread(target=self._read, args=(announced,), daemon=True).start()
        if not announced.wait(start_timeout) or not self._port:
            self._proc.kill()
            raise ProviderError(f"server did not announce a port: {command}")
        threading.Thread(target=self._watch, daemon=True).start()
        threading.Thread(
            target=self._watch_raylet, args=(os.getppid(), stop_timeout), daemon=True
        ).start()
        self._node_id = ray.get_runtime_context().get_node_id()

    def _read(self, announced: threading.Event) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            match = SERVING_LINE.search(line)
            if match and not self._port:
                self._port = int(match.group(3))
                announced.set()
        announced.set()

    def _watch(self) -> None:
        """The server exited without a stop: end the actor, so Ray restarts it."""
        self._proc.wait()
        if not self._stopping:
            os._exit(1)

    def _watch_raylet(self, raylet: int, stop_timeout: float) -> None:
        """The raylet died (its node is lost): drain the server and end this actor.

        Ray's worker notices a dead raylet by being reparented to pid 1; under a subreaper
        (systemd --user, a container's init that is not pid 1) it never is, and the actor
        and its server would live on, serving from a node the cluster has written off.
        """
        while os.getppid() == raylet:
            time.sleep(_RAYLET_POLL_SECONDS)
        self.stop(stop_timeout)
        os._exit(1)

    def where(self) -> dict[str, Any]:
        """target, node_id, server pid and raylet pid (the worker's parent) of this actor."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return {
            "target": f"{host}:{self._port}",
            "node_id": self._node_id,
            "pid": self._proc.pid,
            "raylet_pid": os.getppid(),
        }

    def stop(self, timeout: float) -> int:
        """SIGTERM the server (it drains) and wait up to ``timeout`` s, then kill;
        returns its exit code."""
        self._stopping = True
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        return self._proc.returncode


class RayProvider(FleetProvider):
    """``replicas`` servers of ``env`` on a Ray cluster (see the module's docstring).

    Args:
        env: What ``serve`` gets: a packaged env name or ``module:factory``.
        replicas: Servers to start (None: one per alive node).
        address: The cluster for ``ray.init(address=...)`` (None: the one this process
            joined already, or ``RAY_ADDRESS``).
        args: More ``serve`` flags.
        host: Listen address of every server (None: each node's IP as Ray sees it).
        max_concurrent_envs: ``--max-concurrent-envs`` per server.
        grace: ``--grace`` seconds for the drain on stop (None: the server's, 25).
        extra_env: Environment variables for the servers (e.g. ``SNAPSHOT_KEYS``).
        num_cpus: CPUs each server's bundle reserves (may be fractional).
        strategy: The placement group strategy: ``SPREAD`` (distinct nodes if possible)
            or ``STRICT_SPREAD`` (distinct nodes, or fail).
        max_restarts: Times Ray restarts an actor whose server died (-1: forever).
        start_timeout: Seconds for the placement group, the actors and SERVING.
        stop_timeout: Seconds a server may drain on stop (default ``grace + 5``).
        python: The interpreter on the nodes that runs ``serve``.
        ray_init: More keyword arguments for ``ray.init``.
    """

    def __init__(
        self,
        env: str = "echo",
        *,
        replicas: int | None = None,
        address: str | None = None,
        args: Sequence[str] = (),
        host: str | None = None,
        max_concurrent_envs: int | None = None,
        grace: float | None = None,
        extra_env: Mapping[str, str] | None = None,
        num_cpus: float = 0.5,
        strategy: str = "SPREAD",
        max_restarts: int = 3,
        start_timeout: float = 120.0,
        stop_timeout: float | None = None,
        python: str = sys.executable,
        health_service: str = SERVICE_NAME,
        credentials: grpc.ChannelCredentials | None = None,
        ray_init: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(credentials=credentials)
        if replicas is not None and replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.env = env
        self.replicas = replicas
        self.address = address
        flags: list[str] = []
        if max_concurrent_envs is not None:
            flags += ["--max-concurrent-envs", str(max_concurrent_envs)]
        if grace is not None:
            flags += ["--grace", str(grace)]
        self.command = [python, "-m", "openenv_grpc", "serve", env, *flags, *args]
        self.host = host
        self.extra_env = dict(extra_env or {})
        self.num_cpus = num_cpus
        self.strategy = strategy
        self.max_restarts = max_restarts
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout if stop_timeout is not None else (grace or 25.0) + 5.0
        self.health_service = health_service
        self.ray_init = dict(ray_init or {})
        self._actors: list[Any] = []
        self._placement: Any = None
        self._joined = False
        #: Where each server is: target, node_id, pid, raylet_pid (see :meth:`refresh`).
        self.servers: list[dict[str, Any]] = []

    def start(self) -> None:
        """Join the cluster, place and start the servers, wait for SERVING.

        Raises:
            ProviderError: the cluster cannot be joined, the bundles cannot be placed, or
                a server did not become healthy within ``start_timeout`` (everything
                started is removed again).
            RuntimeError: already started.
        """
        if self._actors:
            raise RuntimeError("the provider is already started")
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init(address=self.address, **self.ray_init)
            self._joined = True
        try:
            alive = [node for node in ray.nodes() if node["Alive"]]  # type: ignore[no-untyped-call]
            count = self.replicas or len(alive)
            self._placement = placement_group(
                [{"CPU": self.num_cpus}] * count, strategy=self.strategy
            )
            try:
                ray.get(self._placement.ready(), timeout=self.start_timeout)
            except ray.exceptions.GetTimeoutError:
                raise ProviderError(
                    f"{count} bundles of {self.num_cpus} CPU ({self.strategy}) could not "
                    f"be placed in {self.start_timeout}s: {ray.cluster_resources()}"  # type: ignore[no-untyped-call]
                ) from None
            actor_class = ray.remote(ServerActor)
            self._actors = [
                actor_class.options(
                    num_cpus=0,  # the bundle holds the CPU
                    max_restarts=self.max_restarts,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self._placement, placement_group_bundle_index=index
                    ),
                ).remote(
                    self.command, self.extra_env, self.host, self.start_timeout, self.stop_timeout
                )
                for index in range(count)
            ]
            self.refresh()
            for server in self.servers:
                wait_serving(
                    server["target"], self.health_service, self.start_timeout,
                    credentials=self.credentials,
                )  # fmt: skip
        except BaseException as exc:
            self._stop_servers()
            if isinstance(exc, ray.exceptions.RayError):
                raise ProviderError(f"Ray could not start the servers: {exc}") from None
            raise

    def refresh(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """Ask every actor where its server is now (a restarted actor has a new port);
        waits for restarting actors up to ``timeout`` (default ``start_timeout``).

        Raises:
            ray.exceptions.RayActorError: an actor is dead for good (out of restarts), or
                still restarting at the deadline.
        """
        import ray

        deadline = time.monotonic() + (timeout or self.start_timeout)
        servers = []
        for actor in self._actors:
            while True:
                try:
                    servers.append(
                        ray.get(actor.where.remote(), timeout=max(1.0, deadline - time.monotonic()))
                    )
                    break
                except ray.exceptions.ActorUnavailableError:  # restarting: ask again
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        self.servers = servers
        return self.servers

    def drain(self, index: int) -> None:
        """Drain server ``index`` (SIGTERM, its grace), then let Ray start it again in its
        bundle; returns once it is SERVING again. For rolling restarts: drain one, next.

        Raises:
            ProviderError: the new server did not become healthy.
        """
        import ray

        actor = self._actors[index]
        old_pid = self.servers[index]["pid"]
        ray.get(actor.stop.remote(self.stop_timeout), timeout=self.stop_timeout + 30)
        ray.kill(actor, no_restart=False)
        # ray.kill returns before the actor is gone: until then `where` still answers the
        # old server's (stopped) address. Ask until the restarted actor answers.
        deadline = time.monotonic() + self.start_timeout
        while True:
            with contextlib.suppress(ray.exceptions.RayActorError):
                left = max(1.0, deadline - time.monotonic())
                if self.refresh(timeout=left)[index]["pid"] != old_pid:
                    break
            if time.monotonic() > deadline:
                raise ProviderError(f"server {index} was not started again after its drain")
            time.sleep(0.1)
        wait_serving(
            self.servers[index]["target"], self.health_service, self.start_timeout,
            credentials=self.credentials,
        )  # fmt: skip

    def _stop_servers(self) -> None:
        import ray

        actors, self._actors = self._actors, []
        if actors and ray.is_initialized():
            stops = [actor.stop.remote(self.stop_timeout) for actor in actors]
            with contextlib.suppress(ray.exceptions.RayError):
                ray.wait(stops, num_returns=len(stops), timeout=self.stop_timeout + 10)
            for actor in actors:
                with contextlib.suppress(ray.exceptions.RayError, ValueError):
                    ray.kill(actor, no_restart=True)
        if self._placement is not None and ray.is_initialized():
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(ray.exceptions.RayError, ValueError):
                remove_placement_group(self._placement)
        self._placement = None
        self.servers = []
        if self._joined and ray.is_initialized():
            ray.shutdown()
        self._joined = False
