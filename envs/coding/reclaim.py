"""Cleaning up after sandboxes whose owner process died without closing them.

A server SIGKILLed at the end of an overrun drain, or an isolated worker that crashed,
never ran its sandboxes' ``close``: the code's background processes live on, and so do
the working directory, the cgroup, and what the uid left in the shared temp dirs and in
SysV IPC. Every sandbox is in the registry (see ``registry.py``) until it closes, so
this finds them all; the registry's locks make sure no live sandbox is touched.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from openenv_grpc_envs.coding import cgroups
from openenv_grpc_envs.coding.keys import key_uids, keyctl_allowed
from openenv_grpc_envs.coding.processes import (
    ProcFields,
    kill_matching,
    read_proc,
    reap_orphans,
)
from openenv_grpc_envs.coding.registry import orphans, registry_dir
from openenv_grpc_envs.coding.removal import remove_tree
from openenv_grpc_envs.coding.uids import UID_BASE, UID_SPAN, Killer, UidBusy, UidLease

__all__ = ["BASE_PREFIX", "reclaim_orphans"]

log = logging.getLogger(__name__)

#: Every sandbox's directory tree is named so; reclaim removes nothing else.
BASE_PREFIX = "openenv-coding-"


def reclaim_orphans(killer: Killer | None) -> int:
    """Release what every sandbox of a dead owner left behind; how many were reclaimed.

    Safe at any time and from any process of the same uid (and, for a root server, the
    same host): live sandboxes hold their registry lock and are skipped. A root server
    also removes the kernel keys of sandbox uids that no live sandbox leases (left by
    sandboxes closed before the seccomp filter refused keys, which left no record).
    """
    try:
        directory = registry_dir()
    except OSError as exc:
        log.warning("coding sandbox: no registry, nothing reclaimed: %s", exc)
        return 0
    count = 0
    for orphan in orphans(directory):
        count += 1
        try:
            if _reclaim(orphan.record, killer):
                orphan.forget()
        except Exception:  # one bad record must not stop the others
            log.exception("coding sandbox: reclaiming %s failed", orphan.path)
    _stray_keys(killer)
    return count


def _stray_keys(killer: Killer | None) -> None:
    """Remove the kernel keys of sandbox uids no live sandbox holds: sandboxes closed
    before the filter refused keys (their records are gone, their keys are not). The
    lease proves no sandbox uses the uid, and a fresh lease starts clean."""
    if os.geteuid() != 0 or not keyctl_allowed():
        return  # shared uid: nothing tells their keys apart; no keyctl: no keys of ours
    stray = [u for u in key_uids() if UID_BASE <= u < UID_BASE + UID_SPAN]
    cleared = 0
    for uid in stray:
        try:
            with UidLease(killer, uid=uid):
                cleared += 1
        except UidBusy:
            continue  # a live sandbox's: its own close removes them
        except Exception:
            log.exception("coding sandbox: removing the kernel keys of uid %d failed", uid)
    if cleared:
        log.warning("coding sandbox: removed the kernel keys of %d old sandbox uids", cleared)


def _reclaim(record: dict[str, Any], killer: Killer | None) -> bool:
    """Undo one dead sandbox; True when nothing of it is left."""
    uid = int(record["uid"])
    log.warning(
        "coding sandbox: reclaiming %s (uid %d) of dead process %s",
        record.get("base"), uid, record.get("owner"),
    )  # fmt: skip
    clean = True
    if record.get("own_uid"):
        try:
            # Leasing the uid proves no live sandbox uses it; the lease kills the rest.
            with UidLease(killer, uid=uid) as lease:
                clean = lease.clear()
                reap_orphans(lease.owns)  # killed orphans may have been left to this process
        except UidBusy:
            # A live sandbox drew the same uid since: its processes are not ours to end.
            log.warning("coding sandbox: uid %d is in use again; its processes stay", uid)
    else:
        match = _session_of(record)
        clean = kill_matching(match)
        reap_orphans(match)
    clean = cgroups.destroy(record.get("cgroups", [])) and clean
    base = Path(str(record.get("base", "")))
    if base.name.startswith(BASE_PREFIX) and base.is_dir() and not base.is_symlink():
        clean = remove_tree(base) and clean  # the same removal as a live close's
    return clean


def _session_of(record: dict[str, Any]) -> Callable[[ProcFields], bool]:
    """Selects the processes of the last run of a sandbox that shared the server's uid:
    its session (the run's leader pid), unless that pid now names another process."""
    uid = int(record["uid"])
    leader = int(record.get("leader", 0))
    leader_start = int(record.get("leader_start", 0))
    current = read_proc(leader) if leader else None
    if not leader or (current is not None and current.start != leader_start):
        return lambda fields: False  # no run, or the pid was reused: a new session

    def match(fields: ProcFields) -> bool:
        return fields.session == leader and fields.uid == uid

    return match
