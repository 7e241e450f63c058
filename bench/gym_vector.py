"""Gymnasium vector envs, remote against in process (issue 13): CartPole-v1 at N = 8, 64,
256 and Pong at N = 16, env-steps/s, CPU per env-step and client bytes per frame.

    python -m bench.gym_vector                       # the whole run (~6 minutes)
    python -m bench.gym_vector --sizes 64 --seconds 3 --systems sync remote-vector
    python -m bench.gym_vector --report bench/results/gym_vector-<time>.json   # redo the docs

Systems (each closed loop, one vector step in flight, actions pre-drawn with a seeded
generator so the loop measures only stepping):

* ``sync`` / ``async``: Gymnasium's in-process ``SyncVectorEnv`` / ``AsyncVectorEnv``
  (one process per env; run up to N = 64 only, 256 processes do not fit two cores).
* ``envpool``: ``envpool.make_gymnasium`` in process (C++ threads).
* ``remote-vector``: ``RemoteGymnasiumVectorEnv`` over one vector stream, Gymnasium
  backend; ``remote-vector-envpool``: the same with ``backend="envpool"``;
  ``remote-sessions``: N session streams (``transport="sessions"``). The server is a child
  ``openenv-grpc serve gymnasium`` on loopback, unlimited capacity.

Each row reports env-steps/s, the client's and the server's CPU per env-step, and the
machine's *other* CPU during the window (busy CPU-seconds per second not spent by this
process or the server: other engineers' tests), so noisy rows can be told apart; rows
whose other CPU exceeds 0.5 cores are marked provisional. ``client_bytes_per_frame``
(Pong): the peak of Python-heap bytes (tracemalloc: bytes objects, numpy buffers) held
during one vector step above the level before it, divided by the step's frames and a
frame's size; 1.0 means one frame-sized copy per frame.

Numbers are measured, never asserted. Results go to ``bench/results/gym_vector-*.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np

from bench.systems import cpu_seconds, machine_busy

RESULTS = Path(__file__).resolve().parent / "results"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
START, END = "<!-- gym_vector:start -->", "<!-- gym_vector:end -->"
SYSTEMS = ("sync", "async", "envpool", "remote-vector", "remote-vector-envpool", "remote-sessions")
#: AsyncVectorEnv runs a process per env: above this many it does not fit the machine.
ASYNC_MAX = 64
PONG = "ALE/Pong-v5"
PONG_KWARGS: dict[str, Any] = {"frameskip": 4}


@dataclass
class Row:
    """One system at one size."""

    env: str
    system: str
    num_envs: int
    env_steps_per_s: float
    ratio_to_sync: float | None
    client_cpu_us_per_env_step: float
    server_cpu_us_per_env_step: float | None
    other_cpu_cores: float
    provisional: bool
    seconds: float
    client_bytes_per_frame: float | None = None


@contextmanager
def server(extra_env: dict[str, str] | None = None) -> Iterator[tuple[str, int]]:
    """A child ``openenv-grpc serve gymnasium`` on a free loopback port: (target, pid)."""
    command = [sys.executable, "-m", "openenv_grpc.cli", "serve", "gymnasium", "--port", "0",
               "--max-concurrent-envs", "0"]  # fmt: skip
    env = {**os.environ, **(extra_env or {})}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env)  # fmt: skip
    try:
        assert process.stdout is not None
        target = ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            if "serving gymnasium on" in line:
                host_port = line.split(" on ", 1)[1].split()[0]
                target = host_port
                break
        if not target:
            raise RuntimeError("the server did not start")
        yield target, process.pid
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def make_system(
    system: str, env_id: str, kwargs: dict[str, Any], num_envs: int, target: str
) -> Any:
    """The vector env a system names (reset by the caller)."""
    if system in ("sync", "async"):
        fns = [lambda: gymnasium.make(env_id, **kwargs)] * num_envs
        if system == "sync":
            return gymnasium.vector.SyncVectorEnv(fns)
        return gymnasium.vector.AsyncVectorEnv(fns)
    if system == "envpool":
        import envpool

        return envpool.make_gymnasium(env_id, num_envs=num_envs, batch_size=num_envs, seed=0)
    from openenv_grpc_envs.gymnasium.adapters import RemoteGymnasiumVectorEnv

    if system == "remote-vector":
        return RemoteGymnasiumVectorEnv(target, num_envs, env_id, kwargs=kwargs,
                                        backend="gymnasium")  # fmt: skip
    if system == "remote-vector-envpool":
        return RemoteGymnasiumVectorEnv(target, num_envs, env_id, kwargs=kwargs,
                                        backend="envpool")  # fmt: skip
    return RemoteGymnasiumVectorEnv(target, num_envs, env_id, kwargs=kwargs, transport="sessions")


def prepare(envs: Any, actions: list[Any], num_envs: int, frame_bytes: int | None) -> Any:
    """Reset, warm up for 1 s, and (Pong) measure the client bytes per frame."""
    if _is_envpool(envs):
        envs.reset()  # seeded when made
    else:
        envs.reset(seed=0)
    warm_until = time.monotonic() + 1.0
    i = 0
    while time.monotonic() < warm_until:
        envs.step(actions[i % len(actions)])
        i += 1
    if not frame_bytes:
        return None
    tracemalloc.start()
    peaks = []
    for k in range(10):
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        envs.step(actions[k % len(actions)])
        peaks.append(tracemalloc.get_traced_memory()[1] - before)
    tracemalloc.stop()
    return float(np.median(peaks)) / (num_envs * frame_bytes)


def window(
    envs: Any, num_envs: int, actions: list[Any], seconds: float, server_pid: int
) -> dict[str, float]:
    """Closed-loop steps for ``seconds``: steps, wall, client, server and other CPU (the
    server's CPU counts for remote systems; for the others it idles)."""
    step: Callable[[Any], Any] = envs.step
    wall0, cpu0, busy0 = time.monotonic(), _client_cpu(server_pid), machine_busy()
    server0 = cpu_seconds(server_pid)
    steps = 0
    deadline = wall0 + seconds
    while time.monotonic() < deadline:
        step(actions[steps % len(actions)])
        steps += 1
    wall = time.monotonic() - wall0
    client = _client_cpu(server_pid) - cpu0
    server_cpu = cpu_seconds(server_pid) - server0
    other = (machine_busy() - busy0) - client - server_cpu
    return {"env_steps": steps * num_envs, "wall": wall, "client": client,
            "server": server_cpu, "other": max(other, 0.0)}  # fmt: skip


def _client_cpu(server_pid: int) -> float:
    """CPU seconds of this process and its children (AsyncVectorEnv's workers), less the
    server's (a child too). Clock ticks: windows of seconds keep the error near 1%."""
    return cpu_seconds(os.getpid()) - cpu_seconds(server_pid)


def _is_envpool(envs: Any) -> bool:
    return type(envs).__module__.startswith("envpool")


def run(
    env_id: str,
    kwargs: dict[str, Any],
    sizes: list[int],
    systems: list[str],
    seconds: float,
    rounds: int,
    frame_bytes: int | None,
    log: Callable[[str], None],
) -> list[Row]:
    """Per N, every system is made once, then measured in ``rounds`` interleaved windows
    of ``seconds / rounds`` (so a burst of other load hits all systems alike); a row sums
    its windows, and its ratio to SyncVectorEnv is the median of the per-round ratios."""
    rows: list[Row] = []
    with server() as (target, pid):
        for n in sizes:
            single = gymnasium.make(env_id, **kwargs)
            single.action_space.seed(0)
            actions = [
                np.array([single.action_space.sample() for _ in range(n)]) for _ in range(64)
            ]
            single.close()
            chosen = [
                system
                for system in systems
                if not (system == "async" and n > ASYNC_MAX)
                # EnvPool's Pong-v5 is another env (84x84 grey, stacked): not compared
                and not (system.endswith("envpool") and env_id == PONG)
            ]
            made: dict[str, Any] = {}
            per_frame: dict[str, float | None] = {}
            windows: dict[str, list[dict[str, float]]] = {system: [] for system in chosen}
            try:
                for system in chosen:
                    made[system] = make_system(system, env_id, kwargs, n, target)
                    per_frame[system] = prepare(made[system], actions, n, frame_bytes)
                for _ in range(rounds):
                    for system in chosen:
                        remote = system.startswith("remote")
                        windows[system].append(
                            window(
                                made[system], n, actions, seconds / rounds, pid if remote else None
                            )
                        )
            finally:
                for envs in made.values():
                    envs.close()
            for system in chosen:
                rows.append(_row(env_id, system, n, windows, per_frame[system]))
                log(json.dumps(asdict(rows[-1])))
    return rows


def _row(
    env_id: str,
    system: str,
    n: int,
    windows: dict[str, list[dict[str, float]]],
    per_frame: float | None,
) -> Row:
    mine = windows[system]
    total = {key: sum(w[key] for w in mine) for key in mine[0]}
    sync = windows.get("sync")
    ratio = None
    if sync:
        ratio = float(np.median([
            (w["env_steps"] / w["wall"]) / (s["env_steps"] / s["wall"])
            for w, s in zip(mine, sync, strict=True)
        ]))  # fmt: skip
    remote = system.startswith("remote")
    other = total["other"] / total["wall"]
    return Row(
        env=env_id,
        system=system,
        num_envs=n,
        env_steps_per_s=total["env_steps"] / total["wall"],
        ratio_to_sync=ratio,
        client_cpu_us_per_env_step=total["client"] / total["env_steps"] * 1e6,
        server_cpu_us_per_env_step=(total["server"] / total["env_steps"] * 1e6) if remote else None,
        other_cpu_cores=other,
        provisional=other > 0.5,
        seconds=total["wall"],
        client_bytes_per_frame=per_frame,
    )


def markdown(report: dict[str, Any]) -> str:
    """The tables of one run, for docs/benchmarks.md (ratios against SyncVectorEnv)."""
    rows = report["rows"]
    lines = [
        f"Run {report['started'][:16]}Z, `{report['command']}`, load average before "
        f"{', '.join(f'{x:.1f}' for x in report['loadavg_before'])}. *p* = provisional "
        "(other processes used more than 0.5 cores during the window).",
        "",
    ]
    for env in dict.fromkeys(r["env"] for r in rows):
        lines += [
            f"**{env}**",
            "",
            "| N | system | env-steps/s | ÷ SyncVectorEnv | client CPU µs/env-step | "
            "server CPU µs/env-step | CPU efficiency ÷ SyncVectorEnv | other CPU (cores) |"
            + (" client bytes per frame |" if env == PONG else ""),
            "|---:|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if env == PONG else ""),
        ]
        for n in dict.fromkeys(r["num_envs"] for r in rows if r["env"] == env):
            group = [r for r in rows if r["env"] == env and r["num_envs"] == n]
            sync_cpu = next(
                (r["client_cpu_us_per_env_step"] for r in group if r["system"] == "sync"), None
            )
            for r in group:
                times = "\N{MULTIPLICATION SIGN}"
                ratio = "—" if r["ratio_to_sync"] is None else f"{r['ratio_to_sync']:.2f}{times}"
                spent = r["client_cpu_us_per_env_step"] + (r["server_cpu_us_per_env_step"] or 0)
                cpu_ratio = f"{sync_cpu / spent:.2f}{times}" if sync_cpu else "—"
                server_cpu = r["server_cpu_us_per_env_step"]
                line = (
                    f"| {n} | {r['system']} | {r['env_steps_per_s']:,.0f}"
                    f"{' *p*' if r['provisional'] else ''} | {ratio} | "
                    f"{r['client_cpu_us_per_env_step']:.1f} | "
                    f"{'—' if server_cpu is None else f'{server_cpu:.1f}'} | {cpu_ratio} | "
                    f"{r['other_cpu_cores']:.2f} |"
                )
                if env == PONG:
                    per_frame = r["client_bytes_per_frame"]
                    line += f" {'—' if per_frame is None else f'{per_frame:.2f}'} |"
                lines.append(line)
        lines.append("")
    return "\n".join(lines)


def write_docs(report: dict[str, Any]) -> None:
    """Replace the section between the gym_vector markers of docs/benchmarks.md."""
    text = DOCS.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    DOCS.write_text(f"{head}{START}\n{markdown(report)}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, help="only rewrite the docs from a stored run")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--pong", type=int, nargs="*", default=[16])
    parser.add_argument("--seconds", type=float, default=6.0, help="per row, all rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    args = parser.parse_args(argv)
    if args.report:
        write_docs(json.loads(args.report.read_text()))
        return 0

    def log(line: str) -> None:
        print(line, flush=True)

    started = dt.datetime.now(dt.timezone.utc)
    load = os.getloadavg()
    rows = run("CartPole-v1", {}, args.sizes, args.systems, args.seconds, args.rounds, None, log)
    if args.pong:
        from openenv_grpc_envs.gymnasium.configuration import register_ale

        register_ale()
        frame = 210 * 160 * 3
        rows += run(PONG, PONG_KWARGS, args.pong, args.systems, args.seconds, args.rounds,
                    frame, log)  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"gym_vector-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    report = {
        "started": started.isoformat(),
        "command": " ".join(["python -m bench.gym_vector", *(argv or sys.argv[1:])]),
        "loadavg_before": load,
        "python": platform.python_version(),
        "rows": [asdict(r) for r in rows],
    }
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}", flush=True)
    if START in DOCS.read_text():
        write_docs(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
