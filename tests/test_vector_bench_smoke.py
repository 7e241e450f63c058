"""Smoke run of the vector benchmark (``python -m bench.vector_load --smoke``): every
scenario end to end in seconds against openenv-grpc and the bare floor (the OpenEnv peers
need venvs from PyPI, too slow for the suite); checks the result's shape, the generated
docs section and the plot, never how fast anything is."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_vector_bench_smoke_run(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nHand-written text stays.\n")
    done = subprocess.run(
        [sys.executable, "-m", "bench.vector_load", "--smoke", "--peers", "openenv-grpc",
         "bare-grpc", "--results-dir", str(tmp_path / "results"), "--docs", str(docs),
         "--plots-dir", str(tmp_path / "plots")],
        cwd=ROOT, capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(Path(done.stdout.strip().splitlines()[-1]).read_text())
    scenarios = results["scenarios"]
    assert set(scenarios) == {"echo", "cpu", "sessions"}
    for name in ("vector", "openenv-grpc", "bare-grpc"):
        rows = scenarios["echo"][name]
        assert [row["sessions"] for row in rows] == results["plan"]["sizes"]
        for row in rows:
            assert row["errors"] == 0 and _positive(row["steps_per_s"]), (name, row)
            assert _positive(row["server_cpu_us_per_step"]), (name, row)
    for label in ("one process", "--isolated 2"):
        assert _positive(scenarios["cpu"][label]["steps_per_s"])
    for name in ("before", "after"):
        assert [row["sessions"] for row in scenarios["sessions"][name]] == [1, 64]
    targets = {t["target"] for t in results["targets"]}  # N = 64 is not among smoke's sizes
    assert "CPU-heavy N=64: --isolated 2 / one process" in targets
    text = docs.read_text()
    assert text.startswith("# Benchmarks\n\nHand-written text stays.\n")
    assert text.count("<!-- vector:start -->") == 1 and "VectorSession" in text
    assert (tmp_path / "plots" / "vector_echo.png").read_bytes()[:4] == b"\x89PNG"
