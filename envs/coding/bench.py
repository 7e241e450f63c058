"""Closed-loop steps/s of a coding server: ``python -m openenv_grpc_envs.coding.bench TARGET``.

N sessions (asyncio, one channel) each reset once, then step ``print(sum(range(100)))``
as fast as answers come back for the given number of seconds. Prints one line: sessions,
steps, steps/s and the median and 90th percentile of a step's round trip. A benchmark,
not a test: run it on a quiet machine, several times.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import grpc

from openenv_grpc_envs.coding import AsyncCodingEnv, CodingAction

CODE = "print(sum(range(100)))"


async def _session(channel: grpc.aio.Channel, until: float, times: list[float]) -> None:
    async with AsyncCodingEnv(channel) as env:
        await env.reset()
        while time.monotonic() < until:
            started = time.perf_counter()
            result = await env.step(CodingAction(code=CODE))
            times.append(time.perf_counter() - started)
            if result.observation.stdout != "4950\n":
                raise RuntimeError(f"unexpected observation: {result.observation}")


async def _bench(target: str, sessions: int, seconds: float) -> str:
    times: list[float] = []
    async with grpc.aio.insecure_channel(target) as channel:
        until = time.monotonic() + seconds
        await asyncio.gather(*(_session(channel, until, times) for _ in range(sessions)))
    ordered = sorted(times)
    return (
        f"sessions={sessions} steps={len(times)} steps/s={len(times) / seconds:.1f} "
        f"p50={statistics.median(ordered) * 1000:.1f}ms "
        f"p90={ordered[int(len(ordered) * 0.9)] * 1000:.1f}ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("target", help="host:port of a coding server")
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    print(asyncio.run(_bench(args.target, args.sessions, args.seconds)))


if __name__ == "__main__":
    main()
