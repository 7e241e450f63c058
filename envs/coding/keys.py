"""Kernel keys a sandbox uid holds, and removing them.

``add_key`` into the user keyring (``@u``) makes keys that belong to the uid, not to any
process: they outlive the sandbox and the server, up to the uid's quota (200 keys,
20,000 bytes by default), and every episode's fresh uid would add its own. The seccomp
filter refuses ``add_key``, ``keyctl`` and ``request_key`` (as Docker's default profile
does; see ``harness.py``), so a sandbox under it makes none. This removes what a uid
holds anyway (a sandbox made before that rule, or a host without seccomp): from a
process of that uid, since key permissions do not yield to root, it clears and
invalidates every keyring the uid owns (its user and user-session keyrings included)
and every other key of the uid it can, after which the kernel collects the keys.
``/proc/key-users`` says whether the uid has any key at all, so the common case costs
one read of it and no process. (Each run also gets a session keyring of its own, never
the server's, which dies with the run: see ``harness.py``.)
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import time

from openenv_grpc_envs.coding.processes import quiet

__all__ = ["CLEAR_KEYS", "key_count", "key_uids", "keyctl_allowed", "remove_keys"]

log = logging.getLogger(__name__)

#: How long to wait for the kernel's key collector after the keyrings are cleared.
COLLECT_SECONDS = 3.0

#: Run under the uid: clears, then invalidates, each key the uid can see that it owns.
#: Serials from /proc/keys, never the @u/@us specials: looking those up would make the
#: keyrings that are missing. Exit 0 when every call worked.
CLEAR_KEYS = """\
import ctypes, os
nr = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)  # keyctl(2)
if nr is None:
    raise SystemExit(2)
libc = ctypes.CDLL(None, use_errno=True)
uid = os.getuid()
mine = []
with open("/proc/keys") as keys:
    for line in keys:
        cols = line.split()
        if len(cols) > 7 and cols[5] == str(uid):
            mine.append((int(cols[0], 16), cols[7] == "keyring"))
failed = 0
for serial, keyring in mine:  # unlinks every key in them (even ones with no permissions)
    if keyring and libc.syscall(nr, 7, ctypes.c_long(serial)) != 0:  # KEYCTL_CLEAR
        failed += ctypes.get_errno() != 126  # ENOKEY: collected meanwhile
for serial, keyring in mine:  # keys linked from keyrings of others too, where possessed
    if libc.syscall(nr, 21, ctypes.c_long(serial)) != 0 and keyring:  # KEYCTL_INVALIDATE
        failed += ctypes.get_errno() != 126
raise SystemExit(1 if failed else 0)
"""


def key_count(uid: int) -> int:
    """Keys the kernel counts for ``uid`` (``/proc/key-users``); 0 when it lists none."""
    try:
        with open("/proc/key-users") as table:
            for line in table:
                head, _, rest = line.partition(":")
                if head.strip() == str(uid):
                    return int(rest.split()[1].split("/")[0])
    except (OSError, IndexError, ValueError):
        return 0
    return 0


#: keyctl(2) per architecture.
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}


@functools.cache
def keyctl_allowed() -> bool:
    """Whether this process may call keyctl at all (a seccomp profile above the server,
    e.g. Docker's default, refuses it: then neither can the sandboxes it starts)."""
    number = SYS_KEYCTL.get(os.uname().machine)
    if number is None:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    # KEYCTL_GET_KEYRING_ID of the thread keyring, never created: ENOKEY when allowed.
    if libc.syscall(number, 0, ctypes.c_long(-1), 0) >= 0:
        return True
    return ctypes.get_errno() not in (errno.EPERM, errno.ENOSYS)


def key_uids() -> list[int]:
    """Every uid the kernel counts keys for (``/proc/key-users``)."""
    found = []
    try:
        with open("/proc/key-users") as table:
            for line in table:
                head, _, _ = line.partition(":")
                if head.strip().isdigit():
                    found.append(int(head))
    except OSError:
        return []
    return found


def remove_keys(uid: int, remover: list[str] | None) -> bool:
    """Remove every kernel key of ``uid`` (whose processes are all dead) with
    ``remover``, the argv that runs :data:`CLEAR_KEYS` as python under that uid; True
    when the kernel counts none for it afterwards."""
    if key_count(uid) == 0:
        return True
    if remover is None:
        log.error("coding sandbox: no python to remove the kernel keys of uid %d", uid)
        return False
    done = quiet(remover)
    deadline = time.monotonic() + COLLECT_SECONDS
    while key_count(uid) and time.monotonic() < deadline:
        time.sleep(0.01)  # the collector runs in a kernel work queue
    left = key_count(uid)
    if left:
        log.error(
            "coding sandbox: %d kernel keys of uid %d could not be removed%s",
            left, uid, "" if done is not None else " (the remover failed)",
        )  # fmt: skip
    return left == 0
