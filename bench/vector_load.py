"""Vector streams against per-stream sessions and the peers, side by side, in one run.

    python -m bench.vector_load --quick     # a few minutes
    python -m bench.vector_load --full      # longer points, three repetitions (median)

Scenarios, each closed loop (one request in flight per stream) on this machine:

1. ``echo``: env-steps/s and server CPU per env-step for N = 1, 16, 64, 256 envs as one
   ``VectorSession`` of N envs, as N openenv-grpc sessions, as N bare grpc.aio streams (the
   floor of one message per env), and as N sessions of OpenEnv 0.10.0 (``openenv``, the
   current release) default and tuned -- and of 0.3.0 (``openenv-core``), kept for
   continuity. Each OpenEnv release runs in a venv of its own (``bench.systems``).
2. ``cpu``: the CPU-heavy env (~1 ms of pure-Python CPU per step), one vector stream of 64
   envs: one server process against ``--isolated 2``.
3. ``sessions``: the single-stream ``Session`` path before (``--baseline``, default
   ``main``) and after this tree: steps/s and server CPU per step at 1 and 64 sessions,
   interleaved.

Writes ``bench/results/<stamp>-vector-<mode>.json``, the section of docs/benchmarks.md
between ``<!-- vector:start -->`` and ``<!-- vector:end -->`` and docs/bench/vector_echo.png.
Numbers are measured, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import run as bench_run
from bench import systems as sysm
from bench.systems import ROOT, Server, System

MESSAGE = bench_run.MESSAGE
START, END = "<!-- vector:start -->", "<!-- vector:end -->"
DASH = "\u2013"  # an en dash, for what was not measured

VECTOR = System(
    "vector", "openenv-grpc VectorSession (one stream of N)", "grpc",
    "`EnvService.VectorSession`: one stream holds the N envs; one message each way per "
    "vector step; echo is a plain env, so the server's generic loop answers it",
)  # fmt: skip
PEERS = {
    "openenv-grpc": replace(sysm.SYSTEMS["openenv-grpc"], label="openenv-grpc, N sessions"),
    "bare-grpc": replace(sysm.SYSTEMS["bare-grpc"], label="bare grpc.aio, N streams (floor)"),
    "openenv-0.10-default": replace(
        sysm.SYSTEMS["openenv-default"], name="openenv-0.10-default", peer="0.10.0",
        label="OpenEnv 0.10.0 default, N sessions",
    ),
    "openenv-0.10-tuned": replace(
        sysm.SYSTEMS["openenv-tuned"], name="openenv-0.10-tuned", peer="0.10.0",
        label="OpenEnv 0.10.0 tuned, N sessions",
    ),
    "openenv-0.3-default": replace(
        sysm.SYSTEMS["openenv-default"], name="openenv-0.3-default",
        label="OpenEnv 0.3.0 default, N sessions",
    ),
    "openenv-0.3-tuned": replace(
        sysm.SYSTEMS["openenv-tuned"], name="openenv-0.3-tuned",
        label="OpenEnv 0.3.0 tuned, N sessions",
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Plan:
    mode: str
    sizes: tuple[int, ...]
    warmup: float
    seconds: float
    reps: int
    clients: int = 2  # client processes for N per-stream sessions (N > 1)


PLANS = {
    "quick": Plan("quick", (1, 16, 64, 256), 0.5, 2.0, 1),
    "full": Plan("full", (1, 16, 64, 256), 1.5, 6.0, 3),
    "smoke": Plan("smoke", (1, 8), 0.2, 0.5, 1),
}


def log(*parts: Any) -> None:
    print(*parts, file=sys.stderr, flush=True)


# -- the vector client (a process of its own, so its CPU is not the server's) ---------------


async def _client(cfg: dict[str, Any]) -> None:
    from openenv_grpc_envs.echo import AsyncEchoVectorEnv, EchoAction

    n = cfg["envs"]
    envs = AsyncEchoVectorEnv(cfg["target"], n)
    await envs.open()
    await envs.reset()
    actions = [EchoAction(message=cfg["message"])] * n
    print(json.dumps({"event": "ready"}), flush=True)
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    t0 = float(line.split()[1])
    measure_from, stop_at = t0 + cfg["warmup"], t0 + cfg["warmup"] + cfg["seconds"]
    await asyncio.sleep(max(0.0, t0 - time.monotonic()))
    latencies: list[float] = []
    errors = 0
    step = envs.step
    while True:
        a = time.monotonic()
        out = await step(actions)
        b = time.monotonic()
        errors += len(out.errors)
        if b >= stop_at:
            break
        if b >= measure_from:
            latencies.append(b - a)
    result = {"event": "result", "latencies_us": [x * 1e6 for x in latencies], "errors": errors}
    print(json.dumps(result), flush=True)
    await envs.close()


def vector_steady(server: Any, n: int, warmup: float, seconds: float) -> dict[str, Any]:
    """One vector stream of ``n`` envs against ``server``, measured like ``bench.run.steady``."""
    config = {
        "target": server.target,
        "envs": n,
        "message": MESSAGE,
        "warmup": warmup,
        "seconds": seconds,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.vector_load", "--client"], cwd=ROOT,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(json.dumps(config) + "\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline())["event"] == "ready"
        t0 = time.monotonic() + 0.2
        proc.stdin.write(f"go {t0!r}\n")
        proc.stdin.flush()
        measure_from, stop_at = t0 + warmup, t0 + warmup + seconds
        time.sleep(max(0.0, measure_from - time.monotonic()))
        m0, s0, c0 = sysm.machine_busy(), server.cpu(), sysm.cpu_seconds(proc.pid)
        time.sleep(max(0.0, stop_at - time.monotonic()))
        m1, s1, c1 = sysm.machine_busy(), server.cpu(), sysm.cpu_seconds(proc.pid)
        result = json.loads(proc.stdout.readline())
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        if proc.poll() is None:
            proc.kill()
    latencies = sorted(result["latencies_us"])
    vector_steps = len(latencies)
    env_steps = vector_steps * n
    server_cpu, client_cpu = s1 - s0, c1 - c0
    return {
        "sessions": n,
        "vector_steps": vector_steps,
        "steps": env_steps,
        "steps_per_s": env_steps / seconds,
        "p50_us": bench_run.percentile(latencies, 0.5),
        "p99_us": bench_run.percentile(latencies, 0.99),
        "server_cpu_us_per_step": server_cpu / env_steps * 1e6 if env_steps else None,
        "server_cpu_cores": server_cpu / seconds,
        "client_cpu_cores": client_cpu / seconds,
        "client_cpu_us_per_step": client_cpu / env_steps * 1e6 if env_steps else None,
        "other_cpu_cores": max(0.0, (m1 - m0) - server_cpu - client_cpu) / seconds,
        "errors": result["errors"],
    }


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ranked = sorted(rows, key=lambda r: r["steps_per_s"])
    row = dict(ranked[(len(ranked) - 1) // 2])
    if len(rows) > 1:
        row["repetitions"] = [round(r["steps_per_s"]) for r in rows]
    return row


def _per_stream(server: Server, n: int, plan: Plan) -> dict[str, Any]:
    steady_plan = replace(bench_run.PLANS["quick"], sessions_per_channel=250)
    processes = 1 if n == 1 else plan.clients
    return bench_run.steady(server, n, processes, plan.warmup, plan.seconds, steady_plan)


# -- scenario 1: echo ------------------------------------------------------------------------


def scenario_echo(plan: Plan, peers: list[str], cpu_loops: int) -> dict[str, Any]:
    chosen = [PEERS[name] for name in peers]
    servers = sysm.start_servers(chosen, "echo", cpu_loops)
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {}
    try:
        ours = servers.get("openenv-grpc")
        for _ in range(plan.reps):
            for n in plan.sizes:
                if ours is not None:
                    row = vector_steady(ours, n, plan.warmup, plan.seconds)
                    runs.setdefault(VECTOR.name, {}).setdefault(n, []).append(row)
                    _say("vector", n, row)
                for system in chosen:
                    row = _per_stream(servers[system.name], n, plan)
                    runs.setdefault(system.name, {}).setdefault(n, []).append(row)
                    _say(system.name, n, row)
                    time.sleep(0.3)
    finally:
        sysm.stop_servers(servers)
    return {name: [_median(by_n[n]) for n in plan.sizes] for name, by_n in runs.items()}


def _say(name: str, n: int, row: dict[str, Any]) -> None:
    cpu = row.get("server_cpu_us_per_step")
    log(
        f"  {name:22} N={n:4}: {row['steps_per_s']:10,.0f} env-steps/s  "
        f"server {cpu if cpu is None else round(cpu, 1)} us/env-step  "
        f"other {row['other_cpu_cores']:.2f} cores  errors {row['errors']}"
    )


# -- scenario 2: the CPU-heavy env, one process against --isolated 2 -------------------------


class _GrpcServer:
    """``openenv-grpc serve`` with extra flags (or from another tree), as ``bench.run``
    measures servers: ``target``, ``pid``, ``cpu()``, ``rss()``, ``system``."""

    def __init__(
        self, env: str, args: list[str], environ: dict[str, str], cwd: Path = ROOT,
        python_args: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        self.system = sysm.SYSTEMS["openenv-grpc"]
        cmd = [
            sys.executable,
            *python_args,
            "-m",
            "openenv_grpc",
            "serve",
            env,
            "--port",
            "0",
            "--max-concurrent-envs",
            "0",
            "--log-level",
            "WARNING",
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env={**os.environ, **environ}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        self.target = ""
        for line in self.proc.stdout:
            if "serving" in line:
                self.target = "127.0.0.1:" + line.strip().rsplit(":", 1)[1].split()[0]
                break
        if not self.target:
            raise RuntimeError(f"server {env} {args} did not start")
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu(self) -> float:
        return sysm.cpu_seconds(self.pid)

    def rss(self) -> int:
        return sysm.rss_kib(self.pid)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 9)
        self.proc.wait(30)


def scenario_cpu(plan: Plan, cpu_loops: int) -> dict[str, Any]:
    environ = {"BENCH_CPU_LOOPS": str(cpu_loops), "PYTHONPATH": str(ROOT)}
    out: dict[str, Any] = {}
    for label, args in (("one process", []), ("--isolated 2", ["--isolated", "2"])):
        server = _GrpcServer("bench.envs:CpuEnvironment", args, environ)
        try:
            rows = [vector_steady(server, 64, plan.warmup, plan.seconds) for _ in range(plan.reps)]
        finally:
            server.stop()
        out[label] = row = _median(rows)
        _say(f"cpu {label}", 64, row)
    return out


# -- scenario 3: the Session path, before and after ------------------------------------------


def _baseline_tree(rev: str, into: Path) -> Path:
    """``openenv_grpc`` and the env catalogue at ``rev``, importable from ``into``."""
    archive = subprocess.run(
        ["git", "archive", rev, "openenv_grpc", "envs"], cwd=ROOT, check=True,
        capture_output=True,
    ).stdout  # fmt: skip
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(into, filter="data")
    (into / "envs").rename(into / "openenv_grpc_envs")
    return into


def scenario_sessions(plan: Plan, baseline: str) -> dict[str, Any]:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", baseline], cwd=ROOT, check=True, capture_output=True,
        text=True,
    ).stdout.strip()  # fmt: skip
    site = next(p for p in sys.path if p.endswith("site-packages"))
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tree = _baseline_tree(baseline, Path(tmp))
        # -S: no site hooks (the editable install would import this tree), so the
        # baseline's copy wins; site-packages still gives grpc and friends.
        before = _GrpcServer(
            "echo", [], {"PYTHONPATH": f"{tree}{os.pathsep}{site}"}, cwd=tree, python_args=("-S",)
        )
        after = _GrpcServer("echo", [], {})
        try:
            for rep in range(max(plan.reps, 2)):
                order = [("before", before), ("after", after)]
                for name, server in order if rep % 2 == 0 else order[::-1]:
                    for n in (1, 64):
                        row = _per_stream(server, n, plan)  # type: ignore[arg-type]
                        runs.setdefault(name, {}).setdefault(n, []).append(row)
                        _say(f"session {name}", n, row)
        finally:
            before.stop()
            after.stop()
    result: dict[str, Any] = {
        name: [_median(by_n[n]) for n in (1, 64)] for name, by_n in runs.items()
    }
    result["baseline"] = f"{baseline} ({commit})"
    return result


# -- the report ------------------------------------------------------------------------------


def _fmt(x: Any, digits: int = 0) -> str:
    if not isinstance(x, (int, float)):
        return DASH
    return f"{x:,.{digits}f}"


def _at(rows: list[dict[str, Any]], n: int) -> dict[str, Any] | None:
    return next((r for r in rows if r["sessions"] == n), None)


def summarize(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets for vector streams, as ratios from this run."""
    echo = results["scenarios"].get("echo", {})
    targets = []
    vec = _at(echo.get("vector", []), 64)
    tuned = _at(echo.get("openenv-0.10-tuned", []), 64)
    if vec:
        cpu = vec["server_cpu_us_per_step"]
        targets.append(
            {
                "target": "echo vector N=64: server CPU per env-step",
                "measured": cpu,
                "goal": "<= 5 us",
                "holds": cpu is not None and cpu <= 5,
            }
        )
    if vec and tuned:
        ratio = vec["steps_per_s"] / tuned["steps_per_s"]
        targets.append(
            {
                "target": "echo vector N=64 env-steps/s / OpenEnv 0.10.0 tuned at 64 sessions",
                "measured": ratio,
                "goal": ">= 5x",
                "holds": ratio >= 5,
            }
        )
    cpu_rows = results["scenarios"].get("cpu", {})
    if "one process" in cpu_rows and "--isolated 2" in cpu_rows:
        ratio = cpu_rows["--isolated 2"]["steps_per_s"] / cpu_rows["one process"]["steps_per_s"]
        targets.append(
            {
                "target": "CPU-heavy N=64: --isolated 2 / one process",
                "measured": ratio,
                "goal": ">= 1.6x",
                "holds": ratio >= 1.6,
            }
        )
    sessions = results["scenarios"].get("sessions", {})
    for n in (1, 64):
        before, after = _at(sessions.get("before", []), n), _at(sessions.get("after", []), n)
        if before and after:
            ratio = after["steps_per_s"] / before["steps_per_s"]
            targets.append(
                {
                    "target": f"Session path, {n} session(s): steps/s after / before",
                    "measured": ratio,
                    "goal": ">= 1x (no slower; noise ~10%)",
                    "holds": ratio >= 0.9,
                }
            )
    return targets


