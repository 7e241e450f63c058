"""Gymnasium vector envs, remote against in process (issue 13): CartPole-v1 at N = 8, 64,
256 and Pong at N = 16, env-steps/s, CPU per env-step and client bytes per frame.

    python -m bench.gym_vector                       # the whole run (~4 minutes)
    python -m bench.gym_vector --sizes 64 --seconds 3 --systems sync remote-vector

Systems (each closed loop, one vector step in flight, actions pre-drawn with a seeded
generator so the loop measures only stepping):

* ``sync`` / ``async``: Gymnasium's in-process ``SyncVectorEnv`` / ``AsyncVectorEnv``
  (one process per env; run up to N = 64 only, 256 processes do not fit two cores).
* ``envpool``: ``envpool.make_gymnasium`` in process (C++ threads).
* ``remote-vector``: ``RemoteGymnasiumVectorEnv`` over one vector stream, Gymnasium
  backend; ``remote-vector-envpool``: the same with ``backend="envpool"``;
  ``remote-sessions``: N session streams (``transport="sessions"``). The server is a child
  ``openenv-grpc serve gymnasium`` on loopback, unlimited capacity.

Each row reports env-steps/s, the client's and the server's CPU per env-step, and the
machine's *other* CPU during the window (busy CPU-seconds per second not spent by this
process or the server: other engineers' tests), so noisy rows can be told apart; rows
whose other CPU exceeds 0.5 cores are marked provisional. ``client_bytes_per_frame``
(Pong): the peak of Python-heap bytes (tracemalloc: bytes objects, numpy buffers) held
during one vector step above the level before it, divided by the step's frames and a
frame's size; 1.0 means one frame-sized copy per frame.

Numbers are measured, never asserted. Results go to ``bench/results/gym_vector-*.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np

from bench.systems import cpu_seconds, machine_busy

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEMS = ("sync", "async", "envpool", "remote-vector", "remote-vector-envpool", "remote-sessions")
#: AsyncVectorEnv runs a process per env: above this many it does not fit the machine.
ASYNC_MAX = 64
PONG = "ALE/Pong-v5"
PONG_KWARGS: dict[str, Any] = {"frameskip": 4}


@dataclass
class Row:
    """One system at one size."""

    env: str
    system: str
    num_envs: int
    env_steps_per_s: float
    client_cpu_us_per_env_step: float
    server_cpu_us_per_env_step: float | None
    other_cpu_cores: float
    provisional: bool
    seconds: float
    client_bytes_per_frame: float | None = None


@contextmanager
def server(extra_env: dict[str, str] | None = None) -> Iterator[tuple[str, int]]:
    """A child ``openenv-grpc serve gymnasium`` on a free loopback port: (target, pid)."""
    command = [sys.executable, "-m", "openenv_grpc.cli", "serve", "gymnasium", "--port", "0",
               "--max-concurrent-envs", "0"]  # fmt: skip
    env = {**os.environ, **(extra_env or {})}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env)  # fmt: skip
    try:
        assert process.stdout is not None
        target = ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            if "serving gymnasium on" in line:
                host_port = line.split(" on ", 1)[1].split()[0]
                target = host_port
                break
        if not target:
            raise RuntimeError("the server did not start")
        yield target, process.pid
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def make_system(
    system: str, env_id: str, kwargs: dict[str, Any], num_envs: int, target: str
) -> Any:
    """The vector env a system names (reset by the caller)."""
    if system in ("sync", "async"):
        fns = [lambda: gymnasium.make(env_id, **kwargs)] * num_envs
        if system == "sync":
            return gymnasium.vector.SyncVectorEnv(fns)
        return gymnasium.vector.AsyncVectorEnv(fns)
    if system == "envpool":
        import envpool

        return envpool.make_gymnasium(env_id, num_envs=num_envs, batch_size=num_envs, seed=0)
    from openenv_grpc_envs.gymnasium.adapters import RemoteGymnasiumVectorEnv

    if system == "remote-vector":
        return RemoteGymnasiumVectorEnv(target, num_envs, env_id, kwargs=kwargs,
                                        backend="gymnasium")  # fmt: skip
    if system == "remote-vector-envpool":
        return RemoteGymnasiumVectorEnv(target, num_envs, env_id, kwargs=kwargs,
                                        backend="envpool")  # fmt: skip
    return RemoteGymnasiumVectorEnv(target, num_envs, env_id, kwargs=kwargs, transport="sessions")


def measure(
    envs: Any,
    num_envs: int,
    actions: list[Any],
    seconds: float,
    server_pid: int | None,
    frame_bytes: int | None,
) -> dict[str, Any]:
    """Closed-loop steps for ``seconds`` after a 1 s warm-up."""
    if _is_envpool(envs):
        envs.reset()  # seeded when made
    else:
        envs.reset(seed=0)
    step: Callable[[Any], Any] = envs.step
    warm_until = time.monotonic() + 1.0
    i = 0
    while time.monotonic() < warm_until:
        step(actions[i % len(actions)])
        i += 1
    bytes_per_frame = None
    if frame_bytes:
        tracemalloc.start()
        peaks = []
        for k in range(10):
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            step(actions[k % len(actions)])
            peaks.append(tracemalloc.get_traced_memory()[1] - before)
        tracemalloc.stop()
        bytes_per_frame = float(np.median(peaks)) / (num_envs * frame_bytes)
    wall0, cpu0, busy0 = time.monotonic(), time.process_time(), machine_busy()
    server0 = cpu_seconds(server_pid) if server_pid else 0.0
    steps = 0
    deadline = wall0 + seconds
    while time.monotonic() < deadline:
        step(actions[steps % len(actions)])
        steps += 1
    wall = time.monotonic() - wall0
    client = time.process_time() - cpu0
    server_cpu = (cpu_seconds(server_pid) - server0) if server_pid else None
    other = (machine_busy() - busy0) - client - (server_cpu or 0.0)
    env_steps = steps * num_envs
    return {
        "env_steps_per_s": env_steps / wall,
        "client_cpu_us_per_env_step": client / env_steps * 1e6,
        "server_cpu_us_per_env_step": (server_cpu / env_steps * 1e6) if server_cpu else None,
        "other_cpu_cores": max(other, 0.0) / wall,
        "seconds": wall,
        "client_bytes_per_frame": bytes_per_frame,
    }


def _is_envpool(envs: Any) -> bool:
    return type(envs).__module__.startswith("envpool")


def run(
    env_id: str,
    kwargs: dict[str, Any],
    sizes: list[int],
    systems: list[str],
    seconds: float,
    frame_bytes: int | None,
    log: Callable[[str], None],
) -> list[Row]:
    rows: list[Row] = []
    with server() as (target, pid):
        for n in sizes:
            single = gymnasium.make(env_id, **kwargs)
            single.action_space.seed(0)
            actions = [
                np.array([single.action_space.sample() for _ in range(n)]) for _ in range(64)
            ]
            single.close()
            for system in systems:
                if system == "async" and n > ASYNC_MAX:
                    continue
                if system.endswith("envpool") and env_id == PONG:
                    continue  # EnvPool's Pong-v5 is another env (84x84 grey, stacked)
                envs = make_system(system, env_id, kwargs, n, target)
                try:
                    remote = system.startswith("remote")
                    result = measure(envs, n, actions, seconds, pid if remote else None,
                                     frame_bytes)  # fmt: skip
                finally:
                    envs.close()
                row = Row(env_id, system, n, provisional=result["other_cpu_cores"] > 0.5,
                          **result)  # fmt: skip
                rows.append(row)
                log(json.dumps(asdict(row)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--pong", type=int, nargs="*", default=[16])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    args = parser.parse_args(argv)

    def log(line: str) -> None:
        print(line, flush=True)

    started = dt.datetime.now(dt.timezone.utc)
    load = os.getloadavg()
    rows = run("CartPole-v1", {}, args.sizes, args.systems, args.seconds, None, log)
    if args.pong:
        from openenv_grpc_envs.gymnasium.configuration import register_ale

        register_ale()
        frame = 210 * 160 * 3
        rows += run(PONG, PONG_KWARGS, args.pong, args.systems, args.seconds, frame, log)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"gym_vector-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    report = {
        "started": started.isoformat(),
        "command": " ".join(["python -m bench.gym_vector", *(argv or sys.argv[1:])]),
        "loadavg_before": load,
        "python": platform.python_version(),
        "rows": [asdict(r) for r in rows],
    }
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
