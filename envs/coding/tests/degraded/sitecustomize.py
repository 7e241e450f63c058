"""Turns the Python that imports it into a root process on a "default Docker" host.

``test_reliability_sandbox.py`` puts this folder on a server's PYTHONPATH (and sets
``CODING_TEST_DEGRADED=1``) to test the sandbox's fallbacks for real: like a container
without CAP_SYS_ADMIN under Docker's default seccomp profile, the server is root but can
make no namespaces, mount nothing and sees no cgroup file system. Python runs this file
at start-up, before any thread exists.

With ``CODING_TEST_NO_SECCOMP=1`` instead, the host is this VM as it is except for the
seccomp filter, as on a host without libseccomp (what the sandbox then removes itself,
e.g. kernel keys, is tested there).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

CLONE_NEWNS = 0x00020000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 2


def _degrade() -> None:
    from openenv_grpc_envs.coding.harness import load_seccomp

    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            raise OSError(ctypes.get_errno(), f"degrading the host: {what}")

    # A mount namespace of this process's own, where the cgroup file systems are gone.
    check(libc.unshare(CLONE_NEWNS), "unshare")
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    if os.path.ismount("/sys/fs/cgroup"):
        check(libc.umount2(b"/sys/fs/cgroup", MNT_DETACH), "unmount /sys/fs/cgroup")
    # Then no namespaces and no mounts, for this process and all it starts.
    load_seccomp(libc)


if os.environ.get("CODING_TEST_DEGRADED") == "1":
    _degrade()


def _no_seccomp() -> None:
    """A host without libseccomp (the sandbox's filter is off; nothing else changes)."""
    from dataclasses import replace

    from openenv_grpc_envs.coding import sandbox

    probe = sandbox.probe_host

    def probe_without_seccomp(trial: Any) -> Any:
        support = probe(trial)
        why = "turned off by the test (CODING_TEST_NO_SECCOMP=1)"
        return replace(support, seccomp=False, missing={**support.missing, "seccomp": why})

    sandbox.probe_host = probe_without_seccomp  # type: ignore[attr-defined]


if os.environ.get("CODING_TEST_NO_SECCOMP") == "1":
    _no_seccomp()