def markdown(results: dict[str, Any], path: Path) -> str:
    machine = results["machine"]
    lines = [
        START,
        f"*Generated by `{results['command']}` on {results['timestamp']} ({results['mode']}): "
        f"{machine['cpus']} cores, load average {machine['loadavg_start'][0]:.1f} at the start "
        f"and {machine['loadavg_end'][0]:.1f} at the end; raw numbers in "
        f"`{_shown(path)}`.*",
        "",
    ]
    echo = results["scenarios"].get("echo", {})
    if echo:
        sizes = [r["sessions"] for r in next(iter(echo.values()))]
        names = [VECTOR.name, *[n for n in PEERS if n in echo]]
        labels = {VECTOR.name: VECTOR.label, **{k: v.label for k, v in PEERS.items()}}
        head = "| echo | " + " | ".join(f"N = {n}" for n in sizes) + " |"
        rule = "|---|" + "---:|" * len(sizes)
        for title, key, digits in (
            ("env-steps/s (closed loop, one request in flight per stream)", "steps_per_s", 0),
            ("server CPU µs per env-step", "server_cpu_us_per_step", 1),
            ("client CPU µs per env-step", "client_cpu_us_per_step", 1),
        ):
            lines += [f"**{title}**", "", head, rule]
            for name in names:
                if name.startswith("openenv-0.3") and key != "steps_per_s":
                    continue
                cells = []
                for n in sizes:
                    row = _at(echo.get(name, []), n)
                    mark = " *" if row and row.get("other_cpu_cores", 0) > 0.3 else ""
                    cells.append(_fmt(row and row.get(key), digits) + mark)
                lines.append(f"| {labels[name]} | " + " | ".join(cells) + " |")
            lines.append("")
        lines += [
            "\\* provisional: other work on the machine took more than 0.3 of a core while "
            "this point was measured. OpenEnv 0.3.0 (`openenv-core`) is kept in the first "
            "table for continuity with the earlier runs; the peer is 0.10.0.",
            "",
        ]
    cpu_rows = results["scenarios"].get("cpu", {})
    if cpu_rows:
        lines += [
            "**CPU-heavy env (~1 ms of CPU per step), one vector stream of 64 envs**", "",
            "| server | env-steps/s | p50 vector step µs | server cores |", "|---|---:|---:|---:|",
        ]  # fmt: skip
        for label, row in cpu_rows.items():
            lines.append(
                f"| {label} | {_fmt(row['steps_per_s'])} | {_fmt(row['p50_us'])} | "
                f"{row['server_cpu_cores']:.2f} |"
            )
        lines.append("")
    sessions = results["scenarios"].get("sessions", {})
    if sessions:
        lines += [
            f"**The Session path before ({sessions['baseline']}) and after**", "",
            "| | steps/s @1 | server µs/step @1 | steps/s @64 | server µs/step @64 |",
            "|---|---:|---:|---:|---:|",
        ]  # fmt: skip
        for name in ("before", "after"):
            one, many = _at(sessions[name], 1), _at(sessions[name], 64)
            lines.append(
                f"| {name} | {_fmt(one and one['steps_per_s'])} | "
                f"{_fmt(one and one['server_cpu_us_per_step'], 1)} | "
                f"{_fmt(many and many['steps_per_s'])} | "
                f"{_fmt(many and many['server_cpu_us_per_step'], 1)} |"
            )
        lines.append("")
    targets = results.get("targets", [])
    if targets:
        lines += [
            "**Targets (ratios from this run; recorded, never asserted)**",
            "",
            "| target | measured | goal | |",
            "|---|---:|---|---|",
        ]
        for t in targets:
            value = t["measured"]
            shown = DASH if value is None else f"{value:.2f}"
            lines.append(
                f"| {t['target']} | {shown} | {t['goal']} | {'holds' if t['holds'] else 'MISSES'} |"
            )
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def write_docs(results: dict[str, Any], path: Path, docs: Path, plots: Path) -> None:
    section = markdown(results, path)
    text = docs.read_text(encoding="utf-8") if docs.exists() else ""
    if START in text and END in text:
        before, rest = text.split(START, 1)
        text = before + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip() + "\n\n## Vector streams (generated)\n\n" + section + "\n"
    docs.write_text(text, encoding="utf-8")
    echo = results["scenarios"].get("echo", {})
    if not echo:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = {VECTOR.name: VECTOR.label, **{k: v.label for k, v in PEERS.items()}}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rows in echo.items():
        ax.plot(
            [r["sessions"] for r in rows],
            [r["steps_per_s"] for r in rows],
            marker="o",
            label=labels.get(name, name),
            linewidth=2.5 if name == VECTOR.name else 1.2,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("N (envs)")
    ax.set_ylabel("env-steps/s")
    ax.set_title("echo: one vector stream of N envs vs N sessions")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    plots.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(plots / "vector_echo.png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick")
    mode.add_argument("--full", dest="mode", action="store_const", const="full")
    mode.add_argument("--smoke", dest="mode", action="store_const", const="smoke")
    mode.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--scenarios",
        nargs="+",
        default=["echo", "cpu", "sessions"],
        choices=["echo", "cpu", "sessions"],
    )
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=list(PEERS))
    parser.add_argument("--baseline", default="main", help="git revision for `sessions`")
    parser.add_argument("--reps", type=int, help="repetitions per point (median)")
    parser.add_argument("--seconds", type=float, help="measured seconds per point")
    parser.add_argument("--results-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--plots-dir", type=Path, default=ROOT / "docs" / "bench")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args(argv)
    if args.client:
        asyncio.run(_client(json.loads(sys.stdin.readline())))
        return 0
    plan = PLANS[args.mode or "quick"]
    if args.reps:
        plan = replace(plan, reps=args.reps)
    if args.seconds:
        plan = replace(plan, seconds=args.seconds)
    sysm.raise_fd_limit()
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    results: dict[str, Any] = {
        "schema": 1,
        "mode": plan.mode,
        "timestamp": stamp,
        "command": "python -m bench.vector_load "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": bench_run.machine(),
        "plan": plan.__dict__,
        "scenarios": {},
        "versions": {},
    }
    for peer in sorted({PEERS[name].peer for name in args.peers if PEERS[name].kind == "openenv"}):
        results["versions"][f"openenv {peer}"] = sysm.ensure_openenv_venv(log, peer)
    cpu_loops = bench_run.calibrate_cpu_loops()
    results["cpu_loops"] = cpu_loops
    started = time.monotonic()
    if "echo" in args.scenarios:
        log("bench: echo, vector stream against N sessions")
        results["scenarios"]["echo"] = scenario_echo(plan, args.peers, cpu_loops)
    if "cpu" in args.scenarios:
        log("bench: CPU-heavy env, N = 64, one process against --isolated 2")
        results["scenarios"]["cpu"] = scenario_cpu(plan, cpu_loops)
    if "sessions" in args.scenarios:
        log(f"bench: the Session path, {args.baseline} against this tree")
        results["scenarios"]["sessions"] = scenario_sessions(plan, args.baseline)
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["duration_s"] = round(time.monotonic() - started, 1)
    results["targets"] = summarize(results)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"{stamp}-vector-{plan.mode}.json"
    path.write_text(json.dumps(bench_run.clean(results), indent=1) + "\n")
    log(f"bench: wrote {path}")
    if not args.no_docs:
        write_docs(results, path, args.docs, args.plots_dir)
    for target in results["targets"]:
        log(f"  target {target['target']}: {target['measured']} ({target['goal']})")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
