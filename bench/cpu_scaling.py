"""CPU-heavy env (~1 ms of CPU per step): steps/s with 1 process, --workers 2, --isolated 2.

`.venv/bin/python -m bench.cpu_scaling` (16 sessions over an 8-channel AioChannelPool, 6 s each).
"""

import asyncio
import json
import time
from pathlib import Path

from openenv_grpc.client.channel import AioChannelPool
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.echo import AsyncEchoEnv, EchoAction


async def load(target, sessions=16, seconds=6.0):
    async with AioChannelPool(target, size=8) as pool:
        envs = [AsyncEchoEnv(pool.next()) for _ in range(sessions)]
        for e in envs:
            await e.open()
            await e.reset()
        a = EchoAction(message="x")
        count = 0
        end = time.perf_counter() + seconds

        async def run(e):
            nonlocal count
            while time.perf_counter() < end:
                await e.step(a)
                count += 1

        await asyncio.gather(*(run(e) for e in envs))
        for e in envs:
            await e.close()
    return count / seconds


for label, args in (
    ("1 process", []),
    ("--workers 2", ["--workers", "2"]),
    ("--isolated 2", ["--isolated", "2"]),
):
    s = ServerProcess(
        "bench.envs:CpuEnvironment",
        ["--max-concurrent-envs", "0", "--log-level", "WARNING", *args],
        pythonpath=[str(Path(__file__).resolve().parent.parent)],
    )
    try:
        rate = asyncio.run(load(s.target))
    finally:
        s.stop()
    print(json.dumps({"server": label, "steps_per_s": round(rate)}), flush=True)
