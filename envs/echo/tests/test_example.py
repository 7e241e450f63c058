"""The echo README's example runs against a real server and prints what it promises."""

from __future__ import annotations

import subprocess
import sys


def test_readme_example_runs(server) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "openenv_grpc_envs.echo.example", server.target],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    assert out[0].startswith("reset -> 'hi', episode ")
    assert out[1:] == [
        "step 1: 'ping' reward=0.4 truncated=False",
        "step 2: 'ping' reward=0.4 truncated=True",
        "step 1: terminated=True",
        "state: total_length=3",
    ]
