"""Closed-loop load against an echo server: step latency and throughput.

Starts `openenv-grpc serve echo` as a child process (unlimited capacity), then runs
client processes, each with its share of the sessions on its own channel, one step in
flight per session. Reports p50/p99 step round trip, steps/s, and the server's CPU time
per step (from the server process's own CPU counters).

    python -m bench.echo_load --sessions 1 64 --seconds 5 --clients 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any

_SERVING = re.compile(r"serving \S+ on (\S+):(\d+)")


def _server(env: str) -> tuple[subprocess.Popen[str], str]:
    if env == "bare":  # the floor: grpc.aio with no framework
        cmd = [sys.executable, "-m", "bench.bare_echo", "0"]
    else:
        cmd = [
            sys.executable,
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
        ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        match = _SERVING.search(line)
        if match:
            return proc, f"{match.group(1)}:{match.group(2)}"
    raise RuntimeError("server did not start")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _client(target: str, sessions: int, seconds: float, warmup: float) -> dict[str, Any]:
    import grpc

    from openenv_grpc_envs.echo import AsyncEchoEnv, EchoAction

    channel = grpc.aio.insecure_channel(target)
    envs = [AsyncEchoEnv(channel) for _ in range(sessions)]
    for env in envs:
        await env.open()
        await env.reset()
    action = EchoAction(message="x" * 64)
    latencies: list[float] = []
    start = time.perf_counter()
    measure_from = start + warmup
    stop_at = measure_from + seconds

    async def run(env: AsyncEchoEnv) -> None:
        clock = time.perf_counter
        while True:
            t0 = clock()
            await env.step(action)
            t1 = clock()
            if t1 >= stop_at:
                return
            if t0 >= measure_from:
                latencies.append(t1 - t0)

    cpu0 = time.process_time()
    await asyncio.gather(*(run(env) for env in envs))
    cpu = time.process_time() - cpu0
    for env in envs:
        await env.close()
    await channel.close()
    return {"latencies": latencies, "client_cpu": cpu}


def _client_proc(target: str, sessions: int, seconds: float, warmup: float, out: Any) -> None:
    out.put(asyncio.run(_client(target, sessions, seconds, warmup)))


def measure(target: str, pid: int, sessions: int, clients: int, seconds: float) -> dict[str, Any]:
    warmup = 1.0
    queue: Any = mp.Queue()
    shares = [sessions // clients + (i < sessions % clients) for i in range(clients)]
    procs = [
        mp.Process(target=_client_proc, args=(target, n, seconds, warmup, queue))
        for n in shares
        if n
    ]
    for p in procs:
        p.start()
    time.sleep(warmup + 0.2)  # sessions open and warm up before the server CPU window
    cpu0 = _cpu_seconds(pid)
    results = [queue.get() for _ in procs]
    cpu = _cpu_seconds(pid) - cpu0
    for p in procs:
        p.join()
    latencies = sorted(x for r in results for x in r["latencies"])
    steps = len(latencies)
    return {
        "sessions": sessions,
        "client_processes": len(procs),
        "steps_per_s": steps / seconds,
        "p50_us": statistics.median(latencies) * 1e6,
        "p99_us": latencies[int(0.99 * (steps - 1))] * 1e6,
        "server_cpu_us_per_step": cpu / steps * 1e6,
        "client_cpu_s": sum(r["client_cpu"] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--env", default="echo")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--clients", type=int, default=1, help="client processes")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    proc, target = _server(args.env)
    try:
        for n in args.sessions:
            row = measure(target, proc.pid, n, args.clients, args.seconds)
            print(
                json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}),
                flush=True,
            )
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
