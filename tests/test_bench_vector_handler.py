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
