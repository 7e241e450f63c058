"""Sandbox user ids: leasing one host-wide, and ending every process that runs under it.

Why a private uid: RLIMIT_NPROC is not enforced for root, and code running as root could
signal the server or read its files. Under its own uid the kernel caps the sandbox's
tasks, the code cannot touch the server or other sandboxes, and "every process of the
sandbox" is "every process of that uid", which one kill(-1) issued under that uid ends
atomically (a /proc scan alone can be outrun by code that forks and exits in a loop).
"""

from __future__ import annotations

import random
import shutil
import socket
import time
from dataclasses import dataclass

from openenv_grpc_envs.coding import keys, leftovers
from openenv_grpc_envs.coding.processes import ProcFields, kill_matching, processes, quiet

__all__ = ["UID_BASE", "Killer", "UidBusy", "UidLease", "as_uid", "default_killer"]

#: Where setpriv and kill(1) are looked for.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Sandbox uids (and gids) are drawn from here; far above any real account.
UID_BASE = 1_600_000_000
UID_SPAN = 100_000_000

#: Python that drops from root to the uid in ``sys.argv[1]`` (used when setpriv is
#: missing; raises before anything else runs if the kernel did not comply).
DROP = """\
import os, sys
_u = int(sys.argv.pop(1))
os.setgroups([])
os.setresgid(_u, _u, _u)
os.setresuid(_u, _u, _u)
if _u <= 0 or os.getresuid() != (_u, _u, _u) or os.getresgid() != (_u, _u, _u):
    raise SystemExit(125)
"""


def setpriv_drop(setpriv: str, uid: int) -> list[str]:
    """setpriv arguments that run the rest of the command as ``uid`` with nothing else."""
    return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--nnp",
            "--pdeathsig", "KILL", "--"]  # fmt: skip


def as_uid(setpriv: str | None, uid: int, python: str, source: str, *args: str) -> list[str]:
    """argv that runs python ``source`` under ``uid`` (and nothing else: no groups).

    Never ``Popen(user=...)``: that forbids vfork, and a plain fork of a gRPC server runs
    its at-fork handlers, which were seen to crash the child (SIGSEGV) now and then.
    """
    if setpriv is not None:
        return [*setpriv_drop(setpriv, uid), python, "-I", "-S", "-c", source, *args]
    return [python, "-I", "-S", "-c", DROP + source, str(uid), *args]


@dataclass(frozen=True, slots=True)
class Killer:
    """How to SIGKILL every process of a uid at once: kill(-1) from a process of that uid.

    With setpriv and kill(1), two small execs; else a python one-liner (a few ms slower).
    """

    setpriv: str | None
    kill: str | None
    python: str

    def argv(self, uid: int) -> list[str]:
        """The command (never for a uid below :data:`UID_BASE`: that could be root's)."""
        if uid < UID_BASE:
            raise ValueError(f"refusing to kill every process of uid {uid}")
        if self.kill is not None and self.setpriv is not None:
            return [*setpriv_drop(self.setpriv, uid), self.kill, "-KILL", "-1"]
        return as_uid(self.setpriv, uid, self.python, "import os\nos.kill(-1, 9)\n")


def default_killer() -> Killer | None:
    """A :class:`Killer` from setpriv and kill(1) on the system path (None without them),
    for processes that have not probed the host; its python (for the key remover) is
    the system's python3."""
    found = [shutil.which(n, path=SYSTEM_PATH) for n in ("setpriv", "kill", "python3")]
    return Killer(found[0], found[1], found[2] or "") if found[0] and found[1] else None


class UidBusy(Exception):
    """The uid asked for is leased by a live process."""


class UidLease:
    """A sandbox uid no other sandbox on this host holds, until :meth:`release`.

    The lease is an abstract unix socket named after the uid: binding it is atomic and
    exclusive host-wide (per network namespace), and the kernel drops it when the socket
    closes or the server dies, so no lock file can go stale. A fresh lease starts clean:
    processes and SysV IPC objects a dead sandbox left under the uid are removed first.

    Args:
        killer: How to end the uid's processes at once (None: /proc scans).
        uid: Lease exactly this uid (reclaiming a dead sandbox's); raises :class:`UidBusy`
            when a live process holds it. None: a random free one.
    """

    def __init__(self, killer: Killer | None, uid: int | None = None) -> None:
        self._killer = killer
        self._sock: socket.socket | None = None
        rng = random.SystemRandom()
        for _ in range(1 if uid is not None else 1000):
            candidate = uid if uid is not None else UID_BASE + rng.randrange(UID_SPAN)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(f"\0openenv-coding-uid-{candidate}".encode())
            except OSError:
                sock.close()
                continue
            self.uid = candidate
            self._sock = sock
            break
        else:
            if uid is not None:
                raise UidBusy(f"uid {uid} is leased by a live sandbox")
            raise RuntimeError("no free sandbox uid")
        self.clear(files=False)

    def owns(self, fields: ProcFields) -> bool:
        """Whether a process runs under the leased uid."""
        return fields.uid == self.uid

    def kill_all(self) -> bool:
        """SIGKILL every process of the uid; True when none is left.

        kill(-1) from a process of the uid signals all of them in one pass under the
        kernel's task-list lock, and a process with SIGKILL pending cannot fork: nothing
        escapes, not even code that forks and exits in a loop to stay ahead of a /proc
        scan (which is what a scan alone would miss).
        """
        if self._killer is not None:
            quiet(self._killer.argv(self.uid))  # kill(1) exits 1 when a pid vanished
            deadline = time.monotonic() + 2
            while processes(self.owns):  # the killed ones are still on their way out
                if time.monotonic() > deadline:
                    break
                time.sleep(0.002)
            else:
                return True
        return kill_matching(self.owns)

    def clear(self, *, files: bool = True) -> bool:
        """End the uid's processes, then remove its SysV IPC objects (in this server's IPC
        namespace), its kernel keys and, with ``files``, what it left in the shared temp
        dirs.

        Returns:
            True when nothing of the uid is left (no process, no key, every file it
            left in the shared dirs removed).
        """
        gone = self.kill_all() if processes(self.owns) else True
        leftovers.remove_ipc(self.uid)
        gone = keys.remove_keys(self.uid, self._key_remover()) and gone
        if files:
            gone = leftovers.sweep_files(self.uid) and gone
        return gone

    def _key_remover(self) -> list[str] | None:
        """The argv that removes the uid's kernel keys (see ``keys.py``), if a python
        that runs under it is known."""
        killer = self._killer
        python = killer.python if killer is not None else ""
        python = python or shutil.which("python3", path=SYSTEM_PATH) or ""
        if not python:
            return None
        setpriv = (
            killer.setpriv if killer is not None else shutil.which("setpriv", path=SYSTEM_PATH)
        )
        return as_uid(setpriv, self.uid, python, keys.CLEAR_KEYS)

    def release(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> UidLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
