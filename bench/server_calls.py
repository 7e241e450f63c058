"""Python calls per Session step in the server's process over real gRPC, counted
(cProfile over the whole server process): the bare grpc.aio echo floor
(``bench.bare_echo``) against ``openenv-grpc serve echo``, the same client
(``AsyncEchoEnv``, N sessions on one channel). A count, not a time: it moves far less
with the machine's load than CPU per step does, so the two servers compare as a ratio on
a busy machine (``bench.echo_load`` gives the CPU they cost).

``marginal_calls_per_step`` is what one more step costs: two runs, the second with four
times the steps, so start-up and shutdown cancel out.

    python -m bench.server_calls                       # both, 16 sessions
    python -m bench.server_calls --env echo --sessions 64 --steps 200
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

_SERVING = re.compile(r"serving \S+ on (\S+):(\d+)")


async def _drive(target: str, sessions: int, steps: int) -> None:
    import grpc

    from openenv_grpc_envs.echo import AsyncEchoEnv, EchoAction

    channel = grpc.aio.insecure_channel(target)
    envs = [AsyncEchoEnv(channel) for _ in range(sessions)]
    for env in envs:
        await env.open()
        await env.reset()
    action = EchoAction(message="x" * 64)

    async def run(env: AsyncEchoEnv) -> None:
        for _ in range(steps):
            await env.step(action)

    await asyncio.gather(*(run(env) for env in envs))
    for env in envs:
        await env.close()
    await channel.close()


def count(env: str, sessions: int, steps: int) -> int:
    """The calls the server process made while ``sessions`` sessions took ``steps`` each."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "server.prof")
        served = (
            ["bench.bare_echo", "0"]
            if env == "bare"
            else ["openenv_grpc", "serve", env, "--port", "0", "--max-concurrent-envs", "0",
                  "--log-level", "WARNING"]
        )  # fmt: skip
        server = subprocess.Popen(
            [sys.executable, "-m", "cProfile", "-o", out, "-m", *served],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert server.stdout is not None
        target = next(
            f"{m.group(1)}:{m.group(2)}" for line in server.stdout if (m := _SERVING.search(line))
        )
        asyncio.run(_drive(target, sessions, steps))
        # The bare floor stops at SIGINT, our server drains at SIGTERM: each writes its profile.
        server.send_signal(signal.SIGINT if env == "bare" else signal.SIGTERM)
        server.communicate(timeout=60)
        return int(pstats.Stats(out).total_calls)  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", nargs="+", default=["bare", "echo"])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    rows = {}
    for env in args.env:
        few = count(env, args.sessions, args.steps)
        more = count(env, args.sessions, args.steps * 4)
        rows[env] = (more - few) / (args.sessions * args.steps * 3)
        print(json.dumps({"env": env, "sessions": args.sessions,
                          "marginal_calls_per_step": round(rows[env], 1)}))  # fmt: skip
    if "bare" in rows and len(rows) > 1:
        for env, calls in rows.items():
            if env != "bare":
                print(json.dumps({"env": env, "calls_vs_bare": round(calls / rows["bare"], 2)}))


if __name__ == "__main__":
    main()
