"""Snapshots over real gRPC, against real server processes: what Info says, and a server
that refuses to start on bad keys (the secret never printed)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest

from openenv_grpc.testing import ServerProcess

#: The start_server fixture of the root conftest.py.
StartServer = Callable[..., ServerProcess]

pytestmark = pytest.mark.timeout(60)

SNAP = "support.envs:SnapshotEchoEnv"
SECRET = "0123456789abcdef0123456789abcdef"
KEYS = {"SNAPSHOT_KEYS": f"k1:{SECRET}"}


def test_info_advertises_support_the_limit_and_the_signing_key(start_server: StartServer) -> None:
    keyed = start_server(SNAP, "--max-snapshot-bytes", "4096", extra_env=KEYS).info().snapshots
    assert (keyed.supported, keyed.max_bytes, keyed.signing_key_id) == (True, 4096, "k1")
    assert not keyed.ephemeral_key
    plain = start_server("support.envs:FaultyEnv").info().snapshots
    assert not plain.supported
    assert plain.ephemeral_key and plain.signing_key_id.startswith("ephemeral-")
    assert plain.max_bytes == 8 * 1024 * 1024


@pytest.mark.parametrize(
    ("environ", "words"),
    [
        ({"SNAPSHOT_KEYS": "k1:tooshort"}, "the secret of key 'k1' is 8 bytes"),
        ({"SNAPSHOT_KEYS": f"k1:{SECRET}", "SNAPSHOT_KEYS_FILE": "/nonexistent"}, "not both"),
        ({"SNAPSHOT_KEYS_FILE": "/nonexistent/keys"}, "/nonexistent/keys"),
    ],
)
def test_bad_keys_stop_the_server_at_start_without_printing_a_secret(
    environ: dict[str, str], words: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "openenv_grpc", "serve", "echo", "--port", "0"],
        env={**_environ(), **environ}, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode != 0
    assert words in done.stderr
    assert "tooshort" not in done.stderr + done.stdout
    assert SECRET not in done.stderr + done.stdout


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SNAPSHOT_")}
