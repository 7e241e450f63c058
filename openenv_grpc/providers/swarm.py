"""``DockerSwarmProvider``: N replicas of an environment image as one Docker swarm service,
behind one address.

``with DockerSwarmProvider("openenv-grpc-echo:0.1.0", replicas=3) as p, p.session(EchoEnv)
as env: env.reset()``

The daemon must be a swarm manager (``docker swarm init``). Two ways to put the replicas
behind one address (``endpoint=``):

- ``"host"`` (the default): every replica runs on the host network of the manager node and
  listens on the same port with SO_REUSEPORT (``REUSE_PORT=1``), so the kernel spreads
  *connections* over them.
  The target is ``127.0.0.1:<port>`` on that node: the provider must run there. No overlay
  network, no IPVS, nothing published beyond loopback. Docker's health probe is turned off
  (on a shared port it would reach any replica, not its own); :meth:`start` checks each
  replica itself (its ``serving`` line) and then the target's ``grpc.health.v1``.
- ``"ingress"``: swarm's routing mesh, the standard way: a port published on every node,
  balanced per connection (IPVS) over all replicas wherever they run. The target is
  ``<host>:<published port>``. Needs IPVS (the ``ip_vs`` kernel module) on every node, and
  publishes the port on every address of every node.

Either way one HTTP/2 connection reaches one replica: to spread sessions, open several
channels (``openenv_grpc.client.channel.AioChannelPool``).

No service outlives its owner, even when the owner is SIGKILLed between start and stop:

- **Lease watchdog** (``watchdog=True``, the default). Before the service exists, the
  provider takes an exclusive ``flock`` on a lease file and starts a small detached process
  (its own session, so signals to the owner's process group miss it) that blocks on the same
  lock. The kernel drops the lock when the owner dies, however it dies; the watchdog then
  removes the service by name -- for a few seconds, also one whose creation was in flight.
  On a normal :meth:`stop` the owner removes the service, marks the lease ``stopped`` and
  lets go; the watchdog exits without touching anything.
- **Owner labels** (those of :mod:`~openenv_grpc.providers.docker_provider`, with the
  provider label ``swarm``) on every service: :func:`cleanup_orphan_services` (run by every
  :meth:`start`) removes the services whose owner is gone -- also those a watchdog could not
  remove (``watchdog=False``, the watchdog killed too, the daemon unreachable meanwhile).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import secrets
import select
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import docker
import grpc
from docker.errors import APIError, DockerException, NotFound
from docker.types import Healthcheck, Resources, RestartPolicy, ServiceMode
from docker.utils import parse_bytes

from openenv_grpc.metadata import SERVICE_NAME, SERVING_LINE
from openenv_grpc.providers.base import Provider, ProviderError, wait_serving
from openenv_grpc.providers.docker_provider import docker_client
from openenv_grpc.providers.ownership import (
    LABEL_PROVIDER,
    owner_gone,
    owner_labels,
    remove_stale_leases,
    take_lease,
)

__all__ = ["PROVIDER_SWARM", "DockerSwarmProvider", "cleanup_orphan_services"]

#: Value of the provider label on the services this module creates.
PROVIDER_SWARM = "swarm"

Endpoint = Literal["host", "ingress"]

#: Task states that end a start: the replica will not serve.
_FAILED_STATES = frozenset({"failed", "rejected", "complete", "orphaned", "remove"})

#: Details prefix of a service log line (``details=True``): ``k=v,k=v,... <line>``.
_TASK_ID = re.compile(r"com\.docker\.swarm\.task\.id=([0-9a-z]+)")

# The lease watchdog: a detached process that removes the service once it can lock the
# lease (= the owner let go). argv: lease path, docker URL ("" = from the environment),
# service name, seconds to keep trying while there is no such service (a create request
# may have been in flight when the owner died) or the daemon does not answer.
WATCHDOG = r"""
import fcntl, os, sys, time
lease, url, name, settle = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
fd = os.open(lease, os.O_RDONLY)
os.write(1, b"armed\n")
os.close(1)
fcntl.flock(fd, fcntl.LOCK_EX)
if os.pread(fd, 16, 0).startswith(b"stopped"):
    sys.exit(0)
try:
    os.unlink(lease)
except OSError:
    pass
