"""The admission benchmark over a fleet: N sessions at once (connect, reset, one step
whose env sleeps 1 s, close; success >= 95% within 60 s) for 1, 2 and 3 nodes on a
real engine, with sessions per node and the balance skew (max/min); and the extra
per-step cost of the fleet target over a direct one.

    python bench/fleet_admission.py --engine local   # k local server processes
    python bench/fleet_admission.py --engine slurm   # scripts/start_slurm.sh, SlurmProvider
    python bench/fleet_admission.py --engine ray     # ray start x3, RayProvider
    python bench/fleet_admission.py --step-cost      # fleet vs direct, echo, closed loop

slurm and ray run their cluster in a network namespace holding only loopback (root),
and this script again inside it. Prints one JSON line per run and a summary table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SLEEP = "bench.envs:SleepEnvironment"
NETNS = f"oeg-bench-{os.getpid()}"
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}
RAY_ADDRESS = "127.0.0.1:46380"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- the engines ------------------------------------------------------------------------


@contextmanager
def servers(engine: str, nodes: int) -> Iterator[list[str]]:
    """``nodes`` servers of the sleep env on ``engine``; yields their targets."""
    env = {"PYTHONPATH": str(ROOT)}
    flags = ["--max-concurrent-envs", "0"]
    if engine == "local":
        from openenv_grpc.providers import LocalProcessProvider

        local = [
            LocalProcessProvider(SLEEP, args=flags, grace=1, extra_env=env) for _ in range(nodes)
        ]
        try:
            for provider in local:
                provider.start()
            yield [provider.target for provider in local]
        finally:
            for provider in local:
                provider.stop()
    elif engine == "slurm":
        from openenv_grpc.providers.slurm import SlurmProvider

        with SlurmProvider(SLEEP, nodes=nodes, args=flags, grace=1, extra_env=env) as slurm:
            yield slurm.targets
    elif engine == "ray":
        from openenv_grpc.providers.ray_provider import RayProvider

        ray = RayProvider(
            SLEEP, replicas=nodes, address=RAY_ADDRESS, args=flags, grace=1, extra_env=env,
            strategy="STRICT_SPREAD", ray_init={"log_to_driver": False},
        )  # fmt: skip
        with ray:
            yield ray.targets
    else:
        raise SystemExit(f"unknown engine {engine!r}")


# -- admission ------------------------------------------------------------------------------


async def admission(targets: list[str], n: int, per_channel: int = 128) -> dict[str, Any]:
    import grpc

    from openenv_grpc.client.channel import channel_options
    from openenv_grpc.client.fleet import fleet_options, fleet_target
    from openenv_grpc.client.info import fetch_info
    from openenv_grpc.v1 import session_pb2 as pb
    from openenv_grpc.v1 import session_pb2_grpc as pb_grpc
    from openenv_grpc_envs.echo import AsyncEchoEnv, EchoAction

    target = fleet_target(targets)
    before = {t: fetch_info(t).activity.sessions_opened for t in targets}
    count = max(1, -(-n // per_channel))
    options = [*channel_options(), *fleet_options(), ("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(count)]
    for channel in channels:  # every channel's rotation reaches every node first
        stub = pb_grpc.EnvServiceStub(channel)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            seen = {
                (await stub.Info(pb.InfoRequest(), wait_for_ready=True, timeout=10)).server_pid
                for _ in targets
            }
            if len(seen) == len(targets):
                break
            await asyncio.sleep(0.02)

    async def one(i: int) -> tuple[bool, float, str]:
        start = time.monotonic()
        env = AsyncEchoEnv(channels[i % count])
        try:
            async with asyncio.timeout(60):
                await env.open()
                await env.reset()
                await env.step(EchoAction(message="x"))
                await env.close()
        except Exception as exc:
            await env.abort()
            return False, time.monotonic() - start, f"{type(exc).__name__}: {exc}"[:80]
        return True, time.monotonic() - start, ""

    t0 = time.monotonic()
    outcomes = await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.monotonic() - t0
    for channel in channels:
        await channel.close()
    per_node = [fetch_info(t).activity.sessions_opened - before[t] for t in targets]
    errors: dict[str, int] = {}
    for ok, _, error in outcomes:
        if not ok:
            errors[error] = errors.get(error, 0) + 1
    ok_count = sum(ok for ok, _, _ in outcomes)
    durations = [d for ok, d, _ in outcomes if ok]
    return {
        "nodes": len(targets),
        "n": n,
        "ok": ok_count,
        "success_rate": ok_count / n,
        "wall_s": round(wall, 2),
        "session_p99_s": round(percentile(durations, 0.99), 2),
        "per_node": per_node,
        "skew": round(max(per_node) / max(1, min(per_node)), 3),
        "errors": errors,
    }


def run_engine(engine: str, node_counts: list[int], sizes: list[int]) -> list[dict[str, Any]]:
    rows = []
    for nodes in node_counts:
        with servers(engine, nodes) as targets:
            for n in sizes:
                row = {"engine": engine, **asyncio.run(admission(targets, n))}
                print(json.dumps(row), flush=True)
                rows.append(row)
                if row["success_rate"] < 0.95:
                    break
    return rows


# -- per-step cost -------------------------------------------------------------------------


def step_cost(steps: int) -> list[dict[str, Any]]:
    """p50/mean step latency of one blocking session: direct channel vs the fleet's."""
    from openenv_grpc.client.fleet import Fleet
    from openenv_grpc.providers import LocalProcessProvider
    from openenv_grpc_envs.echo import EchoAction, EchoEnv

    rows = []
    local = [LocalProcessProvider("echo") for _ in range(3)]
    try:
        for provider in local:
            provider.start()
        action = EchoAction(message="hello")

        def measure(env: EchoEnv) -> list[float]:
            env.reset()
            for _ in range(200):  # warm
                env.step(action)
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                env.step(action)
                times.append(time.perf_counter() - start)
            return times

        for rounds in range(3):  # interleaved: the machine's load drifts
            with EchoEnv(local[0].target) as env:
                direct = measure(env)
            with Fleet([p.target for p in local]) as fleet:
                fleet.wait_ready()
                with fleet.session(EchoEnv) as env:
                    via_fleet = measure(env)
            # And the open: direct vs through the fleet's picker.
            opens: dict[str, list[float]] = {"direct": [], "fleet": []}
            with Fleet([p.target for p in local]) as fleet:
                fleet.wait_ready()
                for _ in range(100):
                    for kind, make in (
                        ("direct", lambda: EchoEnv(local[0].target)),
                        ("fleet", lambda: fleet.session(EchoEnv)),
                    ):
                        env = make()
                        start = time.perf_counter()
                        env.open()
                        opens[kind].append(time.perf_counter() - start)
                        env.close()
            row = {
                "round": rounds,
                "step_p50_us_direct": round(percentile(direct, 0.5) * 1e6, 1),
                "step_p50_us_fleet": round(percentile(via_fleet, 0.5) * 1e6, 1),
                "step_mean_us_direct": round(sum(direct) / len(direct) * 1e6, 1),
                "step_mean_us_fleet": round(sum(via_fleet) / len(via_fleet) * 1e6, 1),
                "open_p50_us_direct": round(percentile(opens["direct"], 0.5) * 1e6, 1),
                "open_p50_us_fleet": round(percentile(opens["fleet"], 0.5) * 1e6, 1),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        for provider in local:
            provider.stop()
    return rows


# -- clusters in a namespace -----------------------------------------------------------------


def nsenter() -> list[str]:
    return ["nsenter", f"--net=/run/netns/{NETNS}"]


def outside(engine: str, argv: list[str]) -> int:
    """Start the engine's cluster in a namespace, run this script inside, tear down."""
    workdir = Path(tempfile.mkdtemp(prefix="oeg-bench-"))
    env = {**os.environ, **RAY_ENV}
    try:
        if engine == "slurm":
            conf = workdir / "slurm" / "slurm.conf"
            subprocess.run(
                ["sh", str(ROOT / "scripts/start_slurm.sh"), "start", str(conf.parent), "3", NETNS],
                check=True,
            )
            env["SLURM_CONF"] = str(conf)
        else:
            subprocess.run(["ip", "netns", "add", NETNS], check=True)
            subprocess.run(["ip", "-n", NETNS, "link", "set", "lo", "up"], check=True)
            ray = str(Path(sys.executable).parent / "ray")
            common = [
                "--node-ip-address=127.0.0.1", "--num-cpus=1", "--disable-usage-stats",
                "--object-store-memory=80000000",
            ]  # fmt: skip
            subprocess.run(
                [*nsenter(), ray, "start", "--head", f"--port={RAY_ADDRESS.split(':')[1]}",
                 "--include-dashboard=false", f"--temp-dir={workdir}/ray", *common],
                env=env, check=True, capture_output=True,
            )  # fmt: skip
            for _ in range(2):
                subprocess.run(
                    [*nsenter(), ray, "start", f"--address={RAY_ADDRESS}", *common],
                    env=env, check=True, capture_output=True,
                )  # fmt: skip
        env["PYTHONPATH"] = str(ROOT)
        return subprocess.run(
            [*nsenter(), sys.executable, __file__, "--inside", *argv], env=env
        ).returncode
    finally:
        if engine == "slurm":
            subprocess.run(["sh", str(ROOT / "scripts/start_slurm.sh"), "stop",
                            str(workdir / "slurm"), NETNS])  # fmt: skip
        elif Path(f"/run/netns/{NETNS}").exists():
            out = subprocess.run(["ip", "netns", "pids", NETNS], capture_output=True, text=True)
            for pid in out.stdout.split():
                subprocess.run(["kill", "-9", pid])
            time.sleep(1)
            subprocess.run(["ip", "netns", "delete", NETNS])
        subprocess.run(["rm", "-rf", str(workdir)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["local", "slurm", "ray"])
    parser.add_argument("--nodes", default="1,2,3")
    parser.add_argument("--sessions", default="256,512,1024")
    parser.add_argument("--step-cost", action="store_true")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.step_cost:
        step_cost(args.steps)
        return 0
    if args.engine in ("slurm", "ray") and not args.inside:
        return outside(args.engine, [a for a in sys.argv[1:]])
    rows = run_engine(
        args.engine or "local",
        [int(k) for k in args.nodes.split(",")],
        [int(n) for n in args.sessions.split(",")],
    )
    print("\n| engine | nodes | N | ok | wall s | p99 s | sessions per node | skew |")
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        print(
            f"| {r['engine']} | {r['nodes']} | {r['n']} | {r['success_rate']:.1%} | "
            f"{r['wall_s']} | {r['session_p99_s']} | {r['per_node']} | {r['skew']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
