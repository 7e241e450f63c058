"""What Envoy costs per step: N sessions stepping echo in a closed loop, straight to one
server and through Envoy (deploy/envoy/envoy.template.yaml) to the same server, alternated.

    .venv/bin/python deploy/envoy/bench_envoy.py --sessions 64 --seconds 5 --rounds 3

Prints steps/s, median step latency, and the CPU time per step of the server and of the
Envoy process (read from /proc, so it holds even on a busy machine). Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import grpc

# Run as a script: test_envoy (tests/) and what it imports (bench/) from the repository.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from test_envoy import Envoy, wait_for

from openenv_grpc.providers import LocalProcessProvider
from openenv_grpc_envs.echo import AsyncEchoEnv, EchoAction


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load(target: str, sessions: int, seconds: float) -> tuple[int, float]:
    """(steps done, median step latency in µs)."""
    async with grpc.aio.insecure_channel(target) as channel:
        envs = [AsyncEchoEnv(channel) for _ in range(sessions)]
        await asyncio.gather(*(env.open() for env in envs))
        await asyncio.gather(*(env.reset(seed=1) for env in envs))
        latencies: list[float] = []
        action = EchoAction(message="x" * 16)
        stop = time.perf_counter() + seconds

        async def worker(env: AsyncEchoEnv) -> None:
            while time.perf_counter() < stop:
                start = time.perf_counter()
                await env.step(action)
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(worker(env) for env in envs))
        await asyncio.gather(*(env.close() for env in envs))
    latencies.sort()
    return len(latencies), latencies[len(latencies) // 2] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with LocalProcessProvider("echo") as server, tempfile.TemporaryDirectory() as workdir:
        envoy = Envoy([server.port], Path(workdir))
        try:
            wait_for(lambda: list(envoy.healthy().values()) == [True], 15, "a healthy host")
            for _ in range(args.rounds):
                for name, target in (("direct", server.target), ("envoy", envoy.target)):
                    assert server.pid is not None
                    before = cpu_seconds(server.pid), cpu_seconds(envoy.proc.pid)
                    steps, p50 = asyncio.run(load(target, args.sessions, args.seconds))
                    after = cpu_seconds(server.pid), cpu_seconds(envoy.proc.pid)
                    server_us, envoy_us = (
                        (a - b) * 1e6 / steps for a, b in zip(after, before, strict=True)
                    )
                    print(
                        f"{name:6s} sessions={args.sessions} steps/s={steps / args.seconds:7.0f}"
                        f" p50={p50:6.0f}us server_cpu={server_us:5.1f}us/step"
                        f" envoy_cpu={envoy_us:5.1f}us/step",
                        flush=True,
                    )
        finally:
            envoy.stop()


if __name__ == "__main__":
    main()
