"""How long a bridged OpenEnv server takes to serve, with OpenEnv's web UI deferred (what
``serve --openenv`` does) and imported eagerly (``ENABLE_WEB_INTERFACE=true``), in
alternating rounds of one run::

    python -m bench.openenv_ready [--rounds 3]

For each: the time to the serving line, and a first session's open and reset (with
``--isolated 1`` that is when the env process makes the env).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

from openenv_grpc.integrations.openenv import described_session  # noqa: E402
from openenv_grpc.testing import ServerProcess  # noqa: E402

ECHO = "support.openenv_envs.echo:EchoEnvironment"


def _one(eager: bool, args: list[str]) -> tuple[float, float]:
    extra = {"ENABLE_WEB_INTERFACE": "true"} if eager else {}
    started = time.perf_counter()
    server = ServerProcess(f"--openenv={ECHO}", args, extra, pythonpath=[TESTS])
    ready = time.perf_counter() - started
    try:
        env_class = described_session(server.target)
        started = time.perf_counter()
        with env_class(server.target) as env:
            env.reset()
        return ready, time.perf_counter() - started
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(rounds):
        for eager in (True, False):
            for args in ([], ["--isolated", "1"]):
                key = ("eager" if eager else "deferred", "--isolated 1" if args else "in-process")
                times.setdefault(key, []).append(_one(eager, args))
    for (ui, where), got in times.items():
        ready = statistics.median(one[0] for one in got)
        first = statistics.median(one[1] for one in got)
        print(f"{where:13} web UI {ui:8}: ready {ready:.2f} s, first reset {first:.2f} s")


if __name__ == "__main__":
    main()
