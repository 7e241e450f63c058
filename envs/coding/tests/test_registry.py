"""The registry of live sandboxes and reclaim's edge cases, in this process (as root).

A record's lock says its owner lives; reclaim must skip live records, drop unreadable
ones, and never kill the processes of a uid that a live sandbox holds again.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from openenv_grpc_envs.coding.cgroups import CgroupParents
from openenv_grpc_envs.coding.host import HostSupport
from openenv_grpc_envs.coding.limits import DEFAULTS
from openenv_grpc_envs.coding.reclaim import reclaim_orphans
from openenv_grpc_envs.coding.registry import STAGING_SECONDS, Registration, orphans, registry_dir
from openenv_grpc_envs.coding.sandbox import Sandbox
from openenv_grpc_envs.coding.uids import UidLease, as_uid, default_killer


def test_live_records_are_skipped_and_dead_ones_found(tmp_path: Path) -> None:
    live = Registration(tmp_path, "live", {"uid": 1})
    dead = Registration(tmp_path, "dead", {"uid": 2})
    dead.abandon()  # the owner died: its lock went with it
    found = []
    for orphan in orphans(tmp_path):
        found.append(orphan.record)
        orphan.forget()  # cleaned up after it
    assert found == [{"uid": 2}]
    assert [p.name for p in tmp_path.iterdir()] == ["live.json"]
    live.close()
    assert list(tmp_path.iterdir()) == []


def test_a_record_not_forgotten_is_kept_for_the_next_reclaim(tmp_path: Path) -> None:
    Registration(tmp_path, "dead", {"uid": 2}).abandon()
    for orphan in orphans(tmp_path):
        orphan.release()  # the caller could not clean everything up
    assert [p.name for p in tmp_path.iterdir()] == ["dead.json"]


def test_unreadable_and_stale_half_written_records_are_dropped(tmp_path: Path) -> None:
    (tmp_path / "garbage.json").write_text("{not json")
    stale = tmp_path / ".half.abc"
    stale.write_text("")
    old = time.time() - STAGING_SECONDS - 5
    os.utime(stale, (old, old))
    fresh = tmp_path / ".fresh.abc"  # a record being written right now
    fresh.write_text("")
    assert list(orphans(tmp_path)) == []
    assert [p.name for p in tmp_path.iterdir()] == [".fresh.abc"]


def test_a_failed_sandbox_leaves_no_record_and_no_directory() -> None:
    support = HostSupport(
        own_uid=True,
        python="/usr/bin/python3",
        python_version="",
        killer=default_killer(),
        cgroup=CgroupParents(1, Path("/nonexistent/cgroup"), None),
    )
    before = set(os.listdir(registry_dir()))
    with pytest.raises(FileNotFoundError):
        Sandbox(DEFAULTS, allow_network=False, support=support)
    assert set(os.listdir(registry_dir())) == before
    assert not [p for p in Path("/tmp").glob(f"openenv-coding-{os.getpid()}-*")]


def test_reclaim_never_kills_a_uid_that_a_live_sandbox_holds_again() -> None:
    killer = default_killer()
    with UidLease(killer) as lease:
        # A live sandbox's process under the uid...
        sleeper = subprocess.Popen(
            as_uid(killer.setpriv if killer else None, lease.uid, "/usr/bin/python3",
                   "import time\ntime.sleep(60)\n"),
        )  # fmt: skip
        try:
            # ... and a dead sandbox's record that drew the same uid earlier.
            base = Path("/tmp") / f"openenv-coding-0-reused{lease.uid}"
            base.mkdir()
            Registration(
                registry_dir(), base.name, {"uid": lease.uid, "own_uid": True, "base": str(base)}
            ).abandon()
            reclaim_orphans(killer)
            assert sleeper.poll() is None  # still running
            assert not base.exists()  # but the dead sandbox's directory is gone
            assert not (registry_dir() / f"{base.name}.json").exists()
        finally:
            sleeper.kill()
            sleeper.wait()
