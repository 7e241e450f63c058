"""Removing a tree the sandbox's code made: the one clean-up every path uses.

Code can make any tree its uid may make: thousands of levels deep (paths far longer than
PATH_MAX, which ``shutil.rmtree`` meets with a RecursionError), a hundred thousand
entries wide, directories without permissions (``chmod 000``), files without write
bits, sticky directories, fifos, sockets, and symbolic links that point anywhere. This
module removes such a tree without recursion and without ever building a long path:
every step is relative to the file descriptor of the directory it is in (``openat``,
``unlinkat``), one level at a time, with only one directory open at any moment; going
back up is ``openat(fd, "..")``, checked against the device and inode it came from.
It never follows a symbolic link (they are unlinked like files), never enters a mount
point inside the tree (another file system, or a bind mount of this one: the mount
points under the tree are read from ``/proc/self/mountinfo`` first), and gives
a directory its owner's permission bits back when it has to (a server that is not
root). Immutable and append-only attributes (``chattr +i/+a``) need
``CAP_LINUX_IMMUTABLE``, which no sandbox uid has; a tree that has them anyway (made
by someone else) has them cleared (``FS_IOC_SETFLAGS``) when an unlink meets EPERM.

It is only ever used once every process of the sandbox is dead (or, for the shared temp
dirs, of its uid), so nothing changes the tree while it is removed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = ["remove_entry", "remove_tree"]

log = logging.getLogger(__name__)

#: ioctl numbers (include/uapi/linux/fs.h; _IOR/_IOW('f', 1/2, long), 64-bit).
FS_IOC_GETFLAGS = 0x80086601
FS_IOC_SETFLAGS = 0x40086602
FS_IMMUTABLE_FL = 0x00000010
FS_APPEND_FL = 0x00000020
#: Times one directory is listed again when it is still not empty (should be once).
RESCANS = 3
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(slots=True)
class _Level:
    """One directory on the way down: its name in its parent, identity, and what is
    left of its subdirectories to enter."""

    name: str
    dev: int
    ino: int
    pending: list[str] | None = None
    scans: int = 0


class _Removal:
    """The state of one removal: whether everything went, and the first failures."""

    def __init__(self, top: str) -> None:
        self.top = top
        self.ok = True
        self.logged = 0
        #: (device, inode) of the roots of mounts under the tree: never entered.
        self.mounts = _mounts_under(top) if top.startswith("/") else set()

    def fail(self, what: str, exc: OSError | str) -> None:
        self.ok = False
        if self.logged < 5:  # a tree of a million stuck entries must not flood the log
            log.warning("coding sandbox: could not remove %s in %s: %s", what, self.top, exc)
        self.logged += 1


def remove_tree(path: str | Path) -> bool:
    """Remove ``path`` and, for a directory, everything under it; True when it is gone
    (also when it never existed). The last component is never followed; the parents
    are trusted (the server's temp dir, a shared temp dir)."""
    path = os.fspath(path)
    parent, name = os.path.split(path.rstrip("/") or "/")
    if not name or name in (".", ".."):
        raise ValueError(f"not a removable path: {path!r}")
    try:
        parent_fd = os.open(parent or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        return remove_entry(parent_fd, name, label=path)
    finally:
        os.close(parent_fd)


def remove_entry(dir_fd: int, name: str, *, label: str = "") -> bool:
    """Remove the entry ``name`` of the directory open as ``dir_fd`` (a directory with
    all it holds); True when it is gone. Never raises for what the tree holds."""
    job = _Removal(label or name)
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return True
    except OSError as exc:
        job.fail(name, exc)
        return False
    if not stat.S_ISDIR(info.st_mode):
        _unlink(job, dir_fd, name, directory=False)
        return job.ok
    if (info.st_dev, info.st_ino) in job.mounts:
        job.fail(name, "a mount point (not entered)")
        return False
    _remove_dir(job, dir_fd, name, info)
    return job.ok


def _remove_dir(job: _Removal, top_fd: int, name: str, info: os.stat_result) -> None:
    """Depth first with an explicit stack; only the current directory is open."""
    dev = info.st_dev
    try:
        cur, _ = _open_dir(top_fd, name)
    except OSError as exc:
        job.fail(name, exc)
        return
    levels = [_Level(name, dev, info.st_ino)]
    #: Directories found not empty after their pass (never, unless the tree changed),
    #: by inode -> passes so far; each gets at most RESCANS.
    passes: dict[int, int] = {}
    try:
        while levels:
            level = levels[-1]
            if level.pending is None:
                level.pending = _empty_files(job, cur)
                level.scans += 1
            if level.pending:
                child = level.pending.pop()
                try:
                    child_fd, child_info = _open_dir(cur, child)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    job.fail(child, exc)
                    continue
                if child_info.st_dev != dev or (child_info.st_dev, child_info.st_ino) in job.mounts:
                    os.close(child_fd)
                    job.fail(child, "a mount point inside the tree (not entered)")
                    continue
                os.close(cur)
                cur = child_fd
                scans = passes.pop(child_info.st_ino, 0)
                levels.append(_Level(child, dev, child_info.st_ino, scans=scans))
                continue
            levels.pop()
            if levels:
                up = os.open("..", _DIR_FLAGS & ~os.O_NOFOLLOW, dir_fd=cur)
                up_info = os.fstat(up)
                if (up_info.st_dev, up_info.st_ino) != (levels[-1].dev, levels[-1].ino):
                    os.close(up)
                    job.fail(level.name, "the tree moved while it was removed; stopped")
                    return
                os.close(cur)
                cur = up
                if not _rmdir_or_again(job, cur, level, levels[-1], passes):
                    continue
            else:
                os.close(cur)
                cur = -1
                _unlink(job, top_fd, level.name, directory=True)
    except OSError as exc:  # e.g. out of file descriptors: stop, report, leave the rest
        job.fail("the tree", exc)
    finally:
        if cur >= 0:
            os.close(cur)


def _rmdir_or_again(
    job: _Removal, parent_fd: int, level: _Level, parent: _Level, passes: dict[int, int]
) -> bool:
    """rmdir the emptied ``level``; if it is not empty after all (the listing missed
    something), queue it for another pass (up to RESCANS) and return False."""
    try:
        os.rmdir(level.name, dir_fd=parent_fd)
        return True
    except FileNotFoundError:
        return True
    except OSError as exc:
        if exc.errno == errno.ENOTEMPTY and level.scans < RESCANS and parent.pending is not None:
            passes[level.ino] = level.scans
            parent.pending.append(level.name)
            return False
    _unlink(job, parent_fd, level.name, directory=True)  # EPERM: flags; else it fails
    return True


def _mounts_under(top: str) -> set[tuple[int, int]]:
    """(device, inode) of every mount point at or below the path ``top``."""
    top = os.path.normpath(top)
    prefix = os.path.join(os.path.realpath(os.path.dirname(top)), os.path.basename(top))
    found: set[tuple[int, int]] = set()
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as info:
            points = [_unescape(line.split()[4]) for line in info if len(line.split()) > 4]
    except OSError:
        return found
    for point in points:
        if point == prefix or point.startswith(prefix.rstrip("/") + "/"):
            with contextlib.suppress(OSError):
                seen = os.stat(point, follow_symlinks=False)
                found.add((seen.st_dev, seen.st_ino))
    return found


def _unescape(field: str) -> str:
    """mountinfo's octal escapes (space, tab, newline, backslash)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _open_dir(dir_fd: int, name: str) -> tuple[int, os.stat_result]:
    """Open the subdirectory ``name`` (never through a link: O_NOFOLLOW and O_DIRECTORY),
    with the owner's rwx bits given back when it lacks them (only a server that is not
    root needs that); the fd and what fstat says of it."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        _chmod_entry(dir_fd, name)
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    info = os.fstat(fd)
    if info.st_mode & 0o700 != 0o700:
        with contextlib.suppress(OSError):  # not ours to change: root needs none of it
            os.fchmod(fd, stat.S_IMODE(info.st_mode) | 0o700)
    return fd, info


def _chmod_entry(dir_fd: int, name: str) -> None:
    """chmod u+rwx the directory ``name`` without following a link (an O_PATH handle:
    fchmodat cannot refuse links on Linux)."""
    handle = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.chmod(f"/proc/self/fd/{handle}", 0o700)
    finally:
        os.close(handle)


def _empty_files(job: _Removal, dir_fd: int) -> list[str]:
    """Unlink every entry of the directory that is not a directory; the names of its
    subdirectories. Names are read in full first (a listing is never modified while
    it is read)."""
    try:
        with os.scandir(dir_fd) as listing:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in listing]
    except OSError as exc:
        job.fail("a directory's listing", exc)
        return []
    subdirs = []
    for name, is_dir in entries:
        if is_dir:
            subdirs.append(name)
        else:
            _unlink(job, dir_fd, name, directory=False)
    return subdirs


