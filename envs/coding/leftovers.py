"""What a sandbox uid can leave outside its own directory, and removing it.

Two kinds of thing outlive the processes that made them: System V IPC objects (shared
memory segments, message queues, semaphore sets) in an IPC namespace the sandbox shares,
and files in the world-writable directories. Where the sandbox gets namespaces of its
own (see ``harness.py``), the IPC objects and ``/dev/shm`` / ``/run/lock`` die with the
run; these sweeps are for the rest (``/tmp``, ``/var/tmp``) and for hosts without them.
Both only ever touch what the uid owns, so they are safe beside live sandboxes of other
uids.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import stat
from pathlib import Path

from openenv_grpc_envs.coding.removal import remove_entry

__all__ = ["SHARED_DIRS", "ipc_objects", "remove_ipc", "sweep_files"]

log = logging.getLogger(__name__)

#: World-writable directories where code may leave files; swept by uid.
SHARED_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
#: How deep the sweep follows world-writable subdirectories made by others (e.g. a 1777
#: ``/tmp/.X11-unix``): the uid can create files in those too.
SWEEP_DEPTH = 3
#: /proc/sysvipc table -> the column holding the id, and how to remove one.
IPC_TABLES = {"shm": "shmid", "msg": "msqid", "sem": "semid"}
IPC_RMID = 0


def ipc_objects(uid: int) -> list[tuple[str, int]]:
    """(kind, id) of every SysV IPC object that ``uid`` owns or created, in this process's
    IPC namespace. Matching the creator too: the owner can hand an object to another uid."""
    found = []
    for kind, id_column in IPC_TABLES.items():
        try:
            lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()
        except OSError:
            continue
        if not lines:
            continue
        header = lines[0].split()
        try:
            at_id, at_uid, at_cuid = (header.index(c) for c in (id_column, "uid", "cuid"))
        except ValueError:
            log.warning("coding sandbox: unexpected /proc/sysvipc/%s header %r", kind, lines[0])
            continue
        for line in lines[1:]:
            cols = line.split()
            try:
                if uid in (int(cols[at_uid]), int(cols[at_cuid])):
                    found.append((kind, int(cols[at_id])))
            except (IndexError, ValueError):
                continue
    return found


def remove_ipc(uid: int) -> int:
    """Remove every SysV IPC object of ``uid`` (see :func:`ipc_objects`); how many.

    A removed shared memory segment is freed once its last process detaches, which the
    sandbox's processes, killed before this, no longer are.
    """
    objects = ipc_objects(uid)
    if not objects:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    removers = {
        "shm": lambda i: libc.shmctl(i, IPC_RMID, None),
        "msg": lambda i: libc.msgctl(i, IPC_RMID, None),
        "sem": lambda i: libc.semctl(i, 0, IPC_RMID),
    }
    removed = 0
    for kind, ident in objects:
        if removers[kind](ident) == 0:
            removed += 1
        elif ctypes.get_errno() not in (errno.EINVAL, errno.EIDRM):  # gone meanwhile
            log.warning(
                "coding sandbox: could not remove SysV %s %d of uid %d: %s",
                kind, ident, uid, os.strerror(ctypes.get_errno()),
            )  # fmt: skip
    return removed


def sweep_files(uid: int, folders: tuple[str, ...] = SHARED_DIRS) -> bool:
    """Remove what ``uid`` owns in the world-writable ``folders``; True when all of it went.

    Entries the uid owns go with everything under them (:func:`.removal.remove_entry`:
    any depth or width, never through a link); world-writable subdirectories of others
    are searched too, down to :data:`SWEEP_DEPTH`, each opened relative to its parent
    without following links.
    """
    clean = True
    for folder in folders:
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue  # no such shared dir on this host
        try:
            clean = _sweep(fd, folder, uid, SWEEP_DEPTH) and clean
        finally:
            os.close(fd)
    return clean


def _sweep(fd: int, folder: str, uid: int, depth: int) -> bool:
    try:
        with os.scandir(fd) as listing:
            names = [entry.name for entry in listing]
    except OSError:
        return True
    clean = True
    for name in names:
        try:
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            continue  # gone meanwhile
        if info.st_uid == uid:
            clean = remove_entry(fd, name, label=f"{folder}/{name}") and clean
        elif depth > 1 and stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_IWOTH:
            try:
                sub = os.open(
                    name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                )
            except OSError:
                continue
            try:
                clean = _sweep(sub, f"{folder}/{name}", uid, depth - 1) and clean
            finally:
                os.close(sub)
    return clean
