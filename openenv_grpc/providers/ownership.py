"""Who owns a container or service, and whether that owner still lives.

The Docker providers label what they create with the owner's pid, process start time,
pid namespace and boot id, so a later run can tell a dead owner from a live one (a reused
pid has another start time); and they hold a lease (an ``flock``ed file) that a watchdog
waits on, since the kernel drops the lock however the owner dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
from collections.abc import Mapping

__all__ = [
    "LABEL_OWNER_BOOT",
    "LABEL_OWNER_PID",
    "LABEL_OWNER_PIDNS",
    "LABEL_OWNER_START",
    "LABEL_PROVIDER",
    "owner_gone",
    "owner_labels",
    "process_start",
    "remove_stale_leases",
    "take_lease",
]

#: Label on everything a provider creates; its value names the provider (docker, swarm).
LABEL_PROVIDER = "org.openenv-grpc.provider"
LABEL_OWNER_PID = "org.openenv-grpc.owner-pid"
#: Start time of the owner process (clock ticks since boot): tells a reused pid apart.
LABEL_OWNER_START = "org.openenv-grpc.owner-start"
LABEL_OWNER_PIDNS = "org.openenv-grpc.owner-pidns"
LABEL_OWNER_BOOT = "org.openenv-grpc.owner-boot"

_LEASE_PREFIX = "openenv-grpc-lease-"


def process_start(pid: int) -> str | None:
    """Start time of process ``pid`` in clock ticks since boot (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its end.
    return stat[stat.rfind(")") + 2 :].split()[19]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def owner_labels(provider: str) -> dict[str, str]:
    """The labels naming this process as the owner, for ``provider`` (docker, swarm)."""
    pid = os.getpid()
    return {
        LABEL_PROVIDER: provider,
        LABEL_OWNER_PID: str(pid),
        LABEL_OWNER_START: process_start(pid) or "",
        LABEL_OWNER_PIDNS: _pid_namespace(),
        LABEL_OWNER_BOOT: _read("/proc/sys/kernel/random/boot_id"),
    }


def owner_gone(labels: Mapping[str, str]) -> bool:
    """True when the labels name a process of this machine (same boot, same pid
    namespace) that no longer runs. Owners this process cannot see are presumed alive."""
    if labels.get(LABEL_OWNER_BOOT) != _read("/proc/sys/kernel/random/boot_id"):
        return False
    if labels.get(LABEL_OWNER_PIDNS) != _pid_namespace():
        return False
    try:
        pid = int(labels.get(LABEL_OWNER_PID, ""))
    except ValueError:
        return False
    return process_start(pid) != labels.get(LABEL_OWNER_START)


def take_lease(mode: int = 0o600) -> tuple[int, str]:
    """A new lease file of this process, locked exclusively; returns (fd, path).

    Keep the fd open for as long as the lease should hold: the lock goes with the
    process, however it ends. ``mode`` 0o644 lets a watchdog of another user open it.
    """
    pid = os.getpid()
    fd, path = tempfile.mkstemp(prefix=f"{_LEASE_PREFIX}{pid}-{process_start(pid)}-")
    os.fchmod(fd, mode)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd, path


def remove_stale_leases() -> None:
    """Delete the lease files of dead owners (a SIGKILLed owner cannot delete its own).

    Deleting one is harmless even if a container still mounts it: the mount holds the file.
    """
    pattern = re.compile(rf"{_LEASE_PREFIX}(\d+)-(\d+)-")
    directory = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            match = pattern.match(entry.name)
            if match and process_start(int(match.group(1))) != match.group(2):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
