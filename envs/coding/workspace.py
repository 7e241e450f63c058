"""A sandbox's working directory as plain data, and back: what a coding snapshot holds.

:func:`capture` lists the tree under a working directory: directories, regular files
(their bytes) and symbolic links (their target text), each with its permission bits.
It never follows a link, so code that linked ``/etc/shadow`` into its directory gets the
link back, never the file (the server reads as root). Other kinds (fifos, sockets,
devices) are left out. Between steps no process of the sandbox is alive (each run ends
with all of them killed), so the tree cannot change while it is read.

:func:`rebuild` checks a whole listing before it creates anything, then makes the tree in
a fresh, empty directory without following links (every parent is a directory it made
itself) and hands every entry to the sandbox's uid.
"""

from __future__ import annotations

import itertools
import os
import posixpath
import stat
from pathlib import Path
from typing import Any

from openenv_grpc import InvalidAction
from openenv_grpc_envs.snapshot_body import Body, b64

__all__ = ["MAX_ENTRIES", "MAX_FILE_BYTES", "Listing", "capture", "check", "plain_path", "rebuild"]

#: Bytes of file contents a snapshot holds at most (base64 makes 5.3 MiB of them, under
#: the server's default 8 MiB snapshot limit).
MAX_FILE_BYTES = 4 * 1024 * 1024
#: Entries (directories, files, links) a snapshot holds at most.
MAX_ENTRIES = 1000
#: Permission bits kept: setuid, setgid and sticky bits are dropped.
_MODE_BITS = 0o777
_KINDS = ("dir", "file", "link")

#: A checked listing: (relative path, kind, permission bits, file bytes or link target).
Listing = list[tuple[str, str, int, bytes | str]]


def plain_path(path: str) -> bool:
    """Whether ``path`` is a plain relative path that stays inside its directory: no
    leading ``/``, no ``..``, ``.`` or empty parts, no NUL, each part at most 255 bytes."""
    return not (
        not path
        or path.startswith("/")
        or "\0" in path
        or posixpath.normpath(path) != path
        or any(part in ("", ".", "..") or len(part.encode()) > 255 for part in path.split("/"))
    )


def _too_large(what: str) -> InvalidAction:
    return InvalidAction(
        f"the working directory is too large to snapshot: {what} (delete files, or "
        "snapshot before they are written)"
    )


def capture(root: Path) -> list[dict[str, Any]]:
    """The tree under ``root``, parents before children, as JSON data.

    Raises:
        InvalidAction: more than :data:`MAX_ENTRIES` entries or :data:`MAX_FILE_BYTES`
            bytes of files.
    """
    entries: list[dict[str, Any]] = []
    budget = MAX_FILE_BYTES
    pending = [""]
    while pending:
        folder = pending.pop()
        with os.scandir(root / folder if folder else root) as listing:
            # Read no more names than the cap allows: a folder of a million files is
            # refused after MAX_ENTRIES of them, not after listing them all.
            children = list(itertools.islice(listing, MAX_ENTRIES + 1 - len(entries)))
        if len(entries) + len(children) > MAX_ENTRIES:
            raise _too_large(f"more than {MAX_ENTRIES} entries")
        children.sort(key=lambda e: e.name)
        for child in children:
            relative = posixpath.join(folder, child.name) if folder else child.name
            info = child.stat(follow_symlinks=False)
            mode = stat.S_IMODE(info.st_mode) & _MODE_BITS
            if stat.S_ISDIR(info.st_mode):
                entries.append({"path": relative, "kind": "dir", "mode": mode})
                pending.append(relative)
            elif stat.S_ISREG(info.st_mode):
                data = _read(root / relative, budget)
                budget -= len(data)
                entries.append({"path": relative, "kind": "file", "mode": mode, "data": b64(data)})
            elif stat.S_ISLNK(info.st_mode):
                target = os.readlink(root / relative)
                entries.append({"path": relative, "kind": "link", "mode": 0, "target": target})
            # else a fifo, socket or device: left out (it counts against the cap, though)
    entries.sort(key=lambda e: e["path"].split("/"))
    return entries


def _read(path: Path, budget: int) -> bytes:
    """A regular file's bytes, opened without following a link swapped in meanwhile."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        chunks = []
        left = budget + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > budget:
        raise _too_large(f"more than {MAX_FILE_BYTES} bytes of files")
    return data


def check(entries: list[Body]) -> Listing:
    """The listing :func:`rebuild` takes: (path, kind, mode, data or link target) per
    entry, all checked before anything is made.

    Raises:
        InvalidAction: a malformed entry, a path that leaves the directory or whose
            parent is not a directory listed before it, a repeated path, or over a cap.
    """
    if len(entries) > MAX_ENTRIES:
        raise _too_large(f"{len(entries)} entries; the limit is {MAX_ENTRIES}")
    folders = {""}
    seen: set[str] = set()
    total = 0
    checked: Listing = []
    for entry in entries:
        path = entry.string("path", max_chars=4096)
        if not plain_path(path):
            raise entry.invalid("path", f"{path!r} is not a plain relative path")
        if path in seen:
            raise entry.invalid("path", f"{path!r} is listed twice")
        if posixpath.dirname(path) not in folders:
            raise entry.invalid("path", f"{path!r} is not inside a directory listed before it")
        seen.add(path)
        kind = entry.string("kind")
        mode = entry.integer("mode", low=0, high=_MODE_BITS)
        payload: bytes | str
        if kind == "dir":
            folders.add(path)
            payload = b""
        elif kind == "file":
            payload = entry.blob("data")
            total += len(payload)
            if total > MAX_FILE_BYTES:
                raise _too_large(f"more than {MAX_FILE_BYTES} bytes of files")
        elif kind == "link":
            payload = entry.string("target", max_chars=4096)
            if "\0" in payload or not payload:
                raise entry.invalid("target", f"{payload!r} is not a link target")
        else:
            raise entry.invalid("kind", f"is {kind!r}, not one of {', '.join(_KINDS)}")
        checked.append((path, kind, mode, payload))
    return checked


def rebuild(root: Path, listing: Listing, uid: int | None) -> None:
    """Make ``listing`` (from :func:`check`) under the empty directory ``root``; every
    entry is owned by ``uid`` when given.

    Raises:
        OSError: the tree cannot be written (e.g. the disk is full).
    """
    folders: list[tuple[Path, int]] = []
    for relative, kind, mode, payload in listing:
        path = root / relative
        if kind == "dir":
            os.mkdir(path, 0o700)
            folders.append((path, mode))
        elif kind == "file":
            assert isinstance(payload, bytes)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(path, flags, 0o600)
            try:
                view = memoryview(payload)
                while view:
                    view = view[os.write(fd, view) :]
                os.fchmod(fd, mode)
                if uid is not None:
                    os.fchown(fd, uid, uid)
            finally:
                os.close(fd)
        else:
            assert isinstance(payload, str)
            os.symlink(payload, path)
            if uid is not None:
                os.lchown(path, uid, uid)
    # Directory modes last, deepest first: a read-only directory must be filled first.
    for path, mode in reversed(folders):
        if uid is not None:
            os.chown(path, uid, uid, follow_symlinks=False)
        os.chmod(path, mode)
