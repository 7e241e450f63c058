"""Python calls per step in an OpenEnv server's process, counted (cProfile over the whole
server process): OpenEnv's ``GenericEnvClient`` (async), N sessions stepping OpenEnv's
template echo env -- bridged behind our ``--openenv-port``, or on OpenEnv 0.10's own
server in its best configuration (``--system openenv-on-loop``: ``bench.openenv_wire``'s
env on the event loop, deflate off). A count, not a time: it moves far less with the
machine's load than CPU per step does.

Two numbers: ``calls_per_step`` is one run's calls over its steps (start-up included);
``marginal_calls_per_step`` (with ``--marginal``) is what one more step costs, from a
second run with ``--marginal`` times the steps: start-up cancels out, so it compares
servers whose start-ups differ (OpenEnv's imports much more).

    python -m bench.door_calls --sessions 16 --steps 2000
    python -m bench.door_calls --steps 300 --marginal 4                # ours
    python -m bench.door_calls --steps 300 --marginal 4 --system openenv-on-loop
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

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
SYSTEMS = ("openenv-grpc", "openenv-on-loop")


async def _drive(url: str, sessions: int, steps: int) -> None:
    async def one() -> None:
        async with GenericEnvClient(base_url=url) as env:
            await env.reset()
            for _ in range(steps):
                await env.step({"message": "hi"})

    await asyncio.gather(*(one() for _ in range(sessions)))


def _server(
    system: str, out: str, source: str | None
) -> tuple[list[str], list[str], re.Pattern[str]]:
    """The server's command line (under cProfile), its PYTHONPATH and what its log says
    once it listens (the group holding the URL)."""
    profiled = [sys.executable, "-m", "cProfile", "-o", out, "-m"]
    if system == "openenv-grpc":
        return (
            [*profiled, "openenv_grpc", "serve",
             "--openenv=support.openenv_envs.echo:EchoEnvironment", "--host", "127.0.0.1",
             "--port", "0", "--openenv-port", "0", "--max-concurrent-envs", "0",
             "--log-level", "WARNING"],
            [str(TESTS), *([source] if source else [])],
            re.compile(r"protocol on (\S+)"),
        )  # fmt: skip
    return (
        [*profiled, "uvicorn", "bench.openenv_wire:on_loop_app", "--factory", "--host",
         "127.0.0.1", "--port", "0", "--ws-per-message-deflate", "false"],
        [str(ROOT), str(TESTS)],
        re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)"),
    )  # fmt: skip


def count(system: str, sessions: int, steps: int, source: str | None = None) -> int:
    """The calls the server process made while ``sessions`` sessions took ``steps`` each."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "server.prof")
        command, path, listening = _server(system, out, source)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")]),
        }
        server = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            cwd=folder,  # not this checkout's
        )  # fmt: skip
        assert server.stdout is not None
        url = next(m.group(1) for line in server.stdout if (m := listening.search(line)))
        asyncio.run(_drive(url, sessions, steps))
        # Our server drains then exits; uvicorn stops at SIGINT: each writes its profile.
        server.send_signal(signal.SIGTERM if system == "openenv-grpc" else signal.SIGINT)
        server.communicate(timeout=60)
        return int(pstats.Stats(out).total_calls)  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--system", choices=SYSTEMS, default=SYSTEMS[0])
    parser.add_argument(
        "--marginal", type=int, default=0, metavar="K",
        help="also run K times the steps and report the calls of one more step",
    )  # fmt: skip
    parser.add_argument("--source", help="a folder holding the openenv_grpc package to serve")
    args = parser.parse_args()
    calls = count(args.system, args.sessions, args.steps, args.source)
    steps = args.sessions * args.steps
    row = {"system": args.system, "sessions": args.sessions, "steps": steps,
           "calls_per_step": round(calls / steps, 1)}  # fmt: skip
    if args.marginal > 1:
        more = count(args.system, args.sessions, args.steps * args.marginal, args.source)
        row["marginal_calls_per_step"] = round((more - calls) / (steps * (args.marginal - 1)), 1)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
