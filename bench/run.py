"""Side-by-side benchmark: openenv-grpc against OpenEnv (openenv-core 0.3.0) and bare grpc.aio.

One command runs every system on this machine, one after the other, and writes
``bench/results/<timestamp>.json``, the generated section of ``docs/benchmarks.md`` and
the plots in ``docs/bench/``::

    python -m bench.run --quick     # < 3 minutes: 1/64/256/1024 sessions, 2,000 idle, N <= 2,048
    python -m bench.run --full      # bigger: 1..1024 sessions, 20,000 idle, N <= 32,768

Scenarios (each for every system): (1) step round trip at 1 session; (2) steps/s and
p50/p99 against sessions, closed loop, one step in flight per session, several client
processes; (3) server CPU per step at 64 sessions; (4) session open (connect + reset)
p50/p99; (5) idle sessions held and server KiB per session; (6) admission: N sessions at
once, each connect, reset, one step whose env sleeps 1 s, close; the largest N with
>= 95% success; (7) a CPU-heavy env (~1 ms of pure-Python CPU per step), one server
process.

The OpenEnv servers run in ``build/bench-openenv-venv`` (created on first use, needs
PyPI). Numbers are measured, never asserted; see docs/benchmarks.md for how to read them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench import systems as sysm
from bench.systems import SYSTEMS, Server, System

MESSAGE = "x" * 64  # the action's message: 64 bytes for every system


@dataclass(frozen=True)
class Plan:
    """How big each scenario is in one mode."""

    mode: str
    sessions: tuple[int, ...]  # scenario 2 (must include 1 and 64)
    warmup: float
    seconds: float
    clients: int  # client processes for the steady scenarios with more than one session
    open_count: int  # scenario 4: sessions opened one after the other
    idle_cap: int  # scenario 5
    idle_stages: int
    admission: tuple[int, ...]  # scenario 6: N doubling
    admission_timeout: float  # seconds each session gets for its whole lifecycle
    cpu_sessions: int  # scenario 7
    cpu_seconds: float
    sessions_per_channel: int = 250  # gRPC streams per channel (HTTP/2 connection)
    reps: int = 1  # scenario 2: repetitions per point, interleaved; the median is reported


PLANS = {
    "quick": Plan(
        mode="quick",
        sessions=(1, 64, 256, 1024),
        warmup=0.3,
        seconds=1.5,
        clients=2,
        open_count=150,
        idle_cap=2000,
        idle_stages=4,
        admission=(256, 512, 1024, 2048),
        admission_timeout=60.0,
        cpu_sessions=64,
        cpu_seconds=1.5,
    ),
    "full": Plan(
        mode="full",
        sessions=(1, 16, 64, 256, 1024),
        warmup=2.0,
        seconds=10.0,
        clients=2,
        open_count=1000,
        idle_cap=20000,
        idle_stages=10,
        admission=(256, 512, 1024, 2048, 4096, 8192, 16384, 32768),
        admission_timeout=60.0,
        cpu_sessions=64,
        cpu_seconds=10.0,
        reps=3,
    ),
    "smoke": Plan(  # for tests/test_bench_smoke.py: seconds, structure only
        mode="smoke",
        sessions=(1, 8),
        warmup=0.2,
        seconds=0.5,
        clients=2,
        open_count=20,
        idle_cap=100,
        idle_stages=2,
        admission=(16, 32),
        admission_timeout=20.0,
        cpu_sessions=4,
        cpu_seconds=0.5,
        sessions_per_channel=4,
    ),
}

SCENARIOS = ("throughput", "open", "idle", "admission", "cpu")


def log(*parts: Any) -> None:
    print(*parts, file=sys.stderr, flush=True)


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * (len(sorted_values) - 1) + 0.5))]


def burn(loops: int) -> int:
    """The CPU-heavy env's step: same loop as bench.envs, bare_echo and openenv_server."""
    x = 0
    for i in range(loops):
        x += i * i % 7
    return x


def calibrate_cpu_loops(target_ms: float = 1.0) -> int:
    """Loop iterations that take ``target_ms`` of CPU in this Python (best of 7)."""
    n = 20_000
    best = math.inf
    for _ in range(7):
        t = time.process_time()
        burn(n)
        best = min(best, time.process_time() - t)
    return max(1000, int(n * target_ms / 1000 / max(best, 1e-6)))


def _settle(seconds: float = 0.3) -> None:
    time.sleep(seconds)


