"""Stable-Baselines3 on one vector stream (issue 21, item 7): ``RemoteVecEnv`` is an SB3
``VecEnv`` over one VectorSession of a real ``gymnasium`` server; PPO trains through it,
and for the same seed it learns exactly what a ``DummyVecEnv`` of local envs learns."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium
import numpy as np
import pytest
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.vec_env import DummyVecEnv, VecEnv, VecMonitor

from openenv_grpc import CapacityError
from openenv_grpc.integrations.sb3 import RemoteVecEnv
from openenv_grpc.testing import ServerProcess

StartServer = Callable[..., ServerProcess]


class Curve(VecMonitor):
    """Every finished episode's return, in order."""

    def __init__(self, venv: VecEnv) -> None:
        super().__init__(venv)
        self.returns: list[float] = []

    def step_wait(self) -> Any:
        observations, rewards, dones, infos = super().step_wait()
        self.returns += [float(info["episode"]["r"]) for info in infos if "episode" in info]
        return observations, rewards, dones, infos


def ppo_curve(venv: VecEnv, steps: int) -> tuple[list[float], PPO]:
    torch.set_num_threads(1)
    env = Curve(venv)
    model = PPO("MlpPolicy", env, seed=0, n_steps=64, batch_size=128, n_epochs=2, verbose=0)
    model.learn(steps)
    env.close()
    return env.returns, model


@pytest.mark.timeout(300)
def test_ppo_trains_through_one_vector_stream(start_server: StartServer) -> None:
    server = start_server("gymnasium")
    remote, model = ppo_curve(RemoteVecEnv(server.target, 4, "CartPole-v1"), 1024)
    activity = server.info().activity
    assert activity.steps >= 1024  # every env step went through the server
    assert activity.sessions_opened == 4  # the 4 envs, admitted once, never reopened
    assert server.active() == 0  # close() freed the slots
    assert len(remote) >= 10 and all(r >= 1.0 for r in remote)  # the env's rewards...
    assert [e["r"] for e in model.ep_info_buffer] == pytest.approx(remote[-100:])  # ...learnt
    local, _ = ppo_curve(
        DummyVecEnv([lambda: gymnasium.make("CartPole-v1") for _ in range(4)]), 1024
    )
    assert remote == local  # same seed, deterministic env: the same learning curve


def test_step_answers_in_sb3_conventions(start_server: StartServer) -> None:
    server = start_server("gymnasium")
    env = RemoteVecEnv(server.target, 3, "CartPole-v1", max_episode_steps=4)
    try:
        assert isinstance(env.observation_space, gymnasium.spaces.Box)
        assert env.num_envs == 3 and env.action_space.n == 2
        env.seed(7)
        first = env.reset()
        again = DummyVecEnv([lambda: gymnasium.make("CartPole-v1") for _ in range(3)])
        again.seed(7)
        assert np.array_equal(first, again.reset())
        first[0, 0] = 1.0  # SB3 may write into what it got
        for _ in range(4):
            observations, rewards, dones, infos = env.step(np.zeros(3, dtype=np.int64))
            assert rewards.dtype == np.float32 and observations.shape == (3, 4)
        assert dones.all()  # the 4-step TimeLimit
        for info in infos:
            assert info["TimeLimit.truncated"] is True  # the limit ended it, not the pole
            assert info["terminal_observation"].shape == (4,)
        assert not np.array_equal(observations[0], infos[0]["terminal_observation"])  # reset
        assert env.env_is_wrapped(gymnasium.Wrapper) == [False] * 3
        assert env.get_attr("render_mode") == [None] * 3
    finally:
        env.close()
    assert server.active() == 0


def test_a_full_server_refuses_the_whole_vec_env(start_server: StartServer) -> None:
    server = start_server("gymnasium", "--max-concurrent-envs", "2")
    with pytest.raises(CapacityError):
        RemoteVecEnv(server.target, 3, "CartPole-v1")
    # All or nothing: the three were refused at admission as one vector stream (counted
    # as three refusals), nothing was admitted, so no env was made or left open.
    activity = server.info().activity
    assert (activity.sessions_refused, activity.sessions_opened) == (3, 0)
    assert server.active() == 0
