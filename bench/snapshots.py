"""Snapshot size, snapshot + restore round trip, and fork of 16, per catalogue env.

Starts one ``openenv-grpc serve`` child process per env (loopback, unlimited capacity),
plays each case a few steps into an episode, then on one session:

* **size**: the bytes a client holds (the env's body plus the server's signed envelope);
* **round trip**: ``snapshot()`` then ``restore()`` of those bytes, ``--reps`` times
  (p50/p99 of the pair, and of each half), beside ``state()`` (a round trip that does
  next to nothing) as the reference for what the machine's load makes of any call;
* **fork of 16**: ``env.fork(16)`` (one snapshot, 16 new sessions opened and restored)
  with the asyncio client (opened concurrently) and the blocking one (one after
  another), wall time from the call to 16 open sessions, ``--forks`` times; the forks
  are closed between repetitions, untimed.

The machine's load average is printed before and after (``os.getloadavg``).

    python -m bench.snapshots                     # every case, JSON lines
    python -m bench.snapshots --markdown          # plus the tables of docs/benchmarks.md
    python -m bench.snapshots --cases echo pong --reps 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from openenv_grpc import AsyncSession, Session
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.echo import AsyncEchoEnv, EchoAction, EchoEnv, EchoResetOptions
from openenv_grpc_envs.gymnasium import (
    AsyncGymnasiumEnv,
    GymnasiumAction,
    GymnasiumEnv,
    GymnasiumResetOptions,
    Value,
)
from openenv_grpc_envs.openspiel import (
    CONTROL_MODE_ALL_PLAYERS,
    AsyncOpenSpielEnv,
    OpenSpielAction,
    OpenSpielEnv,
    OpenSpielResetOptions,
)
from openenv_grpc_envs.wordle import AsyncWordleEnv, WordleAction, WordleEnv

FORK_SIZE = 16


@dataclass(frozen=True)
class Case:
    """One benchmarked episode: the server's env, the clients, and how to get going."""

    name: str
    server: str
    sync_client: type[Session[Any, Any, Any, Any]]
    async_client: type[AsyncSession[Any, Any, Any, Any]]
    options: Any
    #: The actions played before the snapshot (from the last observation).
    actions: Callable[[Any], Any]
    steps: int


def _discrete(n: int) -> Callable[[Any], GymnasiumAction]:
    counter = iter(range(1 << 30))
    return lambda _observation: GymnasiumAction(value=Value(discrete=next(counter) % n))


def _cycling() -> Callable[[Any], OpenSpielAction]:
    """Legal moves in turn (connect four's columns: no four in a row for a while)."""
    counter = iter(range(1 << 30))
    return lambda o: OpenSpielAction(id=o.legal_actions[next(counter) % len(o.legal_actions)].id)


CASES = [
    Case("echo", "echo", EchoEnv, AsyncEchoEnv, EchoResetOptions(),
         lambda _o: EchoAction(message="hello world"), 5),
    Case("wordle", "wordle", WordleEnv, AsyncWordleEnv, None,
         lambda o: WordleAction(guess=("crane", "sloth", "pious")[o.turn]), 2),
    Case("tic_tac_toe", "openspiel", OpenSpielEnv, AsyncOpenSpielEnv,
         OpenSpielResetOptions(game="tic_tac_toe"),
         lambda o: OpenSpielAction(id=o.legal_actions[0].id), 2),
    Case("connect_four", "openspiel", OpenSpielEnv, AsyncOpenSpielEnv,
         OpenSpielResetOptions(game="connect_four", control=CONTROL_MODE_ALL_PLAYERS),
         _cycling(), 6),
    Case("cartpole", "gymnasium", GymnasiumEnv, AsyncGymnasiumEnv,
         GymnasiumResetOptions(env_id="CartPole-v1"), _discrete(2), 10),
    Case("pong", "gymnasium", GymnasiumEnv, AsyncGymnasiumEnv,
         GymnasiumResetOptions(env_id="ALE/Pong-v5"), _discrete(6), 50),
]  # fmt: skip


