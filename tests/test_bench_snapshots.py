"""Smoke run of ``python -m bench.snapshots``: every number it reports exists and is
positive, and the markdown tables come out; never how fast anything is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_snapshots_smoke_run() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.snapshots", "--cases", "echo", "tic_tac_toe",
         "--reps", "5", "--forks", "1", "--markdown"],
        cwd=ROOT, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    results = [json.loads(line) for line in lines if line.startswith('{"case"')]
    assert [r["case"] for r in results] == ["echo", "tic_tac_toe"]
    for result in results:
        assert result["snapshot_bytes"] > 0
        for part in ("round_trip", "snapshot", "restore", "state"):
            assert 0 < result[part]["p50_ms"] <= result[part]["p99_ms"]
        for client in ("fork16_async", "fork16_sync"):
            assert 0 < result[client]["min_ms"] <= result[client]["max_ms"]
    assert json.loads(lines[0])["cpus"] >= 1 and "load_before" in lines[0]
    assert any(line.startswith("| tic_tac_toe |") for line in lines)
