"""The openspiel README's example runs against a real server and prints what it promises."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

from openenv_grpc.testing import ServerProcess


def test_readme_example_runs(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("openspiel")
    out = subprocess.run(
        [sys.executable, "-m", "openenv_grpc_envs.openspiel.example", server.target],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    assert out == [
        "catch: tensor float32 (5, 3), ball in column 0",
        "catch: caught after 4 steps, reward=+1",
        "tic_tac_toe: illegal action 4 (x(1,1)) for player 0 now",
        "xxx",
        "ox.",
        ".oo",
        "tic_tac_toe: returns=[1.0, -1.0]",
        "tic_tac_toe: history=[4, 3, 0, 8, 1, 7, 2]",
        "kuhn_poker: info state '1'",
        "kuhn_poker: legal ['Pass', 'Bet']",
        "kuhn_poker: '1 0 bp' reward=+1",
    ]
