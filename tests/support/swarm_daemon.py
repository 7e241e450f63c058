"""A private single-node Docker swarm inside a network namespace of its own, for tests.

``docker swarm init`` makes networks with private-range addresses (``docker_gwbridge``,
the ``ingress`` overlay), which this project never puts on the host (DESIGN.md §6). So
:class:`SwarmDaemon` creates a network namespace (``oeg-swarm-<pid>-<start>``, only ``lo``
in it, no link to anything outside), runs a second dockerd there with its own data root,
exec root, pidfile and cgroup parent, listening on a unix socket on the shared filesystem
(``/run/openenv-grpc-swarm-<tag>.sock``: the docker SDK in the host namespace reaches it),
and makes it a swarm manager advertising 127.0.0.1. Whatever talks to the *servers* must
run inside the namespace: ``daemon.run_inside([python, script, ...])`` (``nsenter --net``).

dockerd is started with ``nsenter --net``, not ``ip netns exec``: the latter also remounts
/sys, which hides the cgroup mounts dockerd needs ("Devices cgroup isn't mounted").

:meth:`SwarmDaemon.stop` tears it all down: services, ``swarm leave --force``, dockerd
(SIGTERM, then SIGKILL), its containerd and shims, every process left in the namespace or
in the daemon's cgroups, the mounts under its roots, its files, the namespace.
:func:`cleanup_leftovers` (run by :meth:`SwarmDaemon.start`) does the same for the daemons
of test runs that were killed before they could.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import docker

__all__ = ["SwarmDaemon", "cleanup_leftovers"]

NETNS_PREFIX = "oeg-swarm-"
_TAG = re.compile(r"^(\d+)-(\d+)$")


def _start_ticks(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (None: no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()[19]


def _tag_alive(tag: str) -> bool:
    match = _TAG.match(tag)
    return bool(match) and _start_ticks(int(match.group(1))) == match.group(2)


def _run(*command: str, timeout: float = 30.0, check: bool = False) -> str:
    out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=check)
    return out.stdout


def _pids_mentioning(*needles: str) -> list[int]:
    """Processes whose command line contains one of ``needles`` (never this process)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if any(needle in cmdline for needle in needles):
            found.append(int(entry.name))
    return found


