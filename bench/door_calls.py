"""Python calls per step in the OpenEnv door's server, counted (cProfile over the whole
server process, start-up included): OpenEnv's ``GenericEnvClient`` (async), N sessions
stepping OpenEnv's template echo env bridged behind ``--openenv-port``. A count, not a
time: it moves far less with the machine's load than CPU per step does.

    python -m bench.door_calls --sessions 16 --steps 2000
    python -m bench.door_calls --source DIR   # openenv_grpc as DIR has it (git archive)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from openenv.core.generic_client import GenericEnvClient

TESTS = Path(__file__).resolve().parent.parent / "tests"


async def _drive(url: str, sessions: int, steps: int) -> None:
    async def one() -> None:
        async with GenericEnvClient(base_url=url) as env:
            await env.reset()
            for _ in range(steps):
                await env.step({"message": "hi"})

    await asyncio.gather(*(one() for _ in range(sessions)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--source", help="a folder holding the openenv_grpc package to serve")
    args = parser.parse_args()
    path = [str(TESTS), *([args.source] if args.source else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "server.prof")
        server = subprocess.Popen(
            [sys.executable, "-m", "cProfile", "-o", out, "-m", "openenv_grpc", "serve",
             "--openenv=support.openenv_envs.echo:EchoEnvironment", "--host", "127.0.0.1",
             "--port", "0", "--openenv-port", "0", "--max-concurrent-envs", "0",
             "--log-level", "WARNING"],
            stdout=subprocess.PIPE, text=True, env=env, cwd=folder,  # not this checkout's
        )  # fmt: skip
        assert server.stdout is not None
        url = next(
            m.group(1) for line in server.stdout if (m := re.search(r"protocol on (\S+)", line))
        )
        asyncio.run(_drive(url, args.sessions, args.steps))
        server.send_signal(signal.SIGTERM)  # a drain, then a normal exit: the profile is written
        server.wait(60)
        stats = pstats.Stats(out)
    steps = args.sessions * args.steps
    calls = stats.total_calls  # type: ignore[attr-defined]
    print(json.dumps({"sessions": args.sessions, "steps": steps,
                      "calls_per_step": round(calls / steps, 1)}))  # fmt: skip


if __name__ == "__main__":
    main()
