"""One Gymnasium session against one echo session: server CPU per step, same run.

Starts each server below as a child process (``openenv-grpc serve``, one at a time), runs
one client process with one session in a closed loop (one step in flight), and reads the
server process's CPU time over the measured window. Rounds alternate the servers, so a
noisy neighbour hits each about equally; the table reports each server's median round.

* ``echo``: ``openenv-grpc serve echo`` (``runs_inline = True``), stepped by ``EchoEnv``
  with 64-byte messages: the reference.
* ``gym``: ``openenv-grpc serve gymnasium`` with ``GYM_ENV_ID``, stepped by
  ``RemoteGymnasiumEnv`` with random actions, reset when an episode ends (resets are part
  of the cost; steps are what is counted) -- as a Stable-Baselines3 worker drives it.
* ``gym-pool``: the same with ``INLINE_THRESHOLD_MS=0``: every call on the thread pool
  (the behaviour before calls were placed by measurement).
* ``gym-inline``: the same env declared ``runs_inline = True``
  (``bench.gym_envs:InlineGymnasiumEnvironment``): every call on the event loop.

    python -m bench.gym_session --env-id CartPole-v1 --seconds 5 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any

_SERVING = re.compile(r"serving \S+ on (\S+):(\d+)")

#: name -> (what to serve, extra environment for the server)
SERVERS: dict[str, tuple[str, dict[str, str]]] = {
    "echo": ("echo", {}),
    "gym": ("gymnasium", {}),
    "gym-pool": ("gymnasium", {"INLINE_THRESHOLD_MS": "0"}),
    "gym-inline": ("bench.gym_envs:InlineGymnasiumEnvironment", {}),
}


def _start(what: str, extra: dict[str, str], env_id: str) -> tuple[subprocess.Popen[str], str]:
    """Start one server; returns the process and its ``host:port``.

    Raises:
        RuntimeError: it exited before printing its serving line.
    """
    environ = {**os.environ, "GYM_ENV_ID": env_id, **extra}
    cmd = [sys.executable, "-m", "openenv_grpc", "serve", what, "--port", "0"]
    cmd += ["--max-concurrent-envs", "0", "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=environ)
    assert proc.stdout is not None
    for line in proc.stdout:
        match = _SERVING.search(line)
        if match:
            return proc, f"{match.group(1)}:{match.group(2)}"
    raise RuntimeError(f"server {what} did not start (exit {proc.wait()})")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _echo_client(target: str, warmup: float, seconds: float, out: Any) -> None:
    from openenv_grpc_envs.echo import EchoAction, EchoEnv

    with EchoEnv(target) as env:
        env.reset()
        action = EchoAction(message="x" * 64)

        def step() -> None:
            env.step(action)

        out.put(_drive(step, warmup, seconds, out))


def _gym_client(target: str, env_id: str, warmup: float, seconds: float, out: Any) -> None:
    from openenv_grpc_envs.gymnasium.adapters import RemoteGymnasiumEnv

    env = RemoteGymnasiumEnv(target, env_id)
    try:
        env.reset(seed=0)
        env.action_space.seed(0)

        def step() -> None:
            _, _, terminated, truncated, _ = env.step(env.action_space.sample())
            if terminated or truncated:
                env.reset()

        out.put(_drive(step, warmup, seconds, out))
    finally:
        env.close()


def _drive(step: Any, warmup: float, seconds: float, out: Any) -> dict[str, Any]:
    """Step through the warm-up, tell the parent ("go"), then step ``seconds`` more."""
    clock = time.perf_counter
    end_warmup = clock() + warmup
    while clock() < end_warmup:
        step()
    out.put("go")
    latencies: list[float] = []
    stop_at = clock() + seconds
    while True:
        t0 = clock()
        step()
        t1 = clock()
        latencies.append(t1 - t0)
        if t1 >= stop_at:
            return {"latencies": latencies}


def measure(name: str, env_id: str, warmup: float, seconds: float) -> dict[str, Any]:
    """One round against one fresh server; returns its row."""
    what, extra = SERVERS[name]
    proc, target = _start(what, extra, env_id)
    try:
        queue: Any = mp.Queue()
        if name == "echo":
            client = mp.Process(target=_echo_client, args=(target, warmup, seconds, queue))
        else:
            client = mp.Process(target=_gym_client, args=(target, env_id, warmup, seconds, queue))
        client.start()
        if queue.get(timeout=120) != "go":
            raise RuntimeError("client failed")
        cpu0, wall0 = _cpu_seconds(proc.pid), time.perf_counter()
        result = queue.get(timeout=120 + seconds)
        cpu, wall = _cpu_seconds(proc.pid) - cpu0, time.perf_counter() - wall0
        client.join(30)
    finally:
        proc.terminate()
        proc.wait(30)
    latencies = sorted(result["latencies"])
    steps = len(latencies)
    return {
        "server": name,
        "steps_per_s": steps / wall,
        "p50_us": statistics.median(latencies) * 1e6,
        "server_cpu_us_per_step": cpu / steps * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--env-id", default="CartPole-v1")
    parser.add_argument("--servers", nargs="+", default=list(SERVERS), choices=list(SERVERS))
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in args.servers}
    for round_ in range(args.rounds):
        for name in args.servers:
            row = measure(name, args.env_id, args.warmup, args.seconds)
            rows[name].append(row)
            shown = {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}
            print(json.dumps({"round": round_ + 1, **shown}), flush=True)
    cpu = {n: statistics.median(r["server_cpu_us_per_step"] for r in rs) for n, rs in rows.items()}
    summary: dict[str, Any] = {
        "env_id": args.env_id,
        "median_cpu_us_per_step": {n: round(c, 1) for n, c in cpu.items()},
    }
    if "echo" in cpu:
        summary["cpu_vs_echo"] = {n: round(c / cpu["echo"], 2) for n, c in cpu.items()}
    summary["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
