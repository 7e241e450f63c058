"""bench.vector_handler runs: the handler's CPU per vector message is printed for each
system asked (numbers are never asserted)."""

from __future__ import annotations

import ast

import pytest

from bench import vector_handler


def test_the_handler_bench_prints_one_row_per_system(capsys: pytest.CaptureFixture[str]) -> None:
    code = vector_handler.main(
        ["--systems", "echo-loop", "echo-native", "--num-envs", "4", "--messages", "20"]
    )
    assert code == 0
    rows = [ast.literal_eval(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["system"] for row in rows] == ["echo-loop", "echo-native"]
    assert all(row["n"] == 4 and row["cpu_us_per_message"] > 0 for row in rows)


def test_the_client_cpu_bench_prints_one_row_per_client() -> None:
    """bench.vector_client_cpu runs its clients in child processes against a real server
    and prints each one's CPU per message pair by thread."""
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "bench.vector_client_cpu", "--clients", "raw-sync", "library",
         "--seconds", "0.3", "--rounds", "1", "--num-envs", "4"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [row["client"] for row in rows] == ["raw-sync", "library"]
    assert all(row["cpu_us_per_message"] > 0 and "python:" in row["threads_us_per_message"]
               for row in rows)  # fmt: skip
