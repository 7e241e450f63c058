"""Gymnasium's snapshot in-process: restore on a fresh instance continues exactly (the
env's generator and the wrappers' counters included) for classic control, toy text and
Atari; the ids that cannot snapshot say why."""

from __future__ import annotations

import json
import re
from typing import Any

import gymnasium
import pytest

from openenv_grpc import InvalidAction
from openenv_grpc_envs.gymnasium import GymnasiumAction, GymnasiumResetOptions
from openenv_grpc_envs.gymnasium.convert import build_space, encode
from openenv_grpc_envs.gymnasium.environment import GymnasiumEnvironment

Trace = list[tuple[bytes, float, bool, bool, Any]]


def options(env_id: str, **kwargs: Any) -> GymnasiumResetOptions:
    steps = kwargs.pop("max_episode_steps", None)
    made = GymnasiumResetOptions(env_id=env_id, max_episode_steps=steps)
    if kwargs:
        made.kwargs.update(kwargs)
    return made


class Player:
    """Draws actions from the env's action space with its own seeded generator."""

    def __init__(self, env: GymnasiumEnvironment, seed: int) -> None:
        description = env.state().env
        self.space: gymnasium.Space[Any] = build_space(description.action_space)
        self.space.seed(seed)

    def play(self, env: GymnasiumEnvironment, steps: int) -> Trace:
        trace: Trace = []
        for _ in range(steps):
            action = GymnasiumAction(value=encode(self.space.sample(), self.space))
            result = env.step(action)
            trace.append(
                (
                    result.observation.SerializeToString(),
                    result.reward,
                    result.terminated,
                    result.truncated,
                    result.info,
                )
            )
            if result.terminated or result.truncated:
                break
        return trace


def started(reset: GymnasiumResetOptions, steps: int = 5) -> GymnasiumEnvironment:
    env = GymnasiumEnvironment()
    env.reset(seed=5, episode_id="e", options=reset)
    Player(env, seed=1).play(env, steps)
    return env


@pytest.mark.parametrize(
    "reset",
    [
        options("CartPole-v1", max_episode_steps=9),  # truncated by TimeLimit after restore
        options("MountainCarContinuous-v0"),
        options("Acrobot-v1"),
        options("Pendulum-v1"),
        options("FrozenLake-v1", is_slippery=True),  # every move draws from np_random
        options("CliffWalkingSlippery-v1"),
        options("Taxi-v4", is_rainy=True, fickle_passenger=True),
        options("Blackjack-v1"),
        options("ALE/Pong-v5"),  # sticky actions: ALE's own generator
        options("ALE/Breakout-v5", obs_type="ram"),  # small observations: state() shows them
    ],
    ids=lambda o: o.env_id,
)
def test_restore_on_a_fresh_instance_continues_exactly(reset: GymnasiumResetOptions) -> None:
    original = started(reset)
    snapshot = original.snapshot()
    expected_state = original.state()
    player = Player(original, seed=2)
    expected = player.play(original, 60)

    fresh = GymnasiumEnvironment()  # never reset
    fresh.restore(snapshot)
    assert fresh.state() == expected_state
    assert Player(fresh, seed=2).play(fresh, 60) == expected
    assert fresh.state() == original.state()
    # The generator came along: an unseeded reset draws the same first observation.
    assert (
        fresh.reset(seed=None, episode_id="f", options=None).observation
        == original.reset(seed=None, episode_id="f", options=None).observation
    )


def test_restore_reuses_a_running_env_of_the_same_configuration() -> None:
    env = started(options("CartPole-v1"))
    running = env._env
    snapshot = env.snapshot()
    expected = Player(env, seed=3).play(env, 20)
    env.restore(snapshot)
    assert env._env is running
    assert Player(env, seed=3).play(env, 20) == expected


def test_restore_replaces_a_running_env_of_another_configuration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    snapshot = started(options("Acrobot-v1")).snapshot()
    env = started(options("CartPole-v1"))
    closed: list[object] = []
    old = env._env
    assert old is not None
    monkeypatch.setattr(old, "close", lambda: closed.append(old))
    env.restore(snapshot)
    assert env.state().env.env_id == "Acrobot-v1"
    assert closed == [old]


@pytest.mark.parametrize(
    ("reset", "why"),
    [
        (options("LunarLander-v3"), "Box2D envs hold a pybox2d world, which cannot be serialized"),
        (options("SnapshotTest/Unlisted-v0"), r"\S+:Unlisted is not one of the env classes"),
    ],
)
def test_ids_that_cannot_snapshot_say_why(reset: GymnasiumResetOptions, why: str) -> None:
    if reset.env_id not in gymnasium.registry:
        gymnasium.register(reset.env_id, entry_point=Unlisted)
    env = GymnasiumEnvironment()
    try:
        env.reset(seed=0, episode_id="e", options=reset)
    except InvalidAction as exc:
        pytest.fail(f"{reset.env_id} cannot even be made here: {exc}")
    with pytest.raises(
        NotImplementedError, match=f"{re.escape(reset.env_id)} cannot snapshot: {why}"
    ):
        env.snapshot()


class Unlisted(gymnasium.Env[int, int]):
    """A registered env whose class the snapshot module does not list."""

    observation_space = gymnasium.spaces.Discrete(2)
    action_space = gymnasium.spaces.Discrete(2)

    def __init__(self, render_mode: str | None = None) -> None:
        self.render_mode = render_mode  # make() passes it (the server may render frames)

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[int, dict[str, Any]]:
        super().reset(seed=seed)
        return 0, {}


def edited(snapshot: bytes, path: list[str], value: Any) -> bytes:
    body = json.loads(snapshot)
    node = body
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (["options", "envId"], "pkg.module:Env", "module:id entry points are refused"),
        (["options", "envId"], "NoSuchEnv-v0", "unknown env_id 'NoSuchEnv-v0'"),
        (["options", "kwargs"], {"render_mode": "human"}, "kwargs ['render_mode'] are not"),
        (["env", "class"], "x:Y", "class is x:Y, but this configuration makes gymnasium"),
        (["env", "wrappers"], [], "wrappers are [], but this configuration makes ['TimeLimit'"),
        (["env", "np_random", "bit_generator"], "MT19937", "only PCG64 is restored"),
        (["env", "attributes", "state", "dtype"], "|O", "has dtype object"),
        (["env", "attributes", "state", "shape"], [5], "holds 32 bytes, not 5 x float64"),
        (["steps"], -3, "snapshot field steps is -3"),
    ],
)
def test_a_malformed_snapshot_is_refused_and_the_episode_stands(
    path: list[str], value: Any, message: str
) -> None:
    good = started(options("CartPole-v1")).snapshot()
    env = started(options("MountainCar-v0"))
    before = env.state()
    with pytest.raises(InvalidAction, match=re.escape(message)):
        env.restore(edited(good, path, value))
    assert env.state() == before
    assert Player(env, seed=0).play(env, 3)  # still steps


def test_an_ale_state_that_does_not_load_is_refused() -> None:
    good = started(options("ALE/Pong-v5"), steps=2).snapshot()
    env = GymnasiumEnvironment()
    with pytest.raises(InvalidAction, match=r"snapshot field env\.ale is not an ALE state"):
        env.restore(edited(good, ["env", "ale"], "AAAA"))
