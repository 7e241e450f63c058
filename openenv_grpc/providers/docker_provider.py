"""``LocalDockerProvider``: an environment image as a container on a local Docker daemon.

The container shares the host's network (``--network=host``; never the default bridge) and
its server listens on a free loopback port (``HOST=127.0.0.1``, ``PORT=<port>``), so the
target is ``127.0.0.1:<port>`` and nothing is published beyond this machine. The provider
waits for ``grpc.health.v1`` SERVING; :meth:`~LocalDockerProvider.stop` (or leaving the
``with`` block) sends SIGTERM (the server drains), then removes the container.

No container outlives its owner, even when the owner is SIGKILLed between start and stop:

- **Lease watchdog** (``watchdog=True``, the default; needs the daemon on this machine and
  ``python3`` in the image). The provider holds an exclusive ``flock`` on a lease file that
  is bind-mounted read-only into the container, whose PID 1 is a small watchdog that runs
  the image's command. The kernel drops the lock when the owner dies, however it dies; the
  watchdog then gets the lock and SIGTERMs the server, and the container, started with
  ``auto_remove``, is deleted by the daemon.
- **Owner labels**: every container carries the owner's pid, process start time, pid
  namespace and boot id. :func:`cleanup_orphans` (run by every :meth:`start`) removes the
  containers whose owner is gone -- also those a watchdog could not stop (never started,
  ``watchdog=False``, an image without python3).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import docker
import grpc
from docker.errors import APIError, DockerException, ImageNotFound, NotFound

from openenv_grpc.metadata import SERVICE_NAME, SERVING_LINE
from openenv_grpc.providers.base import Provider, ProviderError, wait_serving
from openenv_grpc.providers.ownership import (
    LABEL_OWNER_BOOT,
    LABEL_OWNER_PID,
    LABEL_OWNER_PIDNS,
    LABEL_OWNER_START,
    LABEL_PROVIDER,
    owner_gone,
    owner_labels,
    remove_stale_leases,
    take_lease,
)

if TYPE_CHECKING:
    from docker.models.containers import Container

__all__ = [
    "LABEL_OWNER_BOOT",
    "LABEL_OWNER_PID",
    "LABEL_OWNER_PIDNS",
    "LABEL_OWNER_START",
    "LABEL_PROVIDER",
    "LocalDockerProvider",
    "cleanup_orphans",
    "docker_client",
]

#: Where the lease file appears inside the container.
LEASE_PATH = "/run/openenv-grpc/lease"


# PID 1 of a watched container: runs the image's command, forwards signals, reaps
# zombies, and SIGTERMs the server once it can lock the lease (= the owner is gone).
WATCHDOG = r"""
import fcntl, os, signal, subprocess, sys, threading, time
child = subprocess.Popen(sys.argv[1:])
def forward(signum, frame):
    try:
        os.kill(child.pid, signum)
    except ProcessLookupError:
        pass
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, forward)
def watch():
    try:
        fd = os.open(os.environ.get("OPENENV_LEASE", "/run/openenv-grpc/lease"), os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        why = "its owner is gone"
    except OSError as exc:
        why = "the lease is unreadable: %s" % exc
    print("openenv-grpc watchdog: %s, stopping the server" % why, file=sys.stderr, flush=True)
    forward(signal.SIGTERM, None)
    time.sleep(float(os.environ.get("OPENENV_WATCHDOG_KILL_AFTER", "35")))
    forward(signal.SIGKILL, None)
threading.Thread(target=watch, daemon=True).start()
while True:
    pid, status = os.wait()
    if pid == child.pid:
        sys.exit(os.waitstatus_to_exitcode(status))
"""

#: Providers with a live container; the interpreter's exit stops them.
_LIVE: weakref.WeakSet[LocalDockerProvider] = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:
    for provider in list(_LIVE):
        provider.stop()


def docker_client() -> docker.DockerClient:
    """A client for the daemon named by ``DOCKER_HOST`` (or the default socket).

    Returns:
        A connected ``docker.DockerClient``.

    Raises:
        ProviderError: no daemon answers.
    """
    try:
        client = docker.from_env()
        client.ping()
    except DockerException as exc:
        raise ProviderError(
            f"no Docker daemon answers ({exc}); start one with scripts/start_dockerd.sh "
            "and export the DOCKER_HOST it prints"
        ) from exc
    return client


def cleanup_orphans(client: docker.DockerClient | None = None) -> list[str]:
    """Remove (force) every container of this provider whose owner process is gone.

    Args:
        client: The daemon to clean (default: :func:`docker_client`).

    Returns:
        The names of the removed containers.

    Raises:
        ProviderError: no daemon answers.
    """
    client = client or docker_client()
    remove_stale_leases()
    removed = []
    # Sparse: a full list inspects each container and fails (NotFound) on one removed
    # meanwhile; the list's own fields carry the labels and names.
    found = client.containers.list(all=True, sparse=True, filters={"label": LABEL_PROVIDER})
    for container in found:
        if owner_gone(container.attrs.get("Labels") or {}):
            with contextlib.suppress(NotFound):
                try:
                    container.remove(force=True)
                except APIError as exc:  # 409: the daemon is already removing it
                    if exc.status_code != 409:
                        raise
            names = container.attrs.get("Names") or [container.id or "?"]
            removed.append(names[0].lstrip("/"))
    return removed


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class LocalDockerProvider(Provider):
    """One container of an environment image on the local Docker daemon.

    Args:
        image: The image, e.g. ``openenv-grpc-echo:0.1.0`` (``make image ENV=echo``). Its
            entrypoint must run ``openenv-grpc serve`` and honour ``HOST`` / ``PORT``.
        args: More ``serve`` flags, appended to the image's command.
        max_concurrent_envs: ``MAX_CONCURRENT_ENVS`` (None: the image's setting).
        grace: ``GRACE_PERIOD`` seconds for the drain on stop (None: the server's, 25).
        cpus: CPU limit in cores (``--cpus``; None: no limit).
        mem_limit: Memory limit, e.g. ``"512m"`` (``--memory``; None: no limit).
        pids_limit: Most processes in the container (None: no limit).
        extra_env: More environment variables for the container.
        labels: More container labels.
        name_prefix: Container names are ``<prefix>-<image>-<pid>-<random>``.
        watchdog: Run the image's command under the lease watchdog (see the module doc).
            Needs the daemon on this machine and ``python3`` in the image.
        start_timeout: Seconds to wait for the port line and then for SERVING.
        stop_timeout: Seconds :meth:`stop` gives the drain before SIGKILL; default
            ``grace + 5``.
        client: The Docker client (default: :func:`docker_client`, from ``DOCKER_HOST``).
        health_service: The health service that must be SERVING.
    """

    def __init__(
        self,
        image: str,
        *,
        args: Sequence[str] = (),
        max_concurrent_envs: int | None = None,
        grace: float | None = None,
        cpus: float | None = None,
        mem_limit: str | None = None,
        pids_limit: int | None = None,
        extra_env: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        name_prefix: str = "openenv-grpc",
        watchdog: bool = True,
        start_timeout: float = 60.0,
        stop_timeout: float | None = None,
        client: docker.DockerClient | None = None,
        health_service: str = SERVICE_NAME,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        super().__init__(credentials=credentials)
        self.image = image
        self.args = list(args)
        self.cpus = cpus
        self.mem_limit = mem_limit
        self.pids_limit = pids_limit
        self.labels = dict(labels or {})
        self.watchdog = watchdog
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout if stop_timeout is not None else (grace or 25.0) + 5.0
        self.health_service = health_service
        self.environment = dict(extra_env or {})
        if max_concurrent_envs is not None:
            self.environment["MAX_CONCURRENT_ENVS"] = str(max_concurrent_envs)
        if grace is not None:
            self.environment["GRACE_PERIOD"] = str(grace)
        slug = re.sub(r"[^a-zA-Z0-9_.-]+", "-", image.rsplit("/", 1)[-1].split(":")[0])
        slug = slug.removeprefix(f"{name_prefix}-")
        self.name = f"{name_prefix}-{slug}-{os.getpid()}-{secrets.token_hex(4)}"
        self._client = client
        self.container: Container | None = None
        self.port = 0
        #: Everything the container wrote to stdout and stderr, in order.
        self.output: list[str] = []
        self._lease_fd: int | None = None
        self._lease_path: str | None = None
        self._announced = threading.Event()

    @property
    def client(self) -> docker.DockerClient:
        """The Docker client (connected on first use).

        Raises:
            ProviderError: no daemon answers.
        """
        if self._client is None:
            self._client = docker_client()
        return self._client

    @property
    def target(self) -> str:
        """``127.0.0.1:port`` of the running container's server.

        Raises:
            ProviderError: not started.
        """
        if not self.port or self.container is None:
            raise ProviderError("the provider has not been started")
        return f"127.0.0.1:{self.port}"

    def logs(self) -> str:
        """What the container printed so far (stdout and stderr interleaved)."""
        return "".join(self.output)

    def start(self) -> None:
        """Remove orphans, start the container, wait until its server is SERVING.

        A taken port (another process bound it between our pick and the server's bind)
        is retried on a fresh port, up to three times.

        Raises:
            ProviderError: no daemon, no such image, or the server did not become healthy
                within ``start_timeout`` (the container is removed then; its output is in
                the message).
            RuntimeError: already started.
        """
        if self.container is not None:
            raise RuntimeError("the provider is already started")
        cleanup_orphans(self.client)
        try:
            config = self.client.images.get(self.image).attrs["Config"]
        except ImageNotFound as exc:
            raise ProviderError(f"no image {self.image!r}: build it (make image)") from exc
        command = [*(config.get("Entrypoint") or []), *(config.get("Cmd") or []), *self.args]
        _LIVE.add(self)
        try:
            if self.watchdog:
                self._take_lease()
            for attempt in range(3):
                if self._run(command):
                    return
                if attempt < 2:
                    self.output.append(f"[provider: port {self.port} was taken, retrying]\n")
            raise ProviderError(f"no free port for {self.image} after 3 attempts")
        except BaseException as exc:  # includes KeyboardInterrupt: never leave a container
            output = self.logs()
            self.stop()
            if isinstance(exc, ProviderError):
                raise ProviderError(f"{exc}; container output:\n{output[-4000:]}") from None
            raise

    def _take_lease(self) -> None:
        # 0o644: the container's (non-root) watchdog must open it.
        self._lease_fd, self._lease_path = take_lease(0o644)

    def _run(self, command: list[str]) -> bool:
        """Create, attach to and start one container; wait for SERVING.

        Returns:
            True once SERVING; False when the server could not bind its port (the
            container is gone then).

        Raises:
            ProviderError: any other failure to start.
        """
        self.port = _free_loopback_port()
        environment = {
            **self.environment,
            "HOST": "127.0.0.1",
            "PORT": str(self.port),
            "PYTHONUNBUFFERED": "1",
        }
        # The image's entrypoint + command, given whole (the image's CMD then does not apply).
        options: dict[str, Any] = {"entrypoint": command}
        if self.watchdog:
            assert self._lease_path is not None
            options["entrypoint"] = ["python3", "-c", WATCHDOG, *command]
            options["volumes"] = {self._lease_path: {"bind": LEASE_PATH, "mode": "ro"}}
            environment["OPENENV_LEASE"] = LEASE_PATH
            environment["OPENENV_WATCHDOG_KILL_AFTER"] = str(self.stop_timeout)
        if self.cpus is not None:
            options["nano_cpus"] = int(self.cpus * 1e9)
        if self.mem_limit is not None:
            options["mem_limit"] = self.mem_limit
        if self.pids_limit is not None:
            options["pids_limit"] = self.pids_limit
        self.container = self.client.containers.create(
            self.image,
            name=self.name if not self.output else f"{self.name}-{secrets.token_hex(2)}",
            labels={**self.labels, **owner_labels("docker")},
            environment=environment,
            network_mode="host",
            auto_remove=True,
            stop_signal="SIGTERM",
            **options,
        )
        # Attached before start: no line is missed, and the stream ends when it exits.
        stream = self.container.attach(stdout=True, stderr=True, stream=True, logs=True)
        self._announced.clear()
        reader = threading.Thread(target=self._read_output, args=(stream,), daemon=True)
        reader.start()
        self.container.start()
        try:
            # The port line first: health checks sent before the server listens would put
            # the channel into reconnect backoff and cost seconds.
            if not self._announced.wait(self.start_timeout) or not reader.is_alive():
                raise ProviderError(f"{self.image} printed no port in {self.start_timeout}s")
            wait_serving(
                self.target,
                self.health_service,
                self.start_timeout,
                reader.is_alive,
                credentials=self.credentials,
            )
        except ProviderError:
            reader.join(2.0)
            if "cannot listen" in self.logs() and not reader.is_alive():
                self._remove_container()
                return False
            raise
        return True

    def _read_output(self, stream: Any) -> None:
        pending = ""
        for chunk in stream:
            pending += chunk.decode("utf-8", "replace")
            *lines, pending = pending.split("\n")
            for line in lines:
                self.output.append(line + "\n")
                if SERVING_LINE.search(line):
                    self._announced.set()
        if pending:
            self.output.append(pending)
        self._announced.set()  # the container ended: stop waiting

    def _remove_container(self) -> None:
        container, self.container = self.container, None
        if container is None:
            return
        with contextlib.suppress(NotFound):
            try:
                container.stop(timeout=max(1, round(self.stop_timeout)))
            except APIError as exc:  # 409: the daemon is already removing it
                if exc.status_code != 409:
                    raise
        with contextlib.suppress(NotFound):
            try:
                container.remove(force=True)
            except APIError as exc:
                if exc.status_code != 409:
                    raise
        # auto_remove deletes it asynchronously after it stops: wait, so that "stopped"
        # means "gone" to the caller.
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            try:
                container.reload()
            except NotFound:
                return
            time.sleep(0.1)
        raise ProviderError(f"container {container.name} was not removed within 30 s")

    def _stop_servers(self) -> None:
        try:
            self._remove_container()
        finally:
            if self._lease_fd is not None:
                os.close(self._lease_fd)  # releases the lock
                self._lease_fd = None
            if self._lease_path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self._lease_path)
                self._lease_path = None
            _LIVE.discard(self)
