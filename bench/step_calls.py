"""Python calls per Session step, counted (cProfile), client and server together: an echo
session on the core's in-process wire (``LocalStub``), no sockets. A count, not a time:
it does not move with the machine's load.

    python -m bench.step_calls --steps 2000
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats

from bench.local_wire import LocalStub
from openenv_grpc.server import EnvServer, ServerConfig
from openenv_grpc_envs.echo import AsyncEchoEnv, EchoAction, EchoEnvironment


async def _count(steps: int) -> float:
    server = EnvServer(EchoEnvironment, ServerConfig(port=0, host="127.0.0.1"))
    await server.start()
    try:
        env = AsyncEchoEnv(LocalStub(server.servicer.Session))  # type: ignore[arg-type]
        await env.open()
        await env.reset()
        action = EchoAction(message="x")
        for _ in range(100):  # lazy imports, first-call work
            await env.step(action)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(steps):
            await env.step(action)
        profile.disable()
        await env.close()
    finally:
        await server.drain(0)
    return float(pstats.Stats(profile).total_calls) / steps  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    print(json.dumps({"steps": args.steps, "calls_per_step": asyncio.run(_count(args.steps))}))


if __name__ == "__main__":
    main()
