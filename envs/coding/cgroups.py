"""Per-sandbox cgroups: one memory budget and one task budget for all of a sandbox's processes.

RLIMIT_AS bounds one process; six children of 400 MiB each still fit under a 512 MiB
RLIMIT_AS. A cgroup bounds them together: each sandbox gets its own, below the server's
cgroup, with ``memory.max`` (no swap) and ``pids.max`` set to the episode's limits, and
every run of the sandbox starts inside it (the harness moves itself in, as root, before
the code starts; see ``harness.py``). Pages of tmpfs files and SysV shared memory count
too, so ``/dev/shm`` cannot be used to go around it.

Both cgroup versions are handled: v2 (the unified hierarchy, where the server's cgroup
must delegate the ``memory`` and ``pids`` controllers to children) and v1 (separate
``memory`` and ``pids`` hierarchies). :func:`find_parents` says which one this host
offers, or why none.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CgroupParents", "SandboxCgroup", "destroy", "find_parents"]

#: How long :func:`destroy` retries removing a cgroup whose killed tasks are still exiting.
REMOVE_SECONDS = 2.0
#: Name of the leaf a v2 server moves itself into so that its cgroup may have children
#: with controllers ("no internal processes"), when it is alone in its cgroup.
SERVER_LEAF = "openenv-coding-server"


@dataclass(frozen=True, slots=True)
class CgroupParents:
    """Where sandbox cgroups are made on this host."""

    #: 2 (unified hierarchy) or 1.
    version: int
    #: The directory under which each sandbox's memory cgroup is made.
    memory: Path
    #: The same for the pids controller (v2: the same directory; None: no pids controller).
    pids: Path | None


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(fstype, mount point, root within the hierarchy, super options) of cgroup mounts."""
    found = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
                found.append((tail[0], fields[4], fields[3], set(tail[2].split(","))))
    return found


def _own_paths() -> dict[str, str]:
    """Controller ("" for the unified hierarchy) -> this process's cgroup path."""
    paths = {}
    with open("/proc/self/cgroup") as cgroup:
        for line in cgroup:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                paths[name.removeprefix("name=")] = path
    return paths


def _locate(mount_point: str, root: str, path: str) -> Path | None:
    """The directory of cgroup ``path`` under a mount of the hierarchy's ``root``."""
    if root != "/" and not (path == root or path.startswith(root + "/")):
        return None  # our cgroup is outside what this mount shows
    rel = path[len(root) :] if root != "/" else path
    directory = Path(mount_point) / rel.lstrip("/")
    return directory if directory.is_dir() else None


def find_parents() -> tuple[CgroupParents | None, str]:
    """Where this process may make sandbox cgroups; or None and why not."""
    try:
        mounts, own = _mounts(), _own_paths()
    except (OSError, ValueError) as exc:
        return None, f"cannot read this process's cgroups: {exc}"
    reasons = []
    for fstype, point, root, _ in mounts:
        if fstype == "cgroup2" and "" in own:
            directory = _locate(point, root, own[""])
            if directory is None:
                reasons.append(f"cgroup v2: this process's cgroup is not under {point}")
                continue
            parents, why = _v2_parents(directory)
            if parents is not None:
                return parents, ""
            reasons.append(why)
    v1 = {}
    for fstype, point, root, options in mounts:
        for controller in ("memory", "pids"):
            if fstype == "cgroup" and controller in options and controller in own:
                directory = _locate(point, root, own[controller])
                if directory is not None and os.access(directory, os.W_OK):
                    v1[controller] = directory
    if "memory" in v1:
        return CgroupParents(1, v1["memory"], v1.get("pids")), ""
    reasons.append("cgroup v1: no writable memory hierarchy")
    return None, "; ".join(reasons)