import docker
from docker.errors import NotFound
deadline = time.monotonic() + settle
while True:
    try:
        client = docker.DockerClient(base_url=url) if url else docker.from_env()
        client.api.remove_service(name)
        print("openenv-grpc watchdog: removed service %s" % name, file=sys.stderr, flush=True)
        break
    except NotFound:
        pass
    except Exception as exc:
        print("openenv-grpc watchdog: %s" % exc, file=sys.stderr, flush=True)
    if time.monotonic() > deadline:
        break
    time.sleep(0.5)
"""

#: Providers with a live service; the interpreter's exit stops them.
_LIVE: weakref.WeakSet[DockerSwarmProvider] = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:
    for provider in list(_LIVE):
        provider.stop()


def cleanup_orphan_services(client: docker.DockerClient | None = None) -> list[str]:
    """Remove every service of this provider whose owner process is gone.

    Owners on another machine, boot or pid namespace are presumed alive (left alone).

    Args:
        client: A client of a swarm manager (default: :func:`docker_client`).

    Returns:
        The names of the removed services.

    Raises:
        ProviderError: no daemon answers.
        docker.errors.APIError: the daemon refused (e.g. it is not a swarm manager).
    """
    client = client or docker_client()
    remove_stale_leases()
    removed = []
    services: Any = client.services  # the stubs leave most of the services API untyped
    for service in services.list(filters={"label": f"{LABEL_PROVIDER}={PROVIDER_SWARM}"}):
        labels = service.attrs.get("Spec", {}).get("Labels") or {}
        if owner_gone(labels):
            with contextlib.suppress(NotFound):
                service.remove()
            removed.append(service.name or service.id or "?")
    return removed


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _describe_task(task: Mapping[str, Any]) -> str:
    status = task.get("Status") or {}
    slot = task.get("Slot", "?")
    why = status.get("Err") or status.get("Message") or ""
    code = (status.get("ContainerStatus") or {}).get("ExitCode")
    exit_code = f", exit code {code}" if code else ""
    return f"replica {slot} {status.get('State', '?')}{exit_code}: {why}"


class DockerSwarmProvider(Provider):
    """``replicas`` servers of an environment image as one swarm service, behind one address.

    Args:
        image: The image, e.g. ``openenv-grpc-echo:0.1.0`` (``make image ENV=echo``), present
            on the nodes or pullable by them. Its entrypoint must run ``openenv-grpc serve``,
            which reads ``HOST`` / ``PORT`` (and, in host mode, ``REUSE_PORT``) from the
            environment, as the images of deploy/docker do.
        replicas: How many servers.
        port: Host mode: the port the replicas share (None: a free port of ``host`` here).
            Ingress mode: the published port (None: swarm picks one, 30000-32767).
        endpoint: ``"host"`` or ``"ingress"`` (see the module doc).
        host: Host mode: where the replicas listen and the client dials (loopback by
            default; ``0.0.0.0`` listens everywhere and dials 127.0.0.1). Ingress mode: the
            address the client dials (any node's address; the servers listen on 0.0.0.0
            inside their containers).
        container_port: Ingress mode: the port the servers listen on in their containers.
        args: More ``serve`` flags, appended to the image's command.
        max_concurrent_envs: ``MAX_CONCURRENT_ENVS`` of each replica (None: the image's).
        workers: ``WORKERS`` of each replica (None: the image's, 1).
        grace: ``GRACE_PERIOD`` seconds for the drain on stop (None: the server's, 25).
        cpus: CPU limit of each replica in cores (None: no limit).
        mem_limit: Memory limit of each replica, e.g. ``"512m"`` (None: no limit).
        extra_env: More environment variables for the replicas. Swarm expands templates in
            them, e.g. ``{"REPLICA": "{{.Task.Slot}}"}``.
        labels: More service labels.
        name_prefix: Service names are ``<prefix>-<image>-<pid>-<random>``.
        watchdog: Remove the service when this process dies (see the module doc).
        health_interval: Ingress mode: Docker's health probe interval in seconds (swarm
            routes only to healthy replicas and counts one as running only after its first
            probe; None keeps the image's, 15 s there). Host mode turns the probe off.
        start_timeout: Seconds :meth:`start` waits for every replica and the target.
        stop_timeout: Seconds each replica gets to drain before SIGKILL; default
            ``grace + 5``.
        docker_url: The daemon (a swarm manager), e.g. ``unix:///var/run/docker.sock``
            (None: ``DOCKER_HOST`` and the rest of the environment). The watchdog uses it
            too: pass it along with ``client`` when that client is not from the environment.
        client: The Docker client (default: one for ``docker_url``).
        health_service: The health service that must be SERVING.
    """

    def __init__(
        self,
        image: str,
        replicas: int = 3,
        port: int | None = None,
        *,
        endpoint: Endpoint = "host",
        host: str = "127.0.0.1",
        container_port: int = 50051,
        args: Sequence[str] = (),
        max_concurrent_envs: int | None = None,
        workers: int | None = None,
        grace: float | None = None,
        cpus: float | None = None,
        mem_limit: str | int | None = None,
        extra_env: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        name_prefix: str = "openenv-grpc",
        watchdog: bool = True,
        health_interval: float | None = None,
        start_timeout: float = 60.0,
        stop_timeout: float | None = None,
        docker_url: str | None = None,
        client: docker.DockerClient | None = None,
        health_service: str = SERVICE_NAME,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        super().__init__(credentials=credentials)
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if endpoint not in ("host", "ingress"):
            raise ValueError(f"endpoint must be 'host' or 'ingress', got {endpoint!r}")
        self.image = image
        self.replicas = replicas
        self.endpoint: Endpoint = endpoint
        self.host = host
        self.container_port = container_port
        self.args = list(args)
        self.cpus = cpus
        self.mem_limit = mem_limit
        self.labels = dict(labels or {})
        self.watchdog = watchdog
        self.health_interval = health_interval
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout if stop_timeout is not None else (grace or 25.0) + 5.0
        self.docker_url = docker_url
        self.health_service = health_service
        self.environment = dict(extra_env or {})
        if max_concurrent_envs is not None:
            self.environment["MAX_CONCURRENT_ENVS"] = str(max_concurrent_envs)
        if workers is not None:
            self.environment["WORKERS"] = str(workers)
        if grace is not None:
            self.environment["GRACE_PERIOD"] = str(grace)
        slug = re.sub(r"[^a-zA-Z0-9-]+", "-", image.rsplit("/", 1)[-1].split(":")[0]).strip("-")
        slug = slug.removeprefix(f"{name_prefix}-")[:20]
        self.name = f"{name_prefix}-{slug}-{os.getpid()}-{secrets.token_hex(4)}"
        self._client = client
        #: The swarm service's id (None before start and after stop).
        self.service_id: str | None = None
        #: The port of the target: the shared port (host) or the published one (ingress).
        self.port = port or 0
        self._requested_port = port
        self._created = False  # a create request was sent (it may have landed)
        self._lease_fd: int | None = None
        self._lease_path: str | None = None
        #: The lease watchdog process (None: none started).
        self.watchdog_process: subprocess.Popen[bytes] | None = None

    @property
    def client(self) -> docker.DockerClient:
        """The Docker client (connected on first use).

        Raises:
            ProviderError: no daemon answers.
        """
        if self._client is None:
            if self.docker_url is None:
                self._client = docker_client()
            else:
                try:
                    self._client = docker.DockerClient(base_url=self.docker_url)
                    self._client.ping()
                except DockerException as exc:
                    raise ProviderError(f"no Docker daemon answers at {self.docker_url}") from exc
        return self._client

    @property
    def _api(self) -> Any:
        # The stubs leave the swarm parts of the API untyped.
        return self.client.api

    @property
    def _services(self) -> Any:
        return self.client.services

    @property
    def target(self) -> str:
        """``host:port`` of the replicas (see the module doc for each endpoint mode).

        Raises:
            ProviderError: not started.
        """
        if self.service_id is None or not self.port:
            raise ProviderError("the provider has not been started")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def start(self) -> None:
        """Remove orphan services, create the service, wait until every replica runs and
        has announced itself, and until the target answers ``grpc.health.v1`` SERVING.

        Raises:
            ProviderError: no daemon, not a swarm manager, a replica failed (its error and
                the service's output are in the message), or not ready within
                ``start_timeout``. The service is removed then.
            RuntimeError: already started.
        """
        if self._created:
            raise RuntimeError("the provider is already started")
        try:
            swarm = self.client.info().get("Swarm") or {}
        except DockerException as exc:
            raise ProviderError(f"the Docker daemon did not answer: {exc}") from exc
        if swarm.get("LocalNodeState") != "active" or not swarm.get("ControlAvailable"):
            raise ProviderError(
                "the Docker daemon is not a swarm manager (run `docker swarm init` there, "
                "or point docker_url / DOCKER_HOST at a manager)"
            )
        cleanup_orphan_services(self.client)
        _LIVE.add(self)
        try:
            if self.watchdog:
                self._arm_watchdog()
            self._create(str(swarm.get("NodeID", "")))
            self._wait_ready()
        except BaseException as exc:  # includes KeyboardInterrupt: never leave a service
            report = ""
            if isinstance(exc, ProviderError) and self.service_id is not None:
                with contextlib.suppress(DockerException):
                    output = self.logs(tail=40)[-4000:]
                    report = f"; service output:\n{output}" if output else ""
            self.stop()
            if isinstance(exc, ProviderError):
                raise ProviderError(f"{exc}{report}") from None
            raise

    def _arm_watchdog(self) -> None:
        """Take the lease, start the watchdog and wait until it holds the lease open.

        Raises:
            ProviderError: the watchdog did not start.
        """
        fd, path = take_lease()
        self._lease_fd, self._lease_path = fd, path
        settle = "5"  # seconds: a create request in flight when the owner died lands by then
        proc = subprocess.Popen(
            [sys.executable, "-c", WATCHDOG, path, self.docker_url or "", self.name, settle],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd="/",
            start_new_session=True,  # a signal to the owner's process group misses it
        )
        self.watchdog_process = proc
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30.0)
        line = proc.stdout.readline() if ready else b""
        proc.stdout.close()
        if line != b"armed\n":
            proc.kill()
            proc.wait()
            raise ProviderError("the lease watchdog did not start")

    def _create(self, node_id: str) -> None:
        environment = {**self.environment, "PYTHONUNBUFFERED": "1"}
        options: dict[str, Any] = {}
        if self.endpoint == "host":
            self.port = self._requested_port or _free_port(self.host)
            # REUSE_PORT: the replicas on one host network share the port (SO_REUSEPORT).
            environment.update(HOST=self.host, PORT=str(self.port), REUSE_PORT="1")
            options.update(
                networks=["host"],
                # Every replica on the node this client reaches over loopback.
                constraints=[f"node.id=={node_id}"],
                healthcheck=Healthcheck(test=["NONE"]),
            )
        else:
            environment.update(HOST="0.0.0.0", PORT=str(self.container_port))
            published = {"PublishedPort": self._requested_port} if self._requested_port else {}
            port = {"Protocol": "tcp", "TargetPort": self.container_port, "PublishMode": "ingress"}
            options["endpoint_spec"] = {"Mode": "vip", "Ports": [{**port, **published}]}
            if self.health_interval is not None:
                interval = int(self.health_interval * 1e9)
                options["healthcheck"] = Healthcheck(interval=interval, start_period=interval)
        if self.cpus is not None or self.mem_limit is not None:
            options["resources"] = Resources(
                cpu_limit=int(self.cpus * 1e9) if self.cpus is not None else None,
                mem_limit=int(parse_bytes(self.mem_limit)) if self.mem_limit is not None else None,
            )
        owner = owner_labels(PROVIDER_SWARM)
        self._created = True
        service = self._services.create(
            self.image,
            name=self.name,
            args=self.args,
            env=environment,
            labels={**self.labels, **owner},
            mode=ServiceMode("replicated", replicas=self.replicas),
            restart_policy=RestartPolicy(condition="any", delay=1_000_000_000),
            stop_grace_period=int(self.stop_timeout * 1e9),
            stop_signal="SIGTERM",
            **options,
        )
        self.service_id = service.id

    def _wait_ready(self) -> None:
        """Wait for ``replicas`` running tasks that printed their serving line, then for
        the target's health.

        Raises:
            ProviderError: a replica failed, or not ready in time.
        """
        deadline = time.monotonic() + self.start_timeout
        while True:
            tasks = self.tasks()
            failed = [t for t in tasks if (t.get("Status") or {}).get("State") in _FAILED_STATES]
            if failed:
                detail = "; ".join(_describe_task(task) for task in failed[:5])
                raise ProviderError(f"service {self.name} ({self.image}): {detail}")
            running = {
                t["ID"]
                for t in tasks
                if t.get("DesiredState") == "running" and t["Status"].get("State") == "running"
            }
            ready = running & self._serving_tasks() if running else set()
            if len(ready) >= self.replicas:
                break
            if time.monotonic() > deadline:
                states = "; ".join(_describe_task(task) for task in tasks[:10]) or "no tasks"
                raise ProviderError(
                    f"{len(ready)} of {self.replicas} replicas of {self.name} serving after "
                    f"{self.start_timeout}s ({states})"
                )
            time.sleep(0.25)
        if self.endpoint == "ingress":
            self.port = self._published_port()
        try:
            wait_serving(
                self.target,
                self.health_service,
                max(1.0, deadline - time.monotonic()),
                credentials=self.credentials,
            )
        except ProviderError as exc:
            if self.endpoint == "ingress":
                ipvs = "" if os.path.exists("/proc/sys/net/ipv4/vs") else " (this kernel has none)"
                raise ProviderError(
                    f"{exc}: all {self.replicas} replicas serve, but the routing mesh does not "
                    f"answer; swarm's ingress needs IPVS, the ip_vs kernel module, on every "
                    f"node{ipvs}; endpoint='host' does not"
                ) from None
            raise

    def _published_port(self) -> int:
        service = self._services.get(self.service_id)
        for port in (service.attrs.get("Endpoint") or {}).get("Ports") or []:
            if port.get("TargetPort") == self.container_port and port.get("PublishedPort"):
                return int(port["PublishedPort"])
        raise ProviderError(f"service {self.name} has no published port")

    def tasks(self) -> list[dict[str, Any]]:
        """The service's tasks (every replica, with those that ended), newest first.

        Returns:
            Task objects of the Docker API (``[]`` when not started).
        """
        if self.service_id is None:
            return []
        tasks: list[dict[str, Any]] = self._api.tasks(filters={"service": self.service_id})
        return sorted(tasks, key=lambda task: str(task.get("CreatedAt", "")), reverse=True)

    def containers(self) -> list[Any]:
        """The service's containers on the daemon this provider talks to (any state).

        Returns:
            ``docker.models.containers.Container`` objects as the list call gives them
            (``.id``, ``.status``, ``.labels``; ``.reload()`` for the rest); ``[]`` when not
            started.
        """
        if not self._created:
            return []
        label = f"com.docker.swarm.service.name={self.name}"
        # Sparse: no inspect per container, which fails for one removed meanwhile.
        return list(self.client.containers.list(all=True, sparse=True, filters={"label": label}))

    def _log_lines(self, tail: int | str = "all") -> list[tuple[str, str]]:
        if self.service_id is None:
            return []
        stream = self.client.api.service_logs(
            self.service_id, details=True, stdout=True, stderr=True, tail=str(tail), is_tty=False
        )
        text = b"".join(stream).decode("utf-8", "replace")
        lines = []
        for line in text.splitlines():
            details, _, message = line.partition(" ")
            match = _TASK_ID.search(details)
            lines.append((match.group(1) if match else "?", message))
        return lines

    def _serving_tasks(self) -> set[str]:
        return {task for task, line in self._log_lines() if SERVING_LINE.search(line)}

    def logs(self, tail: int | str = "all") -> str:
        """What the replicas printed (stdout and stderr), each line after its task id.

        Args:
            tail: The last lines of each replica, or ``"all"``.

        Returns:
            The lines, ``"<task id> | <line>\\n"`` each ("" when not started).

        Raises:
            docker.errors.DockerException: the daemon failed to answer.
        """
        return "".join(f"{task[:12]} | {line}\n" for task, line in self._log_lines(tail))

    def _remove_service(self) -> None:
        """Remove the service and wait until its containers on this daemon are gone.

        Raises:
            ProviderError: they were still there after ``stop_timeout + 30`` seconds.
        """
        if not self._created:
            return
        with contextlib.suppress(NotFound):
            try:
                # By name when the create request never answered (it may have landed).
                self._api.remove_service(self.service_id or self.name)
            except APIError as exc:  # already being removed
                if exc.status_code != 409:
                    raise
        # Each replica drains (SIGTERM, then SIGKILL after stop_timeout) before swarm
        # removes its container: wait, so that "stopped" means "gone" to the caller.
        deadline = time.monotonic() + self.stop_timeout + 30.0
        while self.containers():
            if time.monotonic() > deadline:
                raise ProviderError(f"containers of service {self.name} still there")
            time.sleep(0.2)
        self.service_id = None
        self._created = False

    def _release_lease(self, removed: bool) -> None:
        fd, self._lease_fd = self._lease_fd, None
        if fd is not None:
            if removed:
                os.pwrite(fd, b"stopped", 0)  # the watchdog exits without looking
            os.close(fd)  # releases the lock
        if self._lease_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._lease_path)
            self._lease_path = None
        proc = self.watchdog_process
        if proc is not None and removed:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10.0)

    def _stop_servers(self) -> None:
        removed = False
        try:
            self._remove_service()
            removed = True
        finally:
            # Not removed (the daemon failed): the watchdog, now free, tries again.
            self._release_lease(removed)
            _LIVE.discard(self)
