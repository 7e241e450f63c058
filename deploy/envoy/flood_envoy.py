"""What a rapid-reset flood costs a server behind Envoy (deploy/envoy/envoy.template.yaml),
and the same flood straight at a server, for comparison.

    .venv/bin/python deploy/envoy/flood_envoy.py --seconds 60 [--direct]

Starts ``openenv-grpc serve echo`` and Envoy in front of it, floods Envoy's listener from a
child process (``bench.h2_attacks rapid-reset``, 4 connections) while 8 honest sessions
step through Envoy, and prints one JSON line: the server's RSS (baseline, peak, every 5 s),
what the attacker sent, how many streams Envoy forwarded to the server, how many flooding
connections it closed for premature resets, and Envoy's own RSS growth. ``--direct`` floods
a server without Envoy instead. Not a test (``tests/test_envoy.py`` runs 12 s of it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Run as a script: test_envoy (tests/) and what it imports (bench/) from the repository.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from test_envoy import Envoy, wait_for

from bench.hostile import rapid_reset_run, rss_mib
from openenv_grpc.testing import ServerProcess


@dataclass
class _Front:
    """What bench.hostile's flood measures: the server's process, the address it floods."""

    proc: subprocess.Popen[str]
    target: str


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--direct", action="store_true", help="no Envoy: flood the server")
    args = parser.parse_args()
    server = ServerProcess("echo")
    envoy: Envoy | None = None
    try:
        if args.direct:
            result = rapid_reset_run(server, args.seconds, connections=4, settle=5.0)
        else:
            envoy = Envoy([server.port], Path(tempfile.mkdtemp()))
            wait_for(lambda: list(envoy.healthy().values()) == [True], 15, "a healthy host")
            before = rss_mib(envoy.proc.pid)
            front = _Front(server.proc, envoy.target)
            result = rapid_reset_run(front, args.seconds, connections=4, settle=5.0)
            closed = envoy.get("/stats?filter=^http.openenv_grpc.downstream_rq_too_many_premature")
            result["envoy"] = {
                "streams_forwarded": envoy.stat("upstream_rq_total"),
                "connections_closed_for_premature_resets": int(closed.split(":")[1]),
                "rss_growth_mib": round(rss_mib(envoy.proc.pid) - before, 1),
            }
    finally:
        if envoy is not None:
            envoy.stop()
        server.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
