"""Smoke run of the side-by-side benchmark (``python -m bench.run --smoke``).

Runs every scenario end to end, in seconds, against openenv-grpc and the bare grpc.aio
floor (the OpenEnv peer needs its own virtualenv from PyPI, too slow for the suite), and
checks the result's shape: the JSON, the generated docs section and the plots. It asserts
that numbers exist and are positive, never how fast anything is.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("openenv-grpc", "bare-grpc")


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_bench_smoke_run(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nHand-written text stays.\n")
    plots = tmp_path / "plots"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.run",
            "--smoke",
            "--systems",
            *SYSTEMS,
            "--results-dir",
            str(tmp_path / "results"),
            "--docs",
            str(docs),
            "--plots-dir",
            str(plots),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result_path = Path(done.stdout.strip().splitlines()[-1])
    assert result_path.parent == tmp_path / "results"
    results = json.loads(result_path.read_text())

    assert results["mode"] == "smoke"
    assert set(results["systems"]) == set(SYSTEMS)
    scenarios = results["scenarios"]
    assert set(scenarios) == {"throughput", "open", "idle", "admission", "cpu"}
    for system in SYSTEMS:
        rows = scenarios["throughput"][system]
        assert [row["sessions"] for row in rows] == results["plan"]["sessions"]
        for row in rows:
            assert row["errors"] == 0, row
            for key in ("steps_per_s", "p50_us", "p99_us", "server_cpu_us_per_step"):
                assert _positive(row[key]), (system, key, row)
            assert row["server_rss_kib"] > 0 and row["client_cpu_cores"] > 0

        opened = scenarios["open"][system]
        assert opened["errors"] == 0 and opened["count"] == results["plan"]["open_count"]
        assert _positive(opened["p50_us"]) and _positive(opened["cold_p50_us"])

        idle = scenarios["idle"][system]
        assert idle["held"] == idle["target"] == results["plan"]["idle_cap"]
        assert _positive(idle["kib_per_session"])
        assert len(idle["curve"]) == results["plan"]["idle_stages"] + 1

        admission = scenarios["admission"][system]
        assert admission["max_n_95"] in results["plan"]["admission"]
        for run in admission["runs"]:
            assert 0 <= run["success_rate"] <= 1 and _positive(run["wall_s"])

        cpu = scenarios["cpu"][system]
        assert _positive(cpu["steps_per_s"]) and _positive(cpu["server_cpu_us_per_step"])

    summary = results["summary"]
    assert "ratios" in summary and isinstance(summary["targets"], list)

    text = docs.read_text()
    assert text.startswith("# Benchmarks\n\nHand-written text stays.\n")
    assert text.count("<!-- bench:start -->") == 1 and text.count("<!-- bench:end -->") == 1
    assert "openenv-grpc" in text
    for name in ("steps_per_s.png", "p99_latency.png", "memory.png", "admission.png"):
        png = plots / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_gym_session_bench_smoke() -> None:
    """``python -m bench.gym_session`` end to end, one short round per server."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.gym_session", "--seconds", "0.5", "--warmup", "0.3",
         "--rounds", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    summary = lines[-1]
    servers = {"echo", "gym", "gym-pool", "gym-inline"}
    assert {row["server"] for row in lines[:-1]} == servers
    assert set(summary["median_cpu_us_per_step"]) == servers
    assert all(_positive(v) for v in summary["median_cpu_us_per_step"].values())
    assert summary["cpu_vs_echo"]["echo"] == 1.0
