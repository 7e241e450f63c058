"""Vector snapshots: ``VectorSession.snapshot()`` and ``restore()`` of N CartPole envs on one
stream (the gymnasium env's native batch), and a fork of N branches into one vector stream.

Starts one ``openenv-grpc serve gymnasium`` child process (loopback), opens a vector of N
CartPole-v1 envs, resets them seeded and steps them a few times, then:

* **snapshot**: ``envs.snapshot()`` (all N, one request), ``--reps`` times: wall p50/p99,
  and the bytes of one answer;
* **restore**: ``envs.restore(snapshots)`` of those N, ``--reps`` times;
* **states()**: the same N envs' ``states()``, a round trip of N rows that does next to
  nothing, as the reference for what the machine's load makes of any call;
* **fork**: ``VectorSession.forked(target, [one] * N)`` (open N slots, restore N), wall
  time to the open stream, ``--forks`` times (closed between repetitions, untimed).

    python -m bench.vector_snapshots                  # N = 64, JSON
    python -m bench.vector_snapshots --envs 16 64 256 --reps 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium

from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.gymnasium import GymnasiumAction, GymnasiumResetOptions
from openenv_grpc_envs.gymnasium.client import GymnasiumVectorEnv
from openenv_grpc_envs.gymnasium.convert import encode


def _ms(walls: Sequence[float]) -> dict[str, float]:
    ordered = sorted(walls)
    return {
        "p50_ms": round(statistics.median(ordered) * 1000, 3),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 3),
    }


def _timed(call: Callable[[], Any], reps: int) -> list[float]:
    walls = []
    for _ in range(reps):
        started = time.perf_counter()
        call()
        walls.append(time.perf_counter() - started)
    return walls


def measure(target: str, size: int, reps: int, forks: int) -> dict[str, Any]:
    push = [GymnasiumAction(value=encode(0, gymnasium.spaces.Discrete(2)))] * size
    with GymnasiumVectorEnv(target, size) as envs:
        envs.reset(seeds=0, options=GymnasiumResetOptions(env_id="CartPole-v1"))
        for _ in range(5):
            envs.step(push)
        data = envs.snapshot()
        snapshot = _timed(envs.snapshot, reps)
        restore = _timed(lambda: envs.restore(data), reps)
        states = _timed(envs.states, reps)
    walls = []
    for _ in range(forks):
        started = time.perf_counter()
        fork = GymnasiumVectorEnv.forked(target, [data[0]] * size)
        walls.append(time.perf_counter() - started)
        fork.close()
    return {
        "envs": size,
        "native": True,
        "snapshot_bytes_each": len(data[0]),
        "snapshot_answer_bytes": sum(len(one) for one in data),
        "snapshot": _ms(snapshot),
        "restore": _ms(restore),
        "states_reference": _ms(states),
        "fork": _ms(walls),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", type=int, nargs="*", default=[64])
    parser.add_argument("--reps", type=int, default=200, help="snapshots (and restores) per N")
    parser.add_argument("--forks", type=int, default=20, help="forks of N per N")
    args = parser.parse_args(argv)
    print(json.dumps({"loadavg_before": os.getloadavg()}))
    server = ServerProcess("gymnasium", [], {})
    try:
        for size in args.envs:
            print(json.dumps(measure(server.target, size, args.reps, args.forks)))
    finally:
        server.stop()
    print(json.dumps({"loadavg_after": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
