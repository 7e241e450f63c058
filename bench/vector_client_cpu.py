"""Client CPU per vector message pair, by thread, against a raw gRPC stream's: where the
blocking client's cost goes (issue 22 item 3).

    python -m bench.vector_client_cpu                  # every client, 4 s each, N = 64
    python -m bench.vector_client_cpu --clients raw-sync library --seconds 6

Each client runs in a child process as a closed loop over one vector stream (one request
in flight) against a child ``openenv-grpc serve`` on loopback; the child reads its
threads' CPU from ``/proc/self/task/*/stat`` around the loop and reports CPU µs per
message pair, in total and per thread (``python``: the main thread and gRPC's Python
threads, in creation order; ``event_engine``: gRPC core's). Clients:

* ``raw-sync``: gRPC's blocking stream with serialized bytes in and out, no library (the
  floor of a blocking client: gRPC's own request-consumer and channel-spin threads);
* ``raw-aio``: ``grpc.aio``, driven with ``run_until_complete`` in the caller's thread;
* ``library``: ``VectorSession.step_batch`` of the echo bench env's native batch;
* ``gym``: ``RemoteGymnasiumVectorEnv.step`` of CartPole-v1 (EnvPool backend).

The first three step the echo bench env (``openenv_grpc_envs.echo.batch``), so they send
and receive the same bytes. Numbers are measured, never asserted; interleave rounds
(``--rounds``) on a loaded machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.pipelined import ECHO_NATIVE, serve

CLIENTS = ("raw-sync", "raw-aio", "library", "gym")
METHOD = "/openenv_grpc.v1.EnvService/VectorSession"


def _threads() -> dict[str, tuple[str, float]]:
    """CPU seconds of each thread of this process: tid -> (name, seconds)."""
    out: dict[str, tuple[str, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as comm:
                name = comm.read().strip()
        except OSError:
            continue
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _raw_request(request_id: int, n: int, reset: bool) -> bytes:
    from openenv_grpc.v1 import session_pb2 as pb
    from openenv_grpc_envs.echo.batch import EchoBatchAction

    request = pb.VectorSessionRequest(request_id=request_id)
    if reset:
        request.reset.batch_observation = True
    else:
        request.step.batch_action.Pack(EchoBatchAction(messages=["x"] * n))
    return request.SerializeToString()


def _client(kind: str, target: str, n: int) -> Callable[[], Any]:
    """One message pair of client ``kind`` (the stream opened and reset)."""
    from openenv_grpc.metadata import NUM_ENVS_KEY

    metadata = ((NUM_ENVS_KEY, str(n)),)
    if kind == "raw-sync":
        import queue

        import grpc

        requests: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        call = grpc.insecure_channel(target).stream_stream(METHOD)(
            iter(requests.get, b""), metadata=metadata
        )
        count = [1]

        def sync_pair(reset: bool = False) -> Any:
            requests.put(_raw_request(count[0], n, reset))
            count[0] += 1
            return next(call)

        sync_pair(True)
        return sync_pair
    if kind == "raw-aio":
        import grpc

        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)  # the channel binds to the loop it is made on
        stream = grpc.aio.insecure_channel(target).stream_stream(METHOD)(metadata=metadata)
        count = [1]

        async def pair(reset: bool) -> Any:
            await stream.write(_raw_request(count[0], n, reset))
            count[0] += 1
            return await stream.read()

        loop.run_until_complete(pair(True))
        return lambda: loop.run_until_complete(pair(False))
    if kind == "library":
        from openenv_grpc_envs.echo.batch import EchoBatchAction, EchoBatchVectorEnv

        envs = EchoBatchVectorEnv(target, n).__enter__()
        envs.reset(batch=True)
        action = EchoBatchAction(messages=["x"] * n)
        return lambda: envs.step_batch(action)
    import numpy as np

    from openenv_grpc_envs.gymnasium.adapters import RemoteGymnasiumVectorEnv

    gym = RemoteGymnasiumVectorEnv(target, n, "CartPole-v1", backend="envpool")
    gym.reset(seed=0)
    actions = [np.random.default_rng(k).integers(0, 2, n) for k in range(64)]
    step = [0]

    def gym_pair() -> Any:
        step[0] += 1
        return gym.step(actions[step[0] % 64])

    return gym_pair


def child(kind: str, target: str, n: int, seconds: float) -> None:
    """Run one client's loop here and print its row (JSON)."""
    pair = _client(kind, target, n)
    for _ in range(200):  # warm up
        pair()
    before, cpu0, wall0, count = _threads(), time.process_time(), time.monotonic(), 0
    while time.monotonic() < wall0 + seconds:
        pair()
        count += 1
    wall, cpu, after = time.monotonic() - wall0, time.process_time() - cpu0, _threads()
    threads = []
    for tid, (name, seconds_now) in sorted(after.items(), key=lambda item: int(item[0])):
        used = seconds_now - before.get(tid, (name, 0.0))[1]
        if used > 0.01:
            threads.append(f"{name}:{used / count * 1e6:.0f}")
    print(json.dumps({"client": kind, "messages_per_s": round(count / wall),
                      "cpu_us_per_message": round(cpu / count * 1e6, 1),
                      "threads_us_per_message": " ".join(threads)}), flush=True)  # fmt: skip
    os._exit(0)  # no orderly close: the streams end with the process


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", nargs="+", choices=CLIENTS, default=list(CLIENTS))
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-envs", type=int, default=64)
    parser.add_argument("--child", nargs=2, metavar=("KIND", "TARGET"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], args.num_envs, args.seconds)
        return 0
    with contextlib.ExitStack() as servers:
        targets = {}
        if set(args.clients) - {"gym"}:
            targets["echo"] = servers.enter_context(serve(ECHO_NATIVE))[0]
        if "gym" in args.clients:
            targets["gym"] = servers.enter_context(serve("gymnasium"))[0]
        for _ in range(args.rounds):
            for kind in args.clients:
                target = targets["gym" if kind == "gym" else "echo"]
                subprocess.run(
                    [sys.executable, "-m", "bench.vector_client_cpu", "--child", kind, target,
                     "--seconds", str(args.seconds), "--num-envs", str(args.num_envs)],
                    check=True, timeout=120 + args.seconds,
                )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
