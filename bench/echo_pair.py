"""Server CPU per step of a gRPC Session against bare grpc.aio, the servers measured at
the same time (``bench.paired``): ``bench.bare_echo`` and ``openenv-grpc serve echo``
each pinned to CPU 0, each with its own client process (``--sessions`` ``AsyncEchoEnv``
sessions on one channel, one step in flight each, a 64-byte message) pinned to CPU 1.
``bench.echo_load`` runs them one after another, which this VM's ±20 % drift cannot
compare; this is the ratio issue 38's "within 1.10x of bare grpc.aio" is measured by.

    python -m bench.echo_pair --sessions 64            # bare vs ours
    python -m bench.echo_pair --sessions 1 --source /tmp/old   # ... and /tmp/old's tree

Each window prints one JSON line: every server's µs of CPU per step (starved: compare
the ratios), steps, and its ratio to the first server (bare grpc.aio).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from bench.paired import COUNTER_LOOP, Server, measure_together, options

ROOT = Path(__file__).resolve().parent.parent
_SERVING = re.compile(r"serving \S+ on (\S+:\d+)")

_CLIENT = (
    """
import asyncio, os, sys
import grpc
from openenv_grpc_envs.echo import AsyncEchoEnv, EchoAction
target, sessions, counter = sys.argv[1], int(sys.argv[2]), sys.argv[3]
steps = [0]
action = EchoAction(message="x" * 64)
async def one(channel):
    env = AsyncEchoEnv(channel)
    await env.open()
    await env.reset()
    while True:
        await env.step(action)
        steps[0] += 1
"""
    + COUNTER_LOOP
    + """
async def main():
    channel = grpc.aio.insecure_channel(target)
    await asyncio.gather(report(), *(one(channel) for _ in range(sessions)))
asyncio.run(main())
"""
)


def _ours(name: str, source: str | None) -> Server:
    command = [sys.executable, "-m", "openenv_grpc", "serve", "echo", "--host", "127.0.0.1",
               "--port", "0", "--max-concurrent-envs", "0", "--log-level", "WARNING"]  # fmt: skip
    path = [*([source] if source else []), str(ROOT)]
    return Server(name, command, path, _SERVING, _CLIENT)


def main() -> None:
    args = options(__doc__.split("\n\n")[0], sessions=64)
    bare = [sys.executable, "-m", "bench.bare_echo", "0"]
    servers = [Server("bare", bare, [str(ROOT)], _SERVING, _CLIENT), _ours("openenv-grpc", None)]
    servers += [_ours(f"openenv-grpc:{source}", source) for source in args.source]
    measure_together(servers, args.sessions, args.windows, args.seconds)


if __name__ == "__main__":
    main()
