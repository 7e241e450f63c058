"""The gymnasium README's example runs against a real server and prints what it promises."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

from openenv_grpc.testing import ServerProcess


def test_readme_example_runs(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("gymnasium")
    out = subprocess.run(
        [sys.executable, "-m", "openenv_grpc_envs.gymnasium.example", server.target],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    assert out == [
        "CartPole-v1: observations Box float32 (4,), actions Discrete(2), limit 500 steps",
        "pushed right 10 times: terminated=True return=10.0 pole angle=-0.241",
        "refused: INVALID_ARGUMENT: action: 4 is out of range for Discrete(4) (valid: 0..3)",
        "FrozenLake-v1: state 15 after 6 steps, reward=1.0 terminated=True",
        "ALE/Pong-v5: frame uint8 (210, 160, 3), 100800 bytes",
        "state: env_id=ALE/Pong-v5 episode_steps=0 seed=7",
    ]
