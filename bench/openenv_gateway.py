"""One OpenEnv ``GenericEnvClient`` stepping the OpenEnv template echo env, sequentially:
OpenEnv's own server (``create_app`` under uvicorn) against ``openenv-grpc serve
--openenv ... --openenv-port 0`` (the gateway: WebSocket -> gRPC session -> env).

    python -m bench.openenv_gateway            # 2,000 steps each after 100 warm-up steps

Numbers are measured, never asserted.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

from openenv.core.generic_client import GenericEnvClient

from openenv_grpc.testing import ServerProcess

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))
from test_openenv_bridge import openenv_server  # noqa: E402  (OpenEnv's own uvicorn)


def rate(url: str, steps: int = 2000) -> float:
    with GenericEnvClient(base_url=url).sync() as env:
        env.reset()
        for _ in range(100):
            env.step({"message": "hi"})
        started = time.perf_counter()
        for _ in range(steps):
            env.step({"message": "hi"})
        return steps / (time.perf_counter() - started)


def main() -> int:
    with openenv_server("echo_app") as theirs:
        print(f"OpenEnv create_app: {rate(theirs):.0f} steps/s", flush=True)
    server = ServerProcess(
        "--openenv=support.openenv_envs.echo:EchoEnvironment",
        ["--openenv-port", "0"],
        pythonpath=[TESTS],
    )
    try:
        for _ in range(1200):
            found = [re.search(r"(http://\S+)", line) for line in server.stdout_lines]
            urls = [m.group(1) for m in found if m and "OpenEnv protocol" in m.string]
            if urls:
                break
            time.sleep(0.05)
        print(f"openenv-grpc gateway: {rate(urls[0]):.0f} steps/s", flush=True)
    finally:
        server.stop()
    print(f"load average {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