# -- scenario 1-3, 7: closed-loop steady load ----------------------------------------------


def steady(
    server: Server,
    sessions: int,
    processes: int,
    warmup: float,
    seconds: float,
    plan: Plan,
) -> dict[str, Any]:
    system = server.system
    processes = max(1, min(processes, sessions))
    shares = [sessions // processes + (i < sessions % processes) for i in range(processes)]
    configs = [
        {
            "scenario": "steady",
            "target": server.target,
            "sessions": n,
            "sessions_per_channel": plan.sessions_per_channel,
            "compression": system.compression,
            "message": MESSAGE,
            "warmup": warmup,
            "seconds": seconds,
            "local_addr": f"127.0.0.{10 + i}" if system.kind == "openenv" else None,
        }
        for i, n in enumerate(shares)
    ]
    clients = sysm.start_clients(system, configs)
    try:
        ready = [c.expect("ready", 300) for c in clients]
        opened = sum(r["opened"] for r in ready)
        open_errors = sum(r["errors"] for r in ready)
        t0 = time.monotonic() + 0.2
        for c in clients:
            c.send(f"go {t0!r}")
        measure_from, stop_at = t0 + warmup, t0 + warmup + seconds
        time.sleep(max(0.0, measure_from - time.monotonic()))
        m0, s0, c0 = sysm.machine_busy(), server.cpu(), [sysm.cpu_seconds(c.pid) for c in clients]
        time.sleep(max(0.0, stop_at - time.monotonic()))
        m1, s1, c1 = sysm.machine_busy(), server.cpu(), [sysm.cpu_seconds(c.pid) for c in clients]
        rss = server.rss()
        server_threads = sysm.threads(server.pid)
        results = [c.expect("result", 60 + seconds) for c in clients]
    finally:
        sysm.stop_clients(clients)
    latencies = sorted(x for r in results for x in r["latencies_us"])
    steps = len(latencies)
    client_cpu = sum(b - a for a, b in zip(c0, c1, strict=False))
    errors = sum(r["errors"] for r in results) + open_errors
    samples = [s for r in ready for s in r["error_sample"]] + [
        s for r in results for s in r["error_sample"]
    ]
    return {
        "sessions": sessions,
        "sessions_opened": opened,
        "client_processes": processes,
        "steps": steps,
        "steps_per_s": steps / seconds,
        "p50_us": percentile(latencies, 0.50),
        "p99_us": percentile(latencies, 0.99),
        "server_cpu_us_per_step": (s1 - s0) / steps * 1e6 if steps else float("nan"),
        "server_cpu_cores": (s1 - s0) / seconds,
        "server_rss_kib": rss,
        "server_threads": server_threads,
        "client_cpu_cores": client_cpu / seconds,
        "client_cpu_us_per_step": client_cpu / steps * 1e6 if steps else float("nan"),
        # CPU the rest of the machine used meanwhile: > 0 means other work competed.
        "other_cpu_cores": max(0.0, (m1 - m0) - (s1 - s0) - client_cpu) / seconds,
        "errors": errors,
        "error_sample": samples[:3],
    }


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The repetition with the median steps/s (a real run, so its columns agree)."""
    ranked = sorted(runs, key=lambda r: r["steps_per_s"])
    row = dict(ranked[(len(ranked) - 1) // 2])
    if len(runs) > 1:
        row["repetitions"] = [round(r["steps_per_s"]) for r in runs]
    return row


def scenario_throughput(
    plan: Plan, chosen: list[System], servers: dict[str, Server]
) -> dict[str, Any]:
    """Session counts in the outer loop and systems in the inner one (and repetitions
    outside both), so a burst of other work on the machine hits every system alike."""
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for _ in range(plan.reps):
        for n in plan.sessions:
            for system in chosen:
                processes = 1 if n == 1 else plan.clients
                row = steady(servers[system.name], n, processes, plan.warmup, plan.seconds, plan)
                runs.setdefault((system.name, n), []).append(row)
                log(
                    f"  {system.name:16} {n:5} sessions: {row['steps_per_s']:9,.0f} steps/s  "
                    f"p50 {row['p50_us']:9,.0f} µs  p99 {row['p99_us']:9,.0f} µs  "
                    f"server {row['server_cpu_us_per_step']:6.0f} µs/step  "
                    f"clients {row['client_cpu_cores']:.2f} cores  "
                    f"other {row['other_cpu_cores']:.2f} cores  errors {row['errors']}"
                )
                _settle()
    return {
        system.name: [_median_run(runs[(system.name, n)]) for n in plan.sessions]
        for system in chosen
    }


def scenario_cpu(plan: Plan, chosen: list[System], servers: dict[str, Server]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for system in chosen:
        row = steady(
            servers[system.name],
            plan.cpu_sessions,
            plan.clients,
            plan.warmup,
            plan.cpu_seconds,
            plan,
        )
        out[system.name] = row
        log(
            f"  {system.name:16} cpu-heavy: {row['steps_per_s']:7,.0f} steps/s  "
            f"p99 {row['p99_us']:9,.0f} µs  server {row['server_cpu_us_per_step']:6.0f} "
            f"µs/step  other {row['other_cpu_cores']:.2f} cores  errors {row['errors']}"
        )
        _settle()
    return out


# -- scenario 4: session open ------------------------------------------------------------------


def open_latency(server: Server, count: int, cold: bool) -> dict[str, Any]:
    system = server.system
    config = {
        "scenario": "open",
        "target": server.target,
        "count": count,
        "cold": cold,
        "compression": system.compression,
        "message": MESSAGE,
    }
    clients = sysm.start_clients(system, [config])
    try:
        result = clients[0].expect("result", 120 + count * 0.1)
    finally:
        sysm.stop_clients(clients)
    latencies = sorted(result["latencies_us"])
    return {
        "count": len(latencies),
        "p50_us": percentile(latencies, 0.50),
        "p99_us": percentile(latencies, 0.99),
        "errors": result["errors"],
        "error_sample": result["error_sample"],
    }


def scenario_open(plan: Plan, chosen: list[System], servers: dict[str, Server]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for system in chosen:
        server = servers[system.name]
        open_latency(server, 10, False)  # warm the code paths
        row = open_latency(server, plan.open_count, False)
        if system.kind == "grpc":  # its own channel: TCP + HTTP/2 handshake included
            cold = open_latency(server, plan.open_count, True)
            row["cold_p50_us"], row["cold_p99_us"] = cold["p50_us"], cold["p99_us"]
        out[system.name] = row
        extra = f"  own channel p50 {row['cold_p50_us']:,.0f} µs" if "cold_p50_us" in row else ""
        log(
            f"  {system.name:16} open: p50 {row['p50_us']:8,.0f} µs  "
            f"p99 {row['p99_us']:8,.0f} µs{extra}  errors {row['errors']}"
        )
    return out


# -- scenario 5: idle sessions -----------------------------------------------------------------


def idle(server: Server, plan: Plan) -> dict[str, Any]:
    system = server.system
    processes = max(1, math.ceil(plan.idle_cap / 5000))
    configs = [
        {
            "scenario": "idle",
            "target": server.target,
            "sessions_per_channel": plan.sessions_per_channel,
            "compression": system.compression,
            "message": MESSAGE,
            "local_addr": f"127.0.0.{10 + i}" if system.kind == "openenv" else None,
        }
        for i in range(processes)
    ]
    clients = sysm.start_clients(system, configs)
    curve: list[list[int]] = []
    try:
        for c in clients:
            c.expect("ready", 60)
        # Warm the code paths with one session per client, then take the baseline.
        for c in clients:
            c.send("open 1")
        warm = sum(c.expect("held", 60)["held"] for c in clients)
        _settle(0.5)
        base = server.rss()
        curve.append([warm, base])
        held, errors, sample, attempted = warm, 0, [], processes
        for stage in range(plan.idle_stages):
            # Stage k brings the total to k/stages of the cap.
            goal = warm + (plan.idle_cap - warm) * (stage + 1) // plan.idle_stages
            per_stage = max(0, goal - attempted)
            shares = [
                per_stage // processes + (i < per_stage % processes) for i in range(processes)
            ]
            for c, n in zip(clients, shares, strict=False):
                c.send(f"open {n}")
            reports = [c.expect("held", 600) for c in clients]
            held = sum(r["held"] for r in reports)
            errors = sum(r["errors"] for r in reports)
            attempted = sum(r["opened"] + r["errors"] for r in reports)
            sample = [s for r in reports for s in r["error_sample"]][:3]
            if not server.alive():
                sample.append("server process died")
                break
            _settle()
            curve.append([held, server.rss()])
            log(f"  {system.name:16} idle: {held:6} held  rss {curve[-1][1] / 1024:7.1f} MiB")
            if errors >= plan.idle_cap // 2:
                break  # the server stopped admitting: more attempts only take time
        rss = curve[-1][1]
        # The server's own view: which sessions are still alive after a settle.
        server_threads = sysm.threads(server.pid)
        for c in clients:
            c.send("open 0")
        held = sum(c.expect("held", 120)["held"] for c in clients)
    finally:
        server.stop()  # first: the clients then exit without closing anything
        for c in clients:
            c.send("exit")
        sysm.stop_clients(clients)
    return {
        "target": plan.idle_cap,
        "held": held,
        "errors": errors,
        "error_sample": sample,
        "rss_base_kib": base,
        "rss_kib": rss,
        "kib_per_session": (rss - base) / (held - warm) if held > warm else float("nan"),
        "server_threads": server_threads,
        "curve": curve,
    }


def scenario_idle(plan: Plan, chosen: list[System], servers: dict[str, Server]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for system in chosen:  # fresh servers, idle until their turn: memory is the measurement
        out[system.name] = row = idle(servers[system.name], plan)  # stops the server
        log(
            f"  {system.name:16} idle: held {row['held']:,} of {row['target']:,}  "
            f"{row['kib_per_session']:.1f} KiB/session  errors {row['errors']}"
        )
    return out


# -- scenario 6: admission ---------------------------------------------------------------------


def admission_run(server: Server, n: int, plan: Plan) -> dict[str, Any]:
    system = server.system
    processes = max(2, math.ceil(n / 4096)) if n >= 2 else 1
    shares = [n // processes + (i < n % processes) for i in range(processes)]
    configs = [
        {
            "scenario": "admission",
            "target": server.target,
            "sessions": k,
            "sessions_per_channel": plan.sessions_per_channel,
            "compression": system.compression,
            "message": MESSAGE,
            "timeout": plan.admission_timeout,
            "local_addr": f"127.0.0.{10 + i}" if system.kind == "openenv" else None,
        }
        for i, k in enumerate(shares)
    ]
    clients = sysm.start_clients(system, configs)
    try:
        for c in clients:
            c.expect("ready", 60)
        t0 = time.monotonic() + 0.3
        for c in clients:
            c.send(f"go {t0!r}")
        peak_threads = 0
        results = []
        for c in clients:
            while True:  # poll for the result, sampling the server's threads meanwhile
                try:
                    results.append(c.expect("result", 0.25))
                    break
                except TimeoutError:
                    peak_threads = max(peak_threads, sysm.threads(server.pid))
                    if time.monotonic() > t0 + plan.admission_timeout + 120:
                        raise
    finally:
        sysm.stop_clients(clients)
    ok = sum(r["ok"] for r in results)
    durations = sorted(d for r in results for d in r["durations_s"])
    errors: dict[str, int] = {}
    for r in results:
        for kind, count in r["errors"].items():
            errors[kind] = errors.get(kind, 0) + count
    return {
        "n": n,
        "ok": ok,
        "failed": n - ok,
        "success_rate": ok / n,
        "wall_s": max(r["wall_s"] for r in results),
        "session_p50_s": percentile(durations, 0.5),
        "session_p99_s": percentile(durations, 0.99),
        "server_peak_threads": peak_threads,
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
        "client_processes": processes,
    }


def scenario_admission(
    plan: Plan, chosen: list[System], servers: dict[str, Server]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for system in chosen:
        server = servers[system.name]
        runs: list[dict[str, Any]] = []
        best = 0
        for n in plan.admission:
            run = admission_run(server, n, plan)
            run["server_alive"] = server.alive()
            runs.append(run)
            log(
                f"  {system.name:16} admission N={n:6}: {run['success_rate']:7.1%} ok  "
                f"wall {run['wall_s']:5.1f}s  p99 {run['session_p99_s']:5.2f}s  "
                f"threads {run['server_peak_threads']}  {list(run['errors'])[:1]}"
            )
            if run["success_rate"] < 0.95 or not run["server_alive"]:
                break  # larger N is not tried once one fails
            best = n
            _settle()  # the sessions just closed: let the server reclaim them
        out[system.name] = {"max_n_95": best, "runs": runs}
        server.stop()  # frees its memory and sockets before the next system's runs
    return out


#: Which server env each scenario runs against; scenarios in one group share servers.
GROUPS = (
    ("echo", ("throughput", "open")),
    ("echo", ("idle",)),  # fresh servers: memory from a clean start
    ("sleep", ("admission",)),
    ("cpu", ("cpu",)),
)


# -- the run -----------------------------------------------------------------------------------


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def machine() -> dict[str, Any]:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    with open("/proc/meminfo") as f:
        mem_kib = int(f.readline().split()[1])
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "memory_gib": round(mem_kib / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
    }


def ensure_matplotlib() -> bool:
    """Plots need matplotlib; install it into this Python if missing (bench-only dep)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log("bench: installing matplotlib for the plots ...")
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "matplotlib"], check=False
        )
        if done.returncode != 0:
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick")
    mode.add_argument("--full", dest="mode", action="store_const", const="full")
    mode.add_argument("--smoke", dest="mode", action="store_const", const="smoke")
    parser.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument(
        "--sessions", type=int, nargs="+", help="override scenario 2's session counts"
    )
    parser.add_argument("--seconds", type=float, help="override the measured seconds per point")
    parser.add_argument("--clients", type=int, help="client processes for multi-session loads")
    parser.add_argument("--reps", type=int, help="repetitions per throughput point (median)")
    parser.add_argument("--results-dir", type=Path, default=sysm.ROOT / "bench" / "results")
    parser.add_argument("--docs", type=Path, default=sysm.ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--plots-dir", type=Path, default=sysm.ROOT / "docs" / "bench")
    parser.add_argument("--no-docs", action="store_true", help="write the JSON only")
    args = parser.parse_args(argv)
    plan = PLANS[args.mode or "quick"]
    if args.sessions:
        plan = replace(plan, sessions=tuple(args.sessions))
    if args.seconds:
        plan = replace(plan, seconds=args.seconds, cpu_seconds=args.seconds)
    if args.clients:
        plan = replace(plan, clients=args.clients)
    if args.reps:
        plan = replace(plan, reps=args.reps)
    chosen = [SYSTEMS[name] for name in SYSTEMS if name in args.systems]

    started = time.monotonic()
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    fd_limit = sysm.raise_fd_limit()
    results: dict[str, Any] = {
        "schema": 1,
        "mode": plan.mode,
        "timestamp": stamp,
        "command": "python -m bench.run " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {**machine(), "fd_limit": fd_limit},
        "versions": {
            "openenv-grpc": _version("openenv-grpc"),
            "grpcio": _version("grpcio"),
            "protobuf": _version("protobuf"),
        },
        "plan": asdict(plan),
        "message_bytes": len(MESSAGE),
        "systems": {s.name: {"label": s.label, "description": s.description} for s in chosen},
        "scenarios": {},
    }
    if any(s.kind == "openenv" for s in chosen):
        results["versions"]["openenv_venv"] = sysm.ensure_openenv_venv(log)
    plots = not args.no_docs and ensure_matplotlib()
    cpu_loops = calibrate_cpu_loops()
    results["cpu_loops"] = cpu_loops
    log(
        f"bench: {plan.mode} mode, systems {', '.join(s.name for s in chosen)}; "
        f"cpu env = {cpu_loops} loop iterations (~1 ms)"
    )
    runners = {
        "throughput": scenario_throughput,
        "open": scenario_open,
        "idle": scenario_idle,
        "admission": scenario_admission,
        "cpu": scenario_cpu,
    }
    for env, names in GROUPS:
        todo = [name for name in names if name in args.scenarios]
        if not todo:
            continue
        servers = sysm.start_servers(chosen, env, cpu_loops)
        try:
            for name in todo:
                log(f"bench: scenario {name}")
                t = time.monotonic()
                results["scenarios"][name] = runners[name](plan, chosen, servers)
                results.setdefault("scenario_seconds", {})[name] = round(time.monotonic() - t, 1)
        finally:
            sysm.stop_servers(servers)
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["duration_s"] = round(time.monotonic() - started, 1)

    from bench import report

    results["summary"] = report.summarize(results)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / f"{stamp}-{plan.mode}.json"
    out.write_text(json.dumps(clean(results), indent=1) + "\n")
    log(f"bench: wrote {out}")
    if not args.no_docs:
        written = report.write_docs(results, out, args.docs, args.plots_dir, plots=plots)
        for path in written:
            log(f"bench: wrote {path}")
    log(f"bench: done in {results['duration_s']:.0f} s")
    print(out)
    return 0


def clean(value: Any) -> Any:
    """JSON-ready: NaN and infinities become null, tuples lists, floats rounded."""
    if isinstance(value, float):
        return round(value, 3) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
