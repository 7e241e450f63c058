"""Servers measured at the same time: every server pinned to CPU 0, each with its own
client process pinned to CPU 1. On a VM whose speed moves by ±20 % from one run to the
next, servers run one after another compare only as well as that; run together, they
share the same moment's machine, so their ratio holds to a few percent across windows.

The servers share a core, so each is measured starved (it answers what it can): the
ratio is the comparison, not the µs. Used by ``bench.door_pair`` and ``bench.echo_pair``.
A client is Python code run with ``sys.argv[1:] == [address, sessions, counter]``: it
steps forever and keeps the file ``counter`` holding its steps so far (see
:data:`COUNTER_LOOP`). Needs ``taskset`` and two CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["COUNTER_LOOP", "Server", "measure_together", "options"]

#: Client code's reporter: ``asyncio.gather(report(), ...)`` with a list ``steps``.
COUNTER_LOOP = """
async def report():
    while True:  # written whole, then moved: a reader never sees half a number
        with open(counter + ".tmp", "w") as out:
            out.write(str(steps[0]))
        os.replace(counter + ".tmp", counter)
        await asyncio.sleep(0.05)
"""


def options(description: str, sessions: int) -> argparse.Namespace:
    """The command line both benches take: ``--windows``, ``--seconds``, ``--sessions``
    (``sessions`` by default) and ``--source DIR`` (repeatable)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=8.0, help="one window")
    parser.add_argument("--sessions", type=int, default=sessions, help="per server")
    parser.add_argument(
        "--source", action="append", default=[], metavar="DIR",
        help="also ours as DIR's openenv_grpc package (repeatable)",
    )  # fmt: skip
    return parser.parse_args()


@dataclass
class Server:
    """A server to measure: its command line, PYTHONPATH, the line it prints once it
    listens (group 1: the address its client is given) and its client's code."""

    name: str
    command: list[str]
    path: list[str]
    listening: re.Pattern[str]
    client: str
    _procs: list[subprocess.Popen[str]] = field(default_factory=list)
    _counter: str = ""

    def start(self, sessions: int, folder: str) -> None:
        environ = {**os.environ, "PYTHONPATH": os.pathsep.join(self.path)}
        server = subprocess.Popen(
            ["taskset", "-c", "0", *self.command], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env=environ, cwd=folder,
            start_new_session=True,
        )  # fmt: skip
        self._procs.append(server)
        assert server.stdout is not None
        address = next(m.group(1) for line in server.stdout if (m := self.listening.search(line)))
        # Drained, so that a server's log never blocks it.
        threading.Thread(target=server.stdout.read, daemon=True).start()
        self._counter = os.path.join(folder, f"steps-{server.pid}")
        client = subprocess.Popen(
            ["taskset", "-c", "1", sys.executable, "-c", self.client, address, str(sessions),
             self._counter],
            env=environ, text=True, start_new_session=True,
        )  # fmt: skip
        self._procs.append(client)

    def stepping(self) -> bool:
        return os.path.exists(self._counter)

    def cpu(self) -> float:
        fields = Path(f"/proc/{self._procs[0].pid}/stat").read_text().split()
        return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")

    def steps(self) -> int:
        return int(Path(self._counter).read_text())

    def stop(self) -> None:
        for proc in reversed(self._procs):  # the client first
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def measure_together(servers: list[Server], sessions: int, windows: int, seconds: float) -> None:
    """Start every server and its client, then print one JSON line a window: each
    server's µs of CPU per step, steps, and its ratio to the first server's."""
    with tempfile.TemporaryDirectory() as folder:
        try:
            for server in servers:
                server.start(sessions, folder)
            deadline = time.monotonic() + 120
            while not all(server.stepping() for server in servers):
                if time.monotonic() > deadline:
                    raise SystemExit("a client did not start stepping within 120 s")
                time.sleep(0.2)
            time.sleep(3)  # past the opens and the placement's probation
            for window in range(windows):
                before = [(server.cpu(), server.steps()) for server in servers]
                time.sleep(seconds)
                after = [(server.cpu(), server.steps()) for server in servers]
                row: dict[str, object] = {"window": window + 1, "sessions": sessions}
                first = 0.0
                for server, (cpu0, steps0), (cpu1, steps1) in zip(
                    servers, before, after, strict=True
                ):
                    steps = max(1, steps1 - steps0)
                    per_step = (cpu1 - cpu0) / steps * 1e6
                    first = first or per_step
                    row[server.name] = {"us_per_step": round(per_step, 1), "steps": steps,
                                        "ratio": round(per_step / first, 3)}  # fmt: skip
                print(json.dumps(row), flush=True)
        finally:
            for server in servers:
                server.stop()