def _v2_parents(own: Path) -> tuple[CgroupParents | None, str]:
    """Make ``own`` hand the memory and pids controllers to its children, if it can."""
    try:
        available = (own / "cgroup.controllers").read_text().split()
    except OSError as exc:
        return None, f"cgroup v2: {exc}"
    if "memory" not in available:
        return None, f"cgroup v2: no memory controller in {own}"
    wanted = [c for c in ("memory", "pids") if c in available]
    if not os.access(own, os.W_OK):
        return None, f"cgroup v2: {own} is not writable"
    try:
        _enable(own, wanted)
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            return None, f"cgroup v2: cannot enable {wanted} for children of {own}: {exc}"
        # "No internal processes": a cgroup holding processes cannot give its children
        # controllers. Alone in it, this server moves itself into a leaf; else it can't.
        members = (own / "cgroup.procs").read_text().split()
        if members != [str(os.getpid())]:
            return None, (
                f"cgroup v2: {own} holds other processes ({len(members)}), so it cannot "
                f"delegate {wanted}; start the server alone in its cgroup"
            )
        try:
            leaf = own / SERVER_LEAF
            leaf.mkdir(exist_ok=True)
            (leaf / "cgroup.procs").write_text(str(os.getpid()))
            _enable(own, wanted)
        except OSError as again:
            return None, f"cgroup v2: cannot move the server into {own / SERVER_LEAF}: {again}"
    return CgroupParents(2, own, own if "pids" in wanted else None), ""


def _enable(own: Path, controllers: Sequence[str]) -> None:
    active = (own / "cgroup.subtree_control").read_text().split()
    missing = [c for c in controllers if c not in active]
    if missing:
        (own / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in missing))


class SandboxCgroup:
    """One sandbox's cgroup (one directory per hierarchy), made with its limits set.

    Raises:
        OSError: a directory or limit could not be made; nothing is left behind.
    """

    def __init__(self, parents: CgroupParents, name: str, memory_bytes: int, tasks: int) -> None:
        self.version = parents.version
        self.paths: list[Path] = []
        try:
            memory = parents.memory / name
            memory.mkdir()
            self.paths.append(memory)
            if self.version == 2:
                _write(memory / "memory.max", memory_bytes)
                _write(memory / "memory.swap.max", 0, optional=True)
                if parents.pids is not None:
                    _write(memory / "pids.max", tasks)
            else:
                _write(memory / "memory.limit_in_bytes", memory_bytes)
                # With swap accounting on, memory + swap gets the same budget: no swap.
                _write(memory / "memory.memsw.limit_in_bytes", memory_bytes, optional=True)
                if parents.pids is not None:
                    pids = parents.pids / name
                    pids.mkdir()
                    self.paths.append(pids)
                    _write(pids / "pids.max", tasks)
        except BaseException:
            destroy(self.paths)
            raise

    @property
    def procs_files(self) -> list[str]:
        """The files a process writes its pid to, to join (the harness does)."""
        return [str(path / "cgroup.procs") for path in self.paths]

    def oom_kills(self) -> int:
        """Processes the kernel killed so far for going over the memory budget."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in (self.paths[0] / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError, IndexError):
            pass
        return 0

    def empty(self) -> bool:
        """No process is in it: nothing of the sandbox is alive, nor can be born (a
        process joins only as its parent's child, and the code cannot move itself)."""
        return not any(_members(path) for path in self.paths)

    def destroy(self) -> bool:
        """Kill what runs in it and remove it; True when it is gone."""
        return destroy(self.paths)


def _write(path: Path, value: int, *, optional: bool = False) -> None:
    if optional and not path.exists():
        return
    path.write_text(str(value))


def _members(path: Path) -> list[int]:
    """The pids in cgroup ``path`` ([] when it is gone; [-1] when it cannot be read)."""
    try:
        return [int(pid) for pid in (path / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []
    except (OSError, ValueError):
        return [-1]


def _kill_members(path: Path) -> None:
    """SIGKILL every process in the cgroup ``path`` (not its children's: it has none)."""
    with contextlib.suppress(OSError):
        (path / "cgroup.kill").write_text("1")  # v2, Linux 5.14+: all at once
    for pid in _members(path):
        if pid < 0:
            continue
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            if pid in _members(path):  # pinned by the pidfd: still the same process
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(pidfd)


def destroy(paths: Sequence[Path | str]) -> bool:
    """Kill every process in the cgroups ``paths`` and remove them; True when all are gone.

    Safe on paths that do not exist (already removed, or never made).
    """
    deadline = time.monotonic() + REMOVE_SECONDS
    left = [Path(p) for p in paths]
    while left:
        for path in list(left):
            if not path.exists():
                left.remove(path)
                continue
            _kill_members(path)
            try:
                path.rmdir()
                left.remove(path)
            except FileNotFoundError:
                left.remove(path)
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    return False
        if left:
            time.sleep(0.01)  # killed tasks are still exiting
    return True
