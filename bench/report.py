"""Turns a `bench.run` result into ratios, a markdown section and PNG plots.

``python -m bench.report bench/results/X.json`` rewrites the generated section of
docs/benchmarks.md (between ``<!-- bench:start -->`` and ``<!-- bench:end -->``; the
hand-written text around it is kept) and the plots in docs/bench/ from a stored result.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

START, END = "<!-- bench:start -->", "<!-- bench:end -->"
OURS, DEFAULT, TUNED, BARE = "openenv-grpc", "openenv-default", "openenv-tuned", "bare-grpc"
ORDER = (OURS, BARE, DEFAULT, TUNED)
DASH, TIMES = "\u2013", "\u00d7"  # shown in the tables
STYLE = {
    OURS: {"color": "#1f77b4", "marker": "o"},
    BARE: {"color": "#7f7f7f", "marker": "s", "linestyle": "--"},
    DEFAULT: {"color": "#d62728", "marker": "^"},
    TUNED: {"color": "#ff7f0e", "marker": "v"},
}


def _ok(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if _ok(a) and _ok(b) and b else None


def _row(results: dict[str, Any], system: str, sessions: int) -> dict[str, Any] | None:
    for row in results["scenarios"].get("throughput", {}).get(system, []):
        if row["sessions"] == sessions:
            return row  # type: ignore[no-any-return]
    return None


def key_sessions(results: dict[str, Any]) -> int | None:
    """The session count the throughput targets are read at: 1024, else the largest
    count every system was measured at."""
    table = results["scenarios"].get("throughput", {})
    if not table:
        return None
    common = set.intersection(*({r["sessions"] for r in rows} for rows in table.values()))
    if not common:
        return None
    return 1024 if 1024 in common else max(common)


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Ratios of openenv-grpc against each OpenEnv variant, and the issue's targets."""
    sc = results["scenarios"]
    targets: list[dict[str, Any]] = []

    def target(name: str, measured: float | None, goal: str, holds: bool | None) -> None:
        targets.append(
            {
                "target": name,
                "measured": measured,
                "goal": goal,
                "verdict": "n/a" if holds is None else ("holds" if holds else "MISSES"),
            }
        )

    n = key_sessions(results)
    ratios: dict[str, Any] = {"throughput_sessions": n}
    if n is not None:
        ours = _row(results, OURS, n)
        for peer, goal in ((DEFAULT, 5.0), (TUNED, 1.3)):
            theirs = _row(results, peer, n)
            r = _ratio(ours and ours["steps_per_s"], theirs and theirs["steps_per_s"])
            ratios[f"steps_per_s_vs_{peer}"] = r
            target(
                f"steps/s at {n} sessions vs {peer}",
                r,
                f">= {goal}x",
                None if r is None else r >= goal,
            )
        bare = _row(results, BARE, n)
        ratios["steps_per_s_vs_bare"] = _ratio(
            ours and ours["steps_per_s"], bare and bare["steps_per_s"]
        )
    ours64, default64 = _row(results, OURS, 64), _row(results, DEFAULT, 64)
    tuned64 = _row(results, TUNED, 64)
    r = _ratio(
        ours64 and ours64["server_cpu_us_per_step"],
        default64 and default64["server_cpu_us_per_step"],
    )
    ratios["server_cpu_64_vs_openenv-default"] = r
    ratios["server_cpu_64_vs_openenv-tuned"] = _ratio(
        ours64 and ours64["server_cpu_us_per_step"],
        tuned64 and tuned64["server_cpu_us_per_step"],
    )
    target("server CPU per step at 64 sessions vs openenv-default", r, "<= 0.5x",
           None if r is None else r <= 0.5)  # fmt: skip
    idle = sc.get("idle", {})
    for peer in (DEFAULT, TUNED):
        if OURS in idle and peer in idle:
            r = _ratio(idle[OURS]["kib_per_session"], idle[peer]["kib_per_session"])
            ratios[f"idle_kib_per_session_vs_{peer}"] = r
            target(f"idle KiB/session vs {peer}", r, "< 1x (less memory)",
                   None if r is None else r < 1)  # fmt: skip
    for peer in (DEFAULT, TUNED):
        if OURS in idle and peer in idle and idle[OURS]["held"] == idle[peer]["held"]:
            ratios[f"idle_total_rss_vs_{peer}"] = _ratio(
                idle[OURS]["rss_kib"], idle[peer]["rss_kib"]
            )
    adm = sc.get("admission", {})
    for peer in (DEFAULT, TUNED):
        if OURS in adm and peer in adm:
            a, b = adm[OURS]["max_n_95"], adm[peer]["max_n_95"]
            ratios[f"admission_n_vs_{peer}"] = _ratio(a, b) if b else None
            plan_max = max(results["plan"]["admission"])
            target(
                f"admission N (>= 95% ok) vs {peer}",
                a,
                f">= {peer}'s {b:,}" + (" (largest N tried)" if a == plan_max else ""),
                a >= b and (a > b or a == plan_max),
            )
    cpu = sc.get("cpu", {})
    for peer in (DEFAULT, TUNED):
        if OURS in cpu and peer in cpu:
            ratios[f"cpu_env_steps_per_s_vs_{peer}"] = _ratio(
                cpu[OURS]["steps_per_s"], cpu[peer]["steps_per_s"]
            )
    return {"ratios": ratios, "targets": targets}


