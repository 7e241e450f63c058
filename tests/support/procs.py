"""Whether a process still runs, as the tests mean it.

A process that exited but whose parent has not reaped it is a zombie: ``/proc/<pid>``
and ``kill(pid, 0)`` still find it. Orphans go to the nearest subreaper, and a pytest
worker becomes one once a coding env probed the host in it (the coding server reaps its
sandbox's orphans that way); it never reaps what other tests leave it. So "gone" is "no
such process, or a zombie".
"""

from __future__ import annotations

from pathlib import Path


def running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(b")", 1)[1].split()[0]  # the name in parentheses may hold spaces
    return state not in (b"Z", b"X")


def env_processes(server_pid: int) -> list[int]:
    """A serve process's env processes (``--isolated``): its multiprocessing children,
    not the resource tracker."""
    children: list[str] = []
    for path in Path(f"/proc/{server_pid}/task").glob("*/children"):
        children += path.read_text().split()
    found = []
    for pid in children:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:  # gone meanwhile
            continue
        if b"spawn_main" in command:
            found.append(int(pid))
    return found
