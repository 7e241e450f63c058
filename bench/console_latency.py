"""What the web console adds to a step: the same steps straight over gRPC and through the
console's session WebSocket (JSON in, JSON with a PNG frame out), one at a time.

Starts an env server and `openenv-grpc console` as child processes on loopback.

    python -m bench.console_latency --steps 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

import aiohttp

from openenv_grpc import AsyncSession
from openenv_grpc.testing import ConsoleProcess, ServerProcess
from openenv_grpc_envs.echo import EchoAction
from openenv_grpc_envs.gymnasium.v1 import gymnasium_pb2 as gym

CASES: dict[str, dict[str, Any]] = {
    "echo": {
        "env": "echo",
        "env_vars": {},
        "action": {"message": "hello"},
        "message": EchoAction(message="hello"),
    },
    "pong": {
        "env": "gymnasium",
        "env_vars": {"GYM_ENV_ID": "ALE/Pong-v5"},
        "action": {"value": {"discrete": "0"}},
        "message": gym.GymnasiumAction(value=gym.Value(discrete=0)),
    },
}


def _summary(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "p50_ms": statistics.median(ordered) * 1e3,
        "p99_ms": ordered[int(len(ordered) * 0.99) - 1] * 1e3,
    }


async def _direct(target: str, action: Any, steps: int) -> tuple[list[float], int]:
    async with AsyncSession[Any, Any, Any, Any](target) as env:
        await env.reset(seed=1)
        times, size = [], 0
        for _ in range(steps):
            started = time.perf_counter()
            result = await env.step(action)
            times.append(time.perf_counter() - started)
            size = result.observation.ByteSize()
            if result.done:
                await env.reset()
        return times, size


async def _console(url: str, action: dict[str, Any], steps: int) -> tuple[list[float], int]:
    async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=0) as ws:
        for command in ({"op": "open"}, {"op": "reset", "seed": 1}):
            await ws.send_json(command)
            await ws.receive()
        times, size = [], 0
        for _ in range(steps):
            started = time.perf_counter()
            await ws.send_str(json.dumps({"op": "step", "action": action}))
            message = await ws.receive()
            times.append(time.perf_counter() - started)
            size = len(message.data)
            answer = json.loads(message.data)
            if answer.get("terminated") or answer.get("truncated"):
                await ws.send_json({"op": "reset"})
                await ws.receive()
        return times, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    for name in args.cases:
        case = CASES[name]
        server = ServerProcess(case["env"], extra_env=case["env_vars"])
        try:
            with ConsoleProcess(server.target) as console:
                direct, direct_bytes = asyncio.run(
                    _direct(server.target, case["message"], args.steps)
                )
                via, via_bytes = asyncio.run(
                    _console(console.ws_base + "api/session", case["action"], args.steps)
                )
        finally:
            server.stop()
        row = {
            "case": name,
            "steps": args.steps,
            "direct": _summary(direct),
            "console": _summary(via),
            "direct_observation_bytes": direct_bytes,
            "console_answer_bytes": via_bytes,
            "cpus": os.cpu_count(),
        }
        print(json.dumps(row))


if __name__ == "__main__":
    main()