# -- markdown -----------------------------------------------------------------------------


def _n(x: Any, digits: int = 0) -> str:
    if not _ok(x):
        return DASH
    return f"{x:,.{digits}f}"


def _x(x: Any) -> str:
    return f"{x:.2f}{TIMES}" if _ok(x) else DASH


def _label(results: dict[str, Any], system: str) -> str:
    label = results["systems"][system]["label"]
    return f"**{label}**" if system == OURS else str(label)


def _systems(results: dict[str, Any]) -> list[str]:
    return [s for s in ORDER if s in results["systems"]]


def markdown(results: dict[str, Any], result_path: str, plot_paths: list[str]) -> str:
    sc = results["scenarios"]
    m = results["machine"]
    plan = results["plan"]
    lines: list[str] = []
    add = lines.append
    load = m.get("loadavg_start", [0])[0], m.get("loadavg_end", [0])[0]
    add(f"### Latest run: `{results['command'].strip()}` ({results['mode']} mode)")
    add("")
    add(
        f"{results['timestamp']}, {results['duration_s']:.0f} s; "
        f"{m['cpus']} CPUs ({m['cpu_model']}), {m['memory_gib']} GiB, Python {m['python']}, "
        f"RLIMIT_NOFILE {m.get('fd_limit', '?'):,}; load average {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end. Raw numbers: `{result_path}`."
    )
    v = results["versions"]
    peer = v.get("openenv_venv", {})
    add(
        f"Versions: openenv-grpc {v['openenv-grpc']}, grpcio {v['grpcio']}, protobuf "
        f"{v['protobuf']}"
        + (
            f"; openenv-core {peer.get('openenv-core')}, uvicorn {peer.get('uvicorn')}, "
            f"websockets {peer.get('websockets')}, fastapi {peer.get('fastapi')}, "
            f"pydantic {peer.get('pydantic')}."
            if peer
            else "."
        )
    )
    others = [
        r.get("other_cpu_cores", 0.0)
        for rows in sc.get("throughput", {}).values()
        for r in rows
        if _ok(r.get("other_cpu_cores"))
    ]
    busiest = max(others, default=0.0)
    if busiest > 0.25 or max(load) > (m["cpus"] or 1) * 0.75:
        add("")
        add(
            "> **Provisional:** other work shared this machine during the run (load average "
            f"above; up to {busiest:.2f} cores of CPU outside the benchmark's own processes "
            "during a measured window, column *other CPU*). Rerun `make bench` on a quiet "
            "machine before quoting numbers."
        )
    add("")
    add("| system | what runs |")
    add("|---|---|")
    for s in _systems(results):
        add(f"| {_label(results, s)} | {results['systems'][s]['description']} |")
    add("")

    summary = results.get("summary") or summarize(results)
    if summary["targets"]:
        add("#### Targets (performance issue)")
        add("")
        add("| target | measured | goal | verdict |")
        add("|---|---:|---|---|")
        for t in summary["targets"]:
            measured = t["measured"]
            shown = _x(measured) if "x" in t["goal"] else _n(measured)
            add(f"| {t['target']} | {shown} | {t['goal']} | {t['verdict']} |")
        add("")

    tp = sc.get("throughput", {})
    if tp:
        add("#### (1-3) Echo: steps/s, step round trip, server CPU per step")
        add("")
        add(
            f"Closed loop, one step in flight per session, {results['message_bytes']}-byte "
            f"message, {plan['warmup']} s warm-up then {plan['seconds']} s measured per point; "
            f"{plan['clients']} client processes (1 at one session); "
            + (
                f"median of {plan['reps']} interleaved repetitions; "
                if plan.get("reps", 1) > 1
                else ""
            )
            + "server CPU is the server "
            "process's own utime+stime over the measured window divided by the steps in it; "
            "client CPU is all client processes together, in cores; other CPU is what the rest "
            "of the machine used meanwhile (anything well above 0 means the row was disturbed)."
        )
        add("")
        add(
            "| system | sessions | steps/s | p50 µs | p99 µs | server CPU µs/step | "
            "server RSS MiB | client CPU (cores) | other CPU (cores) | errors |"
        )
        add("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        counts = sorted({r["sessions"] for rows in tp.values() for r in rows})
        for n in counts:
            for s in _systems(results):
                row = _row(results, s, n)
                if row is None:
                    continue
                add(
                    f"| {_label(results, s)} | {n:,} | {_n(row['steps_per_s'])} | "
                    f"{_n(row['p50_us'])} | {_n(row['p99_us'])} | "
                    f"{_n(row['server_cpu_us_per_step'])} | "
                    f"{_n(row['server_rss_kib'] / 1024, 1)} | "
                    f"{_n(row['client_cpu_cores'], 2)} | {_n(row.get('other_cpu_cores'), 2)} | "
                    f"{row['errors']} |"
                )
        add("")
        r = summary["ratios"]
        n = r.get("throughput_sessions")
        add(
            f"openenv-grpc steps/s at {n} sessions: {_x(r.get('steps_per_s_vs_openenv-default'))} "
            f"OpenEnv default, {_x(r.get('steps_per_s_vs_openenv-tuned'))} OpenEnv tuned, "
            f"{_x(r.get('steps_per_s_vs_bare'))} the bare grpc.aio floor. Server CPU per step at "
            f"64 sessions: {_x(r.get('server_cpu_64_vs_openenv-default'))} OpenEnv default's, "
            f"{_x(r.get('server_cpu_64_vs_openenv-tuned'))} OpenEnv tuned's."
        )
        add("")

    op = sc.get("open", {})
    if op:
        add("#### (4) Session open: connect + reset")
        add("")
        add(
            f"{plan['open_count']} sessions opened one after the other (after 10 to warm up), "
            "each timed from nothing to the reset's answer, then closed. gRPC sessions open a "
            "stream on a channel that is already connected (how clients share channels); the "
            "'own channel' columns include the TCP + HTTP/2 handshake, which every OpenEnv "
            "session pays (TCP + WebSocket upgrade)."
        )
        add("")
        add("| system | p50 µs | p99 µs | own channel p50 µs | own channel p99 µs | errors |")
        add("|---|---:|---:|---:|---:|---:|")
        for s in _systems(results):
            if s in op:
                row = op[s]
                add(
                    f"| {_label(results, s)} | {_n(row['p50_us'])} | {_n(row['p99_us'])} | "
                    f"{_n(row.get('cold_p50_us'))} | {_n(row.get('cold_p99_us'))} | "
                    f"{row['errors']} |"
                )
        add("")

    idle = sc.get("idle", {})
    if idle:
        add("#### (5) Idle sessions: how many are held, server memory per session")
        add("")
        add(
            f"Sessions opened (connect + reset) and held, in {plan['idle_stages']} stages up "
            f"to {plan['idle_cap']:,}; server RSS (VmRSS from /proc, process and children) "
            "after each stage. KiB/session = (RSS at the end - RSS with one warm session per "
            "client process) / sessions added. gRPC sessions share channels of "
            f"{plan['sessions_per_channel']} streams (grpc-core's server sets no limit on "
            "concurrent streams per connection; 100 is only HTTP/2's recommended minimum, "
            "which proxies often use); every OpenEnv session is a TCP connection, so a server "
            "holds at most RLIMIT_NOFILE of them."
        )
        add("")
        add("| system | held | of | server RSS MiB | KiB/session | server threads | errors |")
        add("|---|---:|---:|---:|---:|---:|---|")
        for s in _systems(results):
            if s in idle:
                row = idle[s]
                err = f"{row['errors']:,}" + (
                    f" ({row['error_sample'][0]})" if row["errors"] and row["error_sample"] else ""
                )
                add(
                    f"| {_label(results, s)} | {row['held']:,} | {row['target']:,} | "
                    f"{_n(row['rss_kib'] / 1024, 1)} | {_n(row['kib_per_session'], 1)} | "
                    f"{row.get('server_threads', DASH)} | {err} |"
                )
        add("")

    adm = sc.get("admission", {})
    if adm:
        add("#### (6) Admission: N sessions at once (OpenEnv's scaling-study test)")
        add("")
        add(
            "N sessions launched together from "
            "several client processes; each connects, resets, takes one step whose env "
            "sleeps 1 s (`asyncio.sleep` in openenv-grpc, the bare floor and OpenEnv tuned; "
            "`time.sleep` in OpenEnv default, as a sync env is written), and closes, within "
            f"{plan['admission_timeout']:.0f} s. N doubles from {min(plan['admission']):,} to "
            f"{max(plan['admission']):,} against one server per system (every session of a run "
            "has ended before the next); a system stops at its first N under 95% success. "
            "openenv-grpc runs with `--max-concurrent-envs 0`, OpenEnv with "
            "`max_concurrent_envs=100000`."
        )
        add("")
        add(
            "| system | largest N ≥ 95% ok "
            "| N: success, wall s, session p99 s, peak server threads |"
        )
        add("|---|---:|---|")
        for s in _systems(results):
            if s in adm:
                runs = "; ".join(
                    f"{r['n']:,}: {r['success_rate']:.0%}, {_n(r['wall_s'], 1)}, "
                    f"{_n(r['session_p99_s'], 2)}, {r['server_peak_threads']}"
                    for r in adm[s]["runs"]
                )
                add(f"| {_label(results, s)} | {adm[s]['max_n_95']:,} | {runs} |")
        failures = [
            (s, r) for s in _systems(results) if s in adm for r in adm[s]["runs"] if r["errors"]
        ]
        if failures:
            add("")
            add("Failures seen:")
            for s, r in failures:
                kinds = "; ".join(f"{k} x{c}" for k, c in r["errors"].items())
                add(f"- {results['systems'][s]['label']}, N={r['n']:,}: {kinds}")
        add("")

    cpu = sc.get("cpu", {})
    if cpu:
        add("#### (7) CPU-heavy env: ~1 ms of pure-Python CPU per step, one server process")
        add("")
        add(
            f"Each step runs {results['cpu_loops']:,} iterations of the same Python loop "
            f"(calibrated to ~1 ms on this machine); {plan['cpu_sessions']} sessions, closed "
            "loop. openenv-grpc's env is a plain sync `Environment` (its thread pool runs it); "
            "OpenEnv default a sync `step` (its per-session thread); OpenEnv tuned and the "
            "bare floor run it on the event loop. One process is bound by the GIL either way: "
            "this row is the ceiling that later issues (workers) raise."
        )
        add("")
        add("| system | steps/s | p50 µs | p99 µs | server CPU µs/step | other CPU | errors |")
        add("|---|---:|---:|---:|---:|---:|---:|")
        for s in _systems(results):
            if s in cpu:
                row = cpu[s]
                add(
                    f"| {_label(results, s)} | {_n(row['steps_per_s'])} | {_n(row['p50_us'])} | "
                    f"{_n(row['p99_us'])} | {_n(row['server_cpu_us_per_step'])} | "
                    f"{_n(row.get('other_cpu_cores'), 2)} | {row['errors']} |"
                )
        add("")

    if plot_paths:
        add("#### Plots")
        add("")
        for path in plot_paths:
            add(f"![{Path(path).stem}]({path})")
        add("")
    return "\n".join(lines).rstrip() + "\n"


def splice(document: str, section: str) -> str:
    """Replace what is between the markers (or append the markers and the section)."""
    block = f"{START}\n{section}{END}"
    if START in document and END in document:
        head, _, rest = document.partition(START)
        _, _, tail = rest.partition(END)
        return head + block + tail
    return document.rstrip() + "\n\n" + block + "\n"


# -- plots ------------------------------------------------------------------------------------


def plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    labels = {s: results["systems"][s]["label"] for s in results["systems"]}
    title_tail = f" ({results['mode']} run {results['timestamp']})"
    tp = results["scenarios"].get("throughput", {})

    def finish(fig: Any, ax: Any, name: str, title: str) -> None:
        ax.set_title(title + title_tail, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    if tp:
        for key, name, ylabel, title, logy in (
            ("steps_per_s", "steps_per_s.png", "steps/s", "Echo throughput vs sessions", False),
            ("p99_us", "p99_latency.png", "p99 step latency (µs)", "p99 step round trip", True),
        ):
            fig, ax = plt.subplots(figsize=(7, 4.2))
            for s in ORDER:
                rows = tp.get(s)
                if not rows:
                    continue
                xs = [r["sessions"] for r in rows if _ok(r[key])]
                ys = [r[key] for r in rows if _ok(r[key])]
                ax.plot(xs, ys, label=labels[s], **STYLE[s])
            ax.set_xscale("log", base=2)
            if logy:
                ax.set_yscale("log")
            ax.set_xlabel("concurrent sessions (closed loop, 1 step in flight each)")
            ax.set_ylabel(ylabel)
            finish(fig, ax, name, title)

    idle = results["scenarios"].get("idle", {})
    if idle:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for s in ORDER:
            if s in idle:
                curve = idle[s]["curve"]
                ax.plot([c[0] for c in curve], [c[1] / 1024 for c in curve],
                        label=labels[s], **STYLE[s])  # fmt: skip
        ax.set_xlabel("open idle sessions")
        ax.set_ylabel("server RSS (MiB)")
        finish(fig, ax, "memory.png", "Server memory vs open sessions")

    adm = results["scenarios"].get("admission", {})
    if adm:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for s in ORDER:
            if s in adm:
                runs = adm[s]["runs"]
                ax.plot([r["n"] for r in runs], [100 * r["success_rate"] for r in runs],
                        label=labels[s], **STYLE[s])  # fmt: skip
        ax.axhline(95, color="black", linewidth=0.8, linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sessions launched at once (each: connect, reset, 1 s step, close)")
        ax.set_ylabel("sessions completed (%)")
        finish(fig, ax, "admission.png", "Admission")
    return written


def write_docs(
    results: dict[str, Any], result_path: Path, docs: Path, plots_dir: Path, plots: bool = True
) -> list[Path]:
    """Write the plots and splice the markdown section into ``docs``."""
    written = globals()["plots"](results, plots_dir) if plots else []
    rel = [os.path.relpath(p, docs.parent) for p in written]
    try:
        shown = str(result_path.resolve().relative_to(docs.resolve().parent.parent))
    except ValueError:
        shown = str(result_path)
    section = markdown(results, shown, rel)
    document = docs.read_text() if docs.exists() else "# Benchmarks\n"
    docs.write_text(splice(document, section))
    return [*written, docs]


def main() -> None:
    from bench.systems import ROOT

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("result", type=Path)
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--plots-dir", type=Path, default=ROOT / "docs" / "bench")
    args = parser.parse_args()
    results = json.loads(args.result.read_text())
    results["summary"] = summarize(results)
    for path in write_docs(results, args.result, args.docs, args.plots_dir):
        print(path)


if __name__ == "__main__":
    main()
