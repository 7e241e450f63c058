"""Finding, killing and reaping the host's processes through ``/proc``.

A process is named by its pid *and* its start time (clock ticks since boot, field 22 of
``/proc/PID/stat``): pids are reused, the pair is not.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "ProcFields",
    "become_subreaper",
    "kill_matching",
    "processes",
    "quiet",
    "reap_orphans",
    "start_time",
]


@dataclass(frozen=True, slots=True)
class ProcFields:
    """What :func:`processes` reads of one process."""

    pid: int
    uid: int
    session: int
    threads: int
    parent: int
    zombie: bool
    #: Start time in clock ticks after boot: with the pid, a name that is never reused.
    start: int


def processes(match: Callable[[ProcFields], bool], *, zombies: bool = False) -> list[ProcFields]:
    """Live processes of the host that ``match`` selects (or, with ``zombies``, dead ones)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = read_proc(int(name))
        if fields is not None and fields.zombie == zombies and match(fields):
            found.append(fields)
    return found


def start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (see the module docstring); None if it is gone."""
    fields = read_proc(pid)
    return None if fields is None or fields.zombie else fields.start


def read_proc(pid: int) -> ProcFields | None:
    """One process's fields, or None when it is gone (or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
        # The command name may hold spaces and parentheses: split after the last ")".
        rest = stat_line.rsplit(b")", 1)[1].split()
        uid_at = status.index(b"\nUid:")
        uid = int(status[uid_at + 5 :].split(None, 1)[0])  # the real uid
        zombie = rest[0] in (b"Z", b"X")
        return ProcFields(
            pid, uid, int(rest[3]), int(rest[17]), int(rest[1]), zombie, int(rest[19])
        )
    except (OSError, ValueError, IndexError):
        return None  # gone meanwhile, or not ours to read


def reap_orphans(match: Callable[[ProcFields], bool]) -> int:
    """Reap the zombies ``match`` selects that were left to this process; how many.

    Killed sandbox processes whose parent died first are reparented to the nearest
    subreaper (this server, see :func:`become_subreaper`) or to pid 1, which is this
    server too when it runs as a container's first process. Nobody else would reap them,
    and under the sandbox's uid every zombie still counts against RLIMIT_NPROC.
    """
    try:  # one syscall says whether this process has any zombie child at all
        if os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            return 0
    except ChildProcessError:
        return 0  # no children
    me = os.getpid()
    reaped = 0
    for zombie in processes(lambda f: f.parent == me and match(f), zombies=True):
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(zombie.pid, os.WNOHANG)[0]:
                reaped += 1
    return reaped


def become_subreaper() -> bool:
    """Make orphaned descendants this process's children (PR_SET_CHILD_SUBREAPER)."""
    if os.getpid() == 1:
        return True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(36, 1, 0, 0, 0) == 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def kill_pid(pid: int, match: Callable[[ProcFields], bool]) -> None:
    """SIGKILL ``pid`` if it still matches, without racing pid reuse (via a pidfd)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return  # already gone
    try:
        # The pidfd pins the process: if /proc/pid still matches, it is the same one.
        fields = read_proc(pid)
        if fields is not None and match(fields):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(pidfd)


def kill_matching(match: Callable[[ProcFields], bool], rounds: int = 200) -> bool:
    """SIGKILL every process ``match`` selects, until none is left; True if none is."""
    for attempt in range(rounds):
        victims = processes(match)
        if not victims:
            return True
        for victim in victims:
            kill_pid(victim.pid, match)
        time.sleep(min(0.001 * attempt, 0.02))  # let the kernel tear them down
    return not processes(match)


def quiet(argv: list[str], env: dict[str, str] | None = None) -> str | None:
    """Run a short helper command; its stdout, or None when it failed or could not start."""
    try:
        done = subprocess.run(
            argv, capture_output=True, timeout=20, env=env or {}, cwd="/", check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.decode() if done.returncode == 0 else None