def _ms(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50_ms": round(statistics.median(ordered) * 1e3, 3), "p99_ms": round(p99 * 1e3, 3)}


def _round_trips(case: Case, target: str, reps: int) -> dict[str, Any]:
    with case.sync_client(target) as env:
        observation = env.reset(seed=1, options=case.options).observation
        for _ in range(case.steps):
            observation = env.step(case.actions(observation)).observation
        data = env.snapshot()
        for _ in range(min(20, reps)):  # warm up: first calls load and allocate
            env.restore(env.snapshot())
        states = []
        for _ in range(reps):  # the reference: one round trip that does next to nothing
            started = time.perf_counter()
            env.state()
            states.append(time.perf_counter() - started)
        takes, restores, pairs = [], [], []
        for _ in range(reps):
            started = time.perf_counter()
            data = env.snapshot()
            taken = time.perf_counter()
            env.restore(data)
            done = time.perf_counter()
            takes.append(taken - started)
            restores.append(done - taken)
            pairs.append(done - started)
    return {
        "snapshot_bytes": len(data),
        "round_trip": _ms(pairs),
        "snapshot": _ms(takes),
        "restore": _ms(restores),
        "state": _ms(states),
    }


async def _async_forks(case: Case, target: str, times: int) -> list[float]:
    walls = []
    async with grpc.aio.insecure_channel(target) as channel, case.async_client(channel) as env:
        observation = (await env.reset(seed=1, options=case.options)).observation
        for _ in range(case.steps):
            observation = (await env.step(case.actions(observation))).observation
        for _ in range(times + 1):  # the first one warms the channel up
            started = time.perf_counter()
            forks = await env.fork(FORK_SIZE)
            walls.append(time.perf_counter() - started)
            await asyncio.gather(*(f.close() for f in forks))
    return walls[1:]


def _sync_forks(case: Case, target: str, times: int) -> list[float]:
    walls = []
    with case.sync_client(target) as env:
        observation = env.reset(seed=1, options=case.options).observation
        for _ in range(case.steps):
            observation = env.step(case.actions(observation)).observation
        for _ in range(times + 1):
            started = time.perf_counter()
            forks = env.fork(FORK_SIZE)
            walls.append(time.perf_counter() - started)
            for fork in forks:
                fork.close()
    return walls[1:]


def _wall(walls: Sequence[float]) -> dict[str, float]:
    return {
        "median_ms": round(statistics.median(walls) * 1e3, 1),
        "min_ms": round(min(walls) * 1e3, 1),
        "max_ms": round(max(walls) * 1e3, 1),
    }


def run(cases: Sequence[Case], reps: int, forks: int) -> list[dict[str, Any]]:
    """Every case's numbers, one server per env."""
    results = []
    servers: dict[str, ServerProcess] = {}
    try:
        for case in cases:
            if case.server not in servers:
                servers[case.server] = ServerProcess(
                    case.server, ["--max-concurrent-envs", "0", "--log-level", "WARNING"]
                )
            target = servers[case.server].target
            result: dict[str, Any] = {"case": case.name, "reps": reps, "forks": forks}
            result.update(_round_trips(case, target, reps))
            result["fork16_async"] = _wall(asyncio.run(_async_forks(case, target, forks)))
            result["fork16_sync"] = _wall(_sync_forks(case, target, forks))
            print(json.dumps(result), flush=True)
            results.append(result)
    finally:
        for server in servers.values():
            server.stop()
    return results


def markdown(results: Sequence[dict[str, Any]]) -> str:
    """The tables of docs/benchmarks.md."""
    lines = [
        "| env | snapshot size | snapshot + restore p50 | p99 | snapshot p50 | restore p50 "
        "| state() p50 (reference) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['case']} | {r['snapshot_bytes']:,} B | {r['round_trip']['p50_ms']} ms | "
            f"{r['round_trip']['p99_ms']} ms | {r['snapshot']['p50_ms']} ms | "
            f"{r['restore']['p50_ms']} ms | {r['state']['p50_ms']} ms |"
        )
    lines += [
        "",
        f"| env | fork of {FORK_SIZE}, asyncio (median / min / max) | blocking |",
        "|---|---:|---:|",
    ]
    for r in results:
        a, s = r["fork16_async"], r["fork16_sync"]
        lines.append(
            f"| {r['case']} | {a['median_ms']} / {a['min_ms']} / {a['max_ms']} ms | "
            f"{s['median_ms']} / {s['min_ms']} / {s['max_ms']} ms |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", choices=[c.name for c in CASES])
    parser.add_argument("--reps", type=int, default=300, help="round trips per case")
    parser.add_argument("--forks", type=int, default=10, help="forks of 16 per case and client")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    chosen = [c for c in CASES if not args.cases or c.name in args.cases]
    load = os.getloadavg()
    print(json.dumps({"load_before": [round(x, 2) for x in load], "cpus": os.cpu_count()}))
    results = run(chosen, args.reps, args.forks)
    load = os.getloadavg()
    print(json.dumps({"load_after": [round(x, 2) for x in load]}))
    if args.markdown:
        print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
