"""A host-wide record of live sandboxes, so that a dead server's leftovers can be found.

Each sandbox writes one JSON file into the registry directory before it makes anything
(its uid, directory tree, cgroups, owner) and holds an exclusive ``flock`` on that file
for as long as it lives; closing the sandbox deletes the file. The kernel drops the lock
when the owning process dies, however it dies (SIGKILL included), so "the lock can be
taken" means "the owner is gone": no pid to check, nothing to confuse with a reused pid.
The owner's pid and start time are recorded too, for the logs.

The directory is ``/run/openenv-coding`` for a root server (a tmpfs: emptied at boot,
when every sandbox is gone anyway), else a private directory under the temp dir.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["Orphan", "Registration", "orphans", "registry_dir"]

log = logging.getLogger(__name__)

#: Where a root server keeps the registry.
ROOT_REGISTRY = Path("/run/openenv-coding")
SUFFIX = ".json"
#: Age after which a record still under its staging name is taken for a dead one.
STAGING_SECONDS = 60


def registry_dir() -> Path:
    """The registry directory of this uid, made (mode 0700) if missing.

    Raises:
        OSError: it cannot be made, or exists with another owner or as a symlink.
    """
    candidates = [ROOT_REGISTRY] if os.geteuid() == 0 else []
    candidates.append(Path(tempfile.gettempdir()) / f"openenv-coding-registry-{os.geteuid()}")
    error: OSError | None = None
    for directory in candidates:
        try:
            with contextlib.suppress(FileExistsError):
                directory.mkdir(mode=0o700, parents=False)
            info = directory.lstat()
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
                raise PermissionError(f"{directory} is not a directory owned by this uid")
            if info.st_mode & 0o077:
                os.chmod(directory, 0o700)
            return directory
        except OSError as exc:
            error = exc
    assert error is not None
    raise error


class Registration:
    """This process's record of one live sandbox; the lock on it says "alive".

    Args:
        directory: The registry directory.
        name: The sandbox's name (unique on the host).
        record: What to record (JSON-able); see :meth:`update`.
    """

    def __init__(self, directory: Path, name: str, record: dict[str, Any]) -> None:
        self.path = directory / (name + SUFFIX)
        self._record = dict(record)
        # Written and locked under a name reclaim ignores, then renamed into place (the
        # lock stays with the file): a reclaimer never sees an unlocked, unwritten record.
        fd, staging = tempfile.mkstemp(prefix=f".{name}.", dir=directory)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._fd = fd
            self._write()
            os.rename(staging, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(staging)
            raise

    def update(self, **fields: Any) -> None:
        """Change recorded fields, in place (the file keeps its lock)."""
        self._record.update(fields)
        self._write()

    def _write(self) -> None:
        data = json.dumps(self._record, sort_keys=True).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def abandon(self) -> None:
        """Unlock the record but keep it: the next reclaim retries what it names."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        """Delete the record (the sandbox is gone). Idempotent."""
        if self._fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = -1


class Orphan:
    """A dead owner's record, locked by this process until :meth:`release`."""

    def __init__(self, path: Path, fd: int, record: dict[str, Any]) -> None:
        self.path = path
        self.record = record
        self._fd = fd

    def forget(self) -> None:
        """Delete the record: everything it named is gone."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def release(self) -> None:
        """Unlock it (a record not forgotten is retried by the next reclaim)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def orphans(directory: Path) -> Iterator[Orphan]:
    """Records whose owner died, each locked until the caller moves on to the next.

    A record another process is reclaiming at the same time is skipped, and so is any
    whose owner is alive. Records left half-written by an owner that died while making
    one are deleted once they are a minute old.
    """
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return
    for name in names:
        path = directory / name
        staging = name.startswith(".")
        if not staging and not name.endswith(SUFFIX):
            continue
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # closed meanwhile
        orphan = Orphan(path, fd, {})
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # alive (or being reclaimed by someone else)
            info = os.fstat(fd)
            if info.st_nlink == 0:
                continue  # deleted between listing and locking: done by someone else
            if staging:
                if time.time() - info.st_mtime > STAGING_SECONDS:
                    orphan.forget()
                continue
            try:
                record = json.loads(os.pread(fd, 1 << 20, 0) or b"{}")
            except ValueError:
                record = None
            if not isinstance(record, dict) or not record:
                log.warning("coding sandbox: unreadable registry record %s dropped", path)
                orphan.forget()
                continue
            orphan.record = record
            yield orphan
        finally:
            orphan.release()
