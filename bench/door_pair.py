"""Server CPU per step of OpenEnv's client on two or more door servers measured at the
same time: every server pinned to CPU 0, each with its own client process (``--sessions``
``GenericEnvClient`` sessions stepping OpenEnv's template echo env) pinned to CPU 1. On a
VM whose speed moves by ±20 % from one run to the next, servers run one after another
(``bench.openenv_wire``) compare only as well as that; run together, they share the same
moment's machine, so their ratio holds to a few percent across windows.

The servers share a core, so each is measured starved (``bench.paired``): the ratio is
the comparison, not the µs (``bench.openenv_wire`` gives those).

    python -m bench.door_pair                          # OpenEnv on the loop vs ours
    python -m bench.door_pair --source /tmp/old        # ... and ours as /tmp/old has it
    python -m bench.door_pair --windows 5 --seconds 8

Each window prints one JSON line: every server's µs of CPU per step, steps, and its ratio
to the first server (OpenEnv's best configuration, ``--system openenv-on-loop`` of
``bench.door_calls``). Needs ``taskset`` and two CPUs.
"""

from __future__ import annotations

import os
import sys

from bench.door_calls import _server
from bench.paired import COUNTER_LOOP, Server, measure_together, options

_CLIENT = (
    """
import asyncio, os, sys
from openenv.core.generic_client import GenericEnvClient
url, sessions, counter = sys.argv[1], int(sys.argv[2]), sys.argv[3]
steps = [0]
async def one():
    async with GenericEnvClient(base_url=url) as env:
        await env.reset()
        while True:
            await env.step({"message": "hi"})
            steps[0] += 1
"""
    + COUNTER_LOOP
    + """
async def main():
    await asyncio.gather(report(), *(one() for _ in range(sessions)))
asyncio.run(main())
"""
)


def _door(name: str, system: str, source: str | None) -> Server:
    command, path, listening = _server(system, os.devnull, source)
    command = [sys.executable, *command[command.index("-m", 3) :]]  # no cProfile
    return Server(name, command, path, listening, _CLIENT)


def main() -> None:
    args = options(__doc__.split("\n\n")[0], sessions=32)
    servers = [_door("openenv-on-loop", "openenv-on-loop", None),
               _door("openenv-grpc", "openenv-grpc", None)]  # fmt: skip
    servers += [_door(f"openenv-grpc:{source}", "openenv-grpc", source) for source in args.source]
    measure_together(servers, args.sessions, args.windows, args.seconds)


if __name__ == "__main__":
    main()
