"""The coding README's example runs against a real server and prints what it promises."""

from __future__ import annotations

import subprocess
import sys
from typing import Any


def test_readme_example_runs(start_server: Any) -> None:
    server = start_server("coding")
    out = subprocess.run(
        [sys.executable, "-m", "openenv_grpc_envs.coding.example", server.target],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    assert out == [
        "reset: workdir files []",
        "step 1: stdout='hello from the sandbox\\n' exit_code=0 LIMIT_NONE",
        "step 2: exit_code=1 LIMIT_NONE 'ZeroDivisionError: division by zero'",
        "step 3: exit_code=-9 LIMIT_WALL_TIME",
        "step 4: add uses '-': reward=0.50 terminated=False",
        "  add_zero: passed",
        "  add_io: failed: stdout line 1: expected '5', got '-1'",
        "step 5: add uses '+': reward=1.00 terminated=True",
        "  add_zero: passed",
        "  add_io: passed",
        "state: step_count=5 files=['notes.txt']",
    ]
