"""Server CPU per step of OpenEnv's client on two or more door servers measured at the
same time: every server pinned to CPU 0, each with its own client process (``--sessions``
``GenericEnvClient`` sessions stepping OpenEnv's template echo env) pinned to CPU 1. On a
VM whose speed moves by ±20 % from one run to the next, servers run one after another
(``bench.openenv_wire``) compare only as well as that; run together, they share the same
moment's machine, so their ratio holds to a few percent across windows.

The servers share a core, so each is measured starved (it answers what it can): the
ratio is the comparison, not the µs (``bench.openenv_wire`` gives those).

    python -m bench.door_pair                          # OpenEnv on the loop vs ours
    python -m bench.door_pair --source /tmp/old        # ... and ours as /tmp/old has it
    python -m bench.door_pair --windows 5 --seconds 8

Each window prints one JSON line: every server's µs of CPU per step, steps, and its ratio
to the first server (OpenEnv's best configuration, ``--system openenv-on-loop`` of
``bench.door_calls``). Needs ``taskset`` and two CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.door_calls import _server

_CLIENT = """
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
async def report():
    while True:  # written whole, then moved: a reader never sees half a number
        with open(counter + ".tmp", "w") as out:
            out.write(str(steps[0]))
        os.replace(counter + ".tmp", counter)
        await asyncio.sleep(0.05)
async def main():
    await asyncio.gather(report(), *(one() for _ in range(sessions)))
asyncio.run(main())
"""


class _Served:
    """One server on CPU 0 and its client on CPU 1."""

    def __init__(self, name: str, system: str, source: str | None, sessions: int, folder: str):
        self.name = name
        command, path, listening = _server(system, os.devnull, source)
        command = [sys.executable, *command[command.index("-m", 3) :]]  # no cProfile
        environ = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        self.server = subprocess.Popen(
            ["taskset", "-c", "0", *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=environ, cwd=folder, start_new_session=True,
        )  # fmt: skip
        assert self.server.stdout is not None
        url = next(m.group(1) for line in self.server.stdout if (m := listening.search(line)))
        # Drained, so that a server's log never blocks it.
        threading.Thread(target=self.server.stdout.read, daemon=True).start()
        self.counter = os.path.join(folder, f"steps-{self.server.pid}")
        self.client = subprocess.Popen(
            ["taskset", "-c", "1", sys.executable, "-c", _CLIENT, url, str(sessions),
             self.counter],
            start_new_session=True,
        )  # fmt: skip

    def cpu(self) -> float:
        fields = Path(f"/proc/{self.server.pid}/stat").read_text().split()
        return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")

    def steps(self) -> int:
        return int(Path(self.counter).read_text())

    def stop(self) -> None:
        for proc in (self.client, self.server):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=8.0, help="one window")
    parser.add_argument("--sessions", type=int, default=32, help="per server")
    parser.add_argument(
        "--source", action="append", default=[], metavar="DIR",
        help="also ours as DIR's openenv_grpc package (repeatable)",
    )  # fmt: skip
    args = parser.parse_args()
    wanted = [("openenv-on-loop", "openenv-on-loop", None), ("openenv-grpc", "openenv-grpc", None)]
    wanted += [(f"openenv-grpc:{source}", "openenv-grpc", source) for source in args.source]
    with tempfile.TemporaryDirectory() as folder:
        served: list[_Served] = []
        try:
            for name, system, source in wanted:
                served.append(_Served(name, system, source, args.sessions, folder))
            deadline = time.monotonic() + 120
            while not all(os.path.exists(one.counter) for one in served):
                if time.monotonic() > deadline:
                    raise SystemExit("a client did not start stepping within 120 s")
                time.sleep(0.2)
            time.sleep(3)  # past the opens and the placement's probation
            for window in range(args.windows):
                before = [(one.cpu(), one.steps()) for one in served]
                time.sleep(args.seconds)
                after = [(one.cpu(), one.steps()) for one in served]
                row: dict[str, object] = {"window": window + 1}
                first = 0.0
                for one, (cpu0, steps0), (cpu1, steps1) in zip(served, before, after, strict=True):
                    steps = max(1, steps1 - steps0)
                    per_step = (cpu1 - cpu0) / steps * 1e6
                    first = first or per_step
                    row[one.name] = {"us_per_step": round(per_step, 1), "steps": steps,
                                     "ratio": round(per_step / first, 3)}  # fmt: skip
                print(json.dumps(row), flush=True)
        finally:
            for one in served:
                one.stop()


if __name__ == "__main__":
    main()
