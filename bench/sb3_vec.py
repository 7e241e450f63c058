"""Stable-Baselines3 PPO on CartPole-v1 through three VecEnvs (issue 21, item 7):

* ``remote-vector``: :class:`openenv_grpc.integrations.sb3.RemoteVecEnv`, one vector
  stream to a ``openenv-grpc serve gymnasium`` child on loopback;
* ``remote-sessions``: SB3's ``DummyVecEnv`` of N ``RemoteGymnasiumEnv`` sessions (N
  round trips per step);
* ``local``: SB3's ``DummyVecEnv`` of N local ``gymnasium.make("CartPole-v1")``.

    python -m bench.sb3_vec                                # N=8, 16384 steps, seed 0
    python -m bench.sb3_vec --num-envs 16 --timesteps 32768 --seed 1
    python -m bench.sb3_vec --systems local remote-vector remote-sessions   # other order

For each: PPO(seed) learns ``--timesteps`` env steps (fps = env steps / wall seconds of
``learn``), and a second pass measures the bare VecEnv with the same seeded random
actions (no learner: the transport alone). The learning curves are the returns of the
finished episodes in order (SB3's ``VecMonitor``); CartPole is deterministic for a seed,
so the three must be equal -- the report says whether they are. Numbers are measured,
never asserted. Results go to ``bench/results/sb3_vec-*.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.vec_env import DummyVecEnv, VecEnv, VecMonitor

from openenv_grpc.integrations.sb3 import RemoteVecEnv
from openenv_grpc.providers import LocalProcessProvider
from openenv_grpc_envs.gymnasium.adapters import RemoteGymnasiumEnv

RESULTS = Path(__file__).parent / "results"
ENV_ID = "CartPole-v1"


def makers(target: str, n: int) -> dict[str, Callable[[], VecEnv]]:
    def remote(i: int) -> Callable[[], gymnasium.Env[Any, Any]]:
        return lambda: RemoteGymnasiumEnv(target, ENV_ID)

    return {
        "remote-vector": lambda: RemoteVecEnv(target, n, ENV_ID),
        "remote-sessions": lambda: DummyVecEnv([remote(i) for i in range(n)]),
        "local": lambda: DummyVecEnv([lambda: gymnasium.make(ENV_ID) for _ in range(n)]),
    }


class Curve(VecMonitor):
    """VecMonitor that keeps every finished episode's return, in order (the curve)."""

    def __init__(self, venv: VecEnv) -> None:
        super().__init__(venv)
        self.returns: list[float] = []

    def step_wait(self) -> Any:
        observations, rewards, dones, infos = super().step_wait()
        self.returns += [float(info["episode"]["r"]) for info in infos if "episode" in info]
        return observations, rewards, dones, infos


def learn(make: Callable[[], VecEnv], seed: int, timesteps: int) -> dict[str, Any]:
    torch.set_num_threads(1)  # the same math in every run, and one core for the env side
    env = Curve(make())
    try:
        model = PPO("MlpPolicy", env, seed=seed, n_steps=128, batch_size=256, verbose=0)
        started = time.perf_counter()
        model.learn(timesteps)
        wall = time.perf_counter() - started
        returns = [float(e["r"]) for e in model.ep_info_buffer]
        curve = env.returns
    finally:
        env.close()
    return {"fps": timesteps / wall, "wall_s": wall, "last_100_mean": float(np.mean(returns)),
            "curve": curve}  # fmt: skip


def bare(make: Callable[[], VecEnv], seed: int, steps: int) -> float:
    env = make()
    try:
        env.seed(seed)
        env.reset()
        rng = np.random.default_rng(seed)
        actions = rng.integers(0, 2, size=(steps, env.num_envs))
        started = time.perf_counter()
        for row in actions:
            env.step(row)
        return steps * env.num_envs / (time.perf_counter() - started)
    finally:
        env.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--timesteps", type=int, default=16384)
    parser.add_argument("--bare-steps", type=int, default=1000, help="vector steps, bare pass")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--systems", nargs="+", default=["remote-vector", "remote-sessions", "local"],
        help="which, in this order (the load of a shared machine drifts: alternate orders)",
    )  # fmt: skip
    args = parser.parse_args()
    rows: dict[str, Any] = {}
    with LocalProcessProvider("gymnasium", max_concurrent_envs=0) as server:
        made = makers(server.target, args.num_envs)
        for name in args.systems:
            make = made[name]
            row = learn(make, args.seed, args.timesteps)
            row["bare_fps"] = bare(make, args.seed, args.bare_steps)
            rows[name] = row
            print(json.dumps({"system": name, **{k: v for k, v in row.items() if k != "curve"},
                              "episodes": len(row["curve"])}), flush=True)  # fmt: skip
    first = rows[args.systems[0]]["curve"]
    same = {name: rows[name]["curve"] == first for name in rows}
    summary = {"num_envs": args.num_envs, "timesteps": args.timesteps, "seed": args.seed,
               f"curves_equal_to_{args.systems[0]}": same, "load_average": os.getloadavg(),
               "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}  # fmt: skip
    print(json.dumps({"summary": summary}), flush=True)
    RESULTS.mkdir(exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    (RESULTS / f"sb3_vec-{stamp}.json").write_text(json.dumps({**summary, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