def _unlink(job: _Removal, dir_fd: int, name: str, *, directory: bool) -> None:
    """unlinkat/rmdir ``name``; on EPERM/EACCES give the directory its write bit back
    and clear immutable/append-only flags on it and on the entry, then once more."""
    remove = os.rmdir if directory else os.unlink
    try:
        remove(name, dir_fd=dir_fd)
        return
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EACCES):
            job.fail(name, exc)
            return
    with contextlib.suppress(OSError):
        mode = os.fstat(dir_fd).st_mode
        if mode & 0o700 != 0o700:
            os.fchmod(dir_fd, stat.S_IMODE(mode) | 0o700)
    _clear_flags(dir_fd)
    _clear_entry_flags(dir_fd, name)
    try:
        remove(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    except OSError as exc:
        job.fail(name, exc)


def _clear_flags(fd: int) -> None:
    """Drop FS_IMMUTABLE_FL and FS_APPEND_FL of the open file ``fd``, if it has any."""
    buf = bytearray(8)
    try:
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, buf)
    except OSError:
        return  # the file system has no such flags
    (flags,) = struct.unpack_from("=i", buf)
    if flags & (FS_IMMUTABLE_FL | FS_APPEND_FL):
        struct.pack_into("=i", buf, 0, flags & ~(FS_IMMUTABLE_FL | FS_APPEND_FL))
        with contextlib.suppress(OSError):
            fcntl.ioctl(fd, FS_IOC_SETFLAGS, buf)


def _clear_entry_flags(dir_fd: int, name: str) -> None:
    """The same for the entry ``name``: regular files, directories and fifos only (a
    device is never opened; links and sockets cannot be)."""
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return
    if not (
        stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode) or stat.S_ISFIFO(info.st_mode)
    ):
        return
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError:
        return
    try:
        _clear_flags(fd)
    finally:
        os.close(fd)