def _kill(pids: Sequence[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _wait_gone(pids: Sequence[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not [pid for pid in pids if Path(f"/proc/{pid}").exists() and not _zombie(pid)]:
            return True
        time.sleep(0.1)
    return False


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2 :].startswith("Z")


class SwarmDaemon:
    """One namespaced dockerd in swarm mode (see the module doc).

    Args:
        tag: Names its namespace, files and cgroups; default ``<pid>-<start ticks>`` of this
            process, so a later run can tell a dead run's leftovers from a live run's.
    """

    def __init__(self, tag: str | None = None) -> None:
        if tag is None:
            tag = f"{os.getpid()}-{_start_ticks(os.getpid())}"
        self.tag = tag
        self.netns = f"{NETNS_PREFIX}{tag}"
        self.data_root = Path(f"/var/lib/openenv-grpc-swarm-{tag}")
        self.exec_root = Path(f"/run/openenv-grpc-swarm-{tag}")
        self.socket = Path(f"/run/openenv-grpc-swarm-{tag}.sock")
        self.pidfile = Path(f"/run/openenv-grpc-swarm-{tag}.pid")
        self.log = Path(f"/run/openenv-grpc-swarm-{tag}.log")
        self.cgroup_parent = f"openenv-grpc-swarm-{tag}"
        self.url = f"unix://{self.socket}"
        self.process: subprocess.Popen[bytes] | None = None
        self._client: docker.DockerClient | None = None

    @property
    def client(self) -> docker.DockerClient:
        """A client of this daemon (from the host namespace, over the unix socket)."""
        if self._client is None:
            self._client = docker.DockerClient(base_url=self.url, timeout=60)
        return self._client

    def nsenter(self) -> list[str]:
        """The command prefix that runs a program inside the namespace."""
        return ["nsenter", f"--net=/run/netns/{self.netns}"]

    def start(self, timeout: float = 60.0) -> None:
        """Clean up dead runs, create the namespace, start dockerd, ``swarm init``.

        Raises:
            RuntimeError: dockerd did not answer in time (its log is in the message).
        """
        cleanup_leftovers()
        _run("ip", "netns", "add", self.netns, check=True)
        _run("ip", "-n", self.netns, "link", "set", "lo", "up", check=True)
        self.data_root.mkdir(parents=True, exist_ok=True)
        self.exec_root.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [
                    *self.nsenter(),
                    "dockerd",
                    "--data-root", str(self.data_root),
                    "--exec-root", str(self.exec_root),
                    "--pidfile", str(self.pidfile),
                    "--host", self.url,
                    "--cgroup-parent", f"/{self.cgroup_parent}",
                    "--bridge=none",
                ],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"dockerd exited; its log:\n{self.log_tail()}")
            with contextlib.suppress(Exception):
                if self.socket.exists() and self.client.ping():
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"dockerd did not answer in {timeout}s:\n{self.log_tail()}")
            time.sleep(0.2)
        self.client.swarm.init(advertise_addr="127.0.0.1", listen_addr="127.0.0.1:2377")

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of dockerd's log."""
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def load_image(self, source: docker.DockerClient, image: str) -> str:
        """Copy ``image`` from the daemon of ``source`` into this one (save | load).

        Returns:
            The image's tag (unchanged).
        """
        wanted = source.images.get(image).id
        with contextlib.suppress(docker.errors.ImageNotFound):
            if self.client.images.get(image).id == wanted:
                return image
        api: Any = self.client.api  # the stubs leave load_image's data untyped
        for _ in api.load_image(source.api.get_image(image, chunk_size=1 << 20)):
            pass
        assert self.client.images.get(image).id == wanted
        return image

    def run_inside(
        self, command: Sequence[str], timeout: float = 120.0, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run ``command`` inside the namespace and wait for it (output captured)."""
        return subprocess.run(
            [*self.nsenter(), *command], capture_output=True, text=True, timeout=timeout, **kwargs
        )

    def popen_inside(self, command: Sequence[str], **kwargs: Any) -> subprocess.Popen[str]:
        """Start ``command`` inside the namespace (``nsenter`` execs it: same pid)."""
        return subprocess.Popen([*self.nsenter(), *command], text=True, **kwargs)

    def stop(self) -> None:
        """Tear everything down (see the module doc). Safe to call twice."""
        if self._client is not None:
            with contextlib.suppress(Exception):
                for service in self._client.services.list():
                    service.remove()
                self._client.swarm.leave(force=True)
            self._client.close()
            self._client = None
        teardown(self.tag, self.process)
        self.process = None


def teardown(tag: str, process: subprocess.Popen[bytes] | None = None) -> None:
    """Stop the daemon of ``tag`` and remove every trace of it (also of a dead run)."""
    daemon = SwarmDaemon(tag)
    pid = None
    with contextlib.suppress(OSError, ValueError):
        pid = int(daemon.pidfile.read_text().strip())
    if process is not None:
        pid = process.pid
    if pid is not None and Path(f"/proc/{pid}").exists():
        _kill([pid], signal.SIGTERM)  # dockerd stops its containers and its containerd
        if not _wait_gone([pid], 20.0):
            _kill([pid])
    if process is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(5)
    # containerd, its shims, and whatever else still runs from our roots; then every
    # process left in the namespace (host-network containers) or in our cgroups.
    roots = [str(daemon.exec_root), str(daemon.data_root)]
    strays = _pids_mentioning(*(f"{root}{end}" for root in roots for end in ("/", " ")))
    if Path(f"/run/netns/{daemon.netns}").exists():
        strays += [int(p) for p in _run("ip", "netns", "pids", daemon.netns).split()]
    cgroups = sorted(Path("/sys/fs/cgroup").glob(f"*/{daemon.cgroup_parent}"))
    for group in cgroups:
        for procs in group.rglob("cgroup.procs"):
            with contextlib.suppress(OSError, ValueError):
                strays += [int(p) for p in procs.read_text().split()]
    strays = sorted(set(strays) - {os.getpid()})
    _kill(strays)
    _wait_gone(strays, 10.0)
    # Mounts (container filesystems, network namespaces of sandboxes), deepest first.
    prefixes = tuple(f"{root}/" for root in roots)
    mounts = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(prefixes) or point in roots:
                mounts.append(point)
    for point in sorted(set(mounts), key=len, reverse=True):
        _run("umount", "-l", point)
    for path in (daemon.data_root, daemon.exec_root):
        shutil.rmtree(path, ignore_errors=True)
    for path in (daemon.socket, daemon.pidfile, daemon.log):
        with contextlib.suppress(OSError):
            path.unlink()
    for group in cgroups:  # children first
        for sub in sorted(group.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if sub.is_dir():
                with contextlib.suppress(OSError):
                    sub.rmdir()
        with contextlib.suppress(OSError):
            group.rmdir()
    if Path(f"/run/netns/{daemon.netns}").exists():
        _run("ip", "netns", "delete", daemon.netns)


def cleanup_leftovers() -> list[str]:
    """Tear down the daemons of test runs whose process is gone.

    Returns:
        The tags cleaned up.
    """
    tags = set()
    for name in _run("ip", "netns", "list").split():
        if name.startswith(NETNS_PREFIX):
            tags.add(name.removeprefix(NETNS_PREFIX))
    for path in Path("/run").glob("openenv-grpc-swarm-*"):
        tags.add(re.sub(r"\.(sock|pid|log)$", "", path.name.removeprefix("openenv-grpc-swarm-")))
    dead = sorted(tag for tag in tags if _TAG.match(tag) and not _tag_alive(tag))
    for tag in dead:
        teardown(tag)
    return dead
