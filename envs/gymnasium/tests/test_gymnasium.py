"""The gymnasium environment's behaviour through a real server and the typed client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import ale_py
import grpc
import gymnasium
import numpy as np
import pytest
from google.protobuf import struct_pb2

from openenv_grpc import EnvError
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.gymnasium import (
    GymnasiumAction,
    GymnasiumEnv,
    GymnasiumEnvironment,
    GymnasiumResetOptions,
    Tensor,
    Value,
    convert,
)

gymnasium.register_envs(ale_py)  # for the local reference runs of ALE/Pong-v5

FROZEN_LAKE_PATH = [1, 1, 2, 2, 1, 2]  # down, down, right, right, down, right: 0 -> 15


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """One server for the module, without a default env id."""
    process = ServerProcess("gymnasium", ["--max-concurrent-envs", "0"])
    yield process
    process.stop()


@pytest.fixture(scope="module")
def default_server() -> Iterator[ServerProcess]:
    """A server whose GYM_ENV_ID names FrozenLake."""
    process = ServerProcess("gymnasium", [], {"GYM_ENV_ID": "FrozenLake-v1"})
    yield process
    process.stop()


@pytest.fixture
def env(server: ServerProcess) -> Iterator[GymnasiumEnv]:
    with GymnasiumEnv(server.target) as session:
        yield session


def options(env_id: str, max_steps: int | None = None, **kwargs: Any) -> GymnasiumResetOptions:
    struct = struct_pb2.Struct()
    struct.update(kwargs)
    return GymnasiumResetOptions(env_id=env_id, max_episode_steps=max_steps, kwargs=struct)


def act(value: Any = None, **fields: Any) -> GymnasiumAction:
    """An action from a Value, or from Value's fields (``act(discrete=1)``)."""
    return GymnasiumAction(value=value if value is not None else Value(**fields))


def tensor(array: Any, dtype: str) -> Value:
    return Value(tensor=convert.to_tensor(np.asarray(array, dtype=dtype)))


def refused(env: GymnasiumEnv, action: GymnasiumAction) -> EnvError:
    with pytest.raises(EnvError) as failed:
        env.step(action)
    return failed.value


# -- episodes ------------------------------------------------------------------------------


def test_cartpole_episode_runs_to_termination(env: GymnasiumEnv) -> None:
    result = env.reset(seed=3, options=options("CartPole-v1"))
    rewards = []
    while not result.done:
        result = env.step(act(discrete=1))  # always push right: the pole falls
        rewards.append(result.reward)
    assert result.terminated and not result.truncated
    assert rewards == [1.0] * result.step_count and 5 < result.step_count < 30
    with pytest.raises(EnvError) as failed:
        env.step(act(discrete=1))
    assert failed.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert failed.value.message == "the episode has terminated: call reset to start a new one"
    state = env.state()
    assert state.terminated and state.episode_steps == result.step_count
    assert state.episode_return == float(result.step_count)


def test_reset_describes_the_spaces_and_steps_do_not(env: GymnasiumEnv) -> None:
    result = env.reset(seed=0, options=options("CartPole-v1"))
    description = result.observation.env
    assert description.env_id == "CartPole-v1"
    assert description.max_episode_steps == 500
    reference = gymnasium.make("CartPole-v1")
    assert convert.build_space(description.observation_space) == reference.observation_space
    assert convert.build_space(description.action_space) == reference.action_space
    assert description.action_space.discrete.n == 2
    stepped = env.step(act(discrete=0))
    assert not stepped.observation.HasField("env")
    assert env.state().env == description
    observation = convert.decode(stepped.observation.value)
    assert observation.dtype == np.float32 and observation.shape == (4,)


def test_frozen_lake_reaches_the_goal_on_a_known_path(env: GymnasiumEnv) -> None:
    result = env.reset(seed=0, options=options("FrozenLake-v1", is_slippery=False))
    assert result.observation.value.discrete == 0
    assert result.info == {"prob": 1.0}
    assert dict(result.observation.env.kwargs) == {"is_slippery": False}
    visited = []
    for move in FROZEN_LAKE_PATH:
        result = env.step(act(discrete=move))
        visited.append(result.observation.value.discrete)
    assert visited == [4, 8, 9, 10, 14, 15]
    assert (result.reward, result.terminated, result.truncated) == (1.0, True, False)
    state = env.state()
    assert state.last_observation.discrete == 15 and state.episode_return == 1.0


def test_mountain_car_is_truncated_by_the_step_limit(env: GymnasiumEnv) -> None:
    first = env.reset(seed=0, options=options("MountainCar-v0"))
    assert first.observation.env.max_episode_steps == 200  # the registry's limit
    for max_steps in (10, 10):  # the second reset reuses the configured env
        result = env.reset(seed=0, options=options("MountainCar-v0", max_steps=max_steps))
        assert result.observation.env.max_episode_steps == max_steps
        flags = []
        while not result.done:
            result = env.step(act(discrete=1))
            flags.append((result.terminated, result.truncated))
        assert flags == [(False, False)] * 9 + [(False, True)]
    assert env.state().truncated
    # No options: the same configuration again, limit included.
    result = env.reset(seed=1)
    assert result.observation.env.max_episode_steps == 10


def test_blackjack_tuple_observation_matches_a_local_run(env: GymnasiumEnv) -> None:
    result = env.reset(seed=11, options=options("Blackjack-v1"))
    space = convert.build_space(result.observation.env.observation_space)
    assert space == gymnasium.spaces.Tuple([gymnasium.spaces.Discrete(n) for n in (32, 11, 2)])
    local = gymnasium.make("Blackjack-v1")
    expected, _ = local.reset(seed=11)
    assert convert.decode(result.observation.value, space) == tuple(expected)
    stepped = env.step(act(discrete=0))  # stick: the dealer plays, the hand ends
    expected, reward, terminated, _, _ = local.step(0)
    assert convert.decode(stepped.observation.value, space) == tuple(expected)
    assert (stepped.reward, stepped.terminated) == (float(reward), terminated)


def test_pong_frames_match_a_local_run(env: GymnasiumEnv) -> None:
    result = env.reset(seed=5, options=options("ALE/Pong-v5"))
    tensor_message = result.observation.value.tensor
    assert (list(tensor_message.shape), tensor_message.dtype) == ([210, 160, 3], "uint8")
    assert len(tensor_message.data) == 210 * 160 * 3
    local = gymnasium.make("ALE/Pong-v5")
    expected, info = local.reset(seed=5)
    assert np.array_equal(convert.decode(result.observation.value), expected)
    assert result.info["seeds"] == [int(s) for s in info["seeds"]]
    for action in [2, 3, 2, 0, 5]:  # sticky actions too: both sides seeded the same
        stepped = env.step(act(discrete=action))
        expected, reward, *_ = local.step(action)
        assert np.array_equal(convert.decode(stepped.observation.value), expected)
        assert stepped.reward == reward
        # A step carries the frame and little else.
        assert stepped.observation.ByteSize() < 210 * 160 * 3 + 32
    assert not env.state().HasField("last_observation")  # too big for the state


def test_frameskip_within_its_bound_is_made_as_asked(env: GymnasiumEnv) -> None:
    """The step-work bound refuses 0, > 64 and non-counts (above); 64 reaches ALE, which
    plays the same frames as a local env made alike."""
    result = env.reset(seed=3, options=options("ALE/Pong-v5", frameskip=64))
    local = gymnasium.make("ALE/Pong-v5", frameskip=64)
    expected, _ = local.reset(seed=3)
    assert np.array_equal(convert.decode(result.observation.value), expected)
    stepped = env.step(act(discrete=2))
    assert np.array_equal(convert.decode(stepped.observation.value), local.step(2)[0])
    local.close()


def test_lunar_lander_runs(env: GymnasiumEnv) -> None:
    # box2d comes with the gymnasium extra (gymnasium[box2d]); CI installs it.
    result = env.reset(seed=2, options=options("LunarLander-v3"))
    local = gymnasium.make("LunarLander-v3")
    expected, _ = local.reset(seed=2)
    assert np.array_equal(convert.decode(result.observation.value), expected)
    stepped = env.step(act(discrete=2))
    assert stepped.reward == float(local.step(2)[1])


def test_continuous_actions_accept_float64_and_ints(env: GymnasiumEnv) -> None:
    env.reset(seed=0, options=options("MountainCarContinuous-v0"))
    assert env.step(act(tensor([0.5], "float64"))).step_count == 1  # rounded to float32
    assert env.step(act(tensor([1], "int64"))).step_count == 2


def test_seeded_episodes_repeat_and_seeds_differ(env: GymnasiumEnv) -> None:
    def play(seed: int) -> list[bytes]:
        result = env.reset(seed=seed, options=options("CartPole-v1"))
        trace = [result.observation.value.tensor.data]
        for move in [0, 1, 1, 0, 1]:
            trace.append(env.step(act(discrete=move)).observation.value.tensor.data)
        return trace

    assert play(42) == play(42)
    assert play(42) != play(43)
    assert env.state().seed == 43


# -- errors --------------------------------------------------------------------------------

CARTPOLE = "CartPole-v1"
CAR = "MountainCarContinuous-v0"
BOX = "Box(-1.0, 1.0, (1,), float32)"


@pytest.mark.parametrize(
    ("env_id", "action", "message"),
    [
        (CARTPOLE, act(discrete=2), "action: 2 is out of range for Discrete(2) (valid: 0..1)"),
        (CARTPOLE, act(discrete=-1), "action: -1 is out of range for Discrete(2) (valid: 0..1)"),
        (CARTPOLE, act(tensor([1], "int64")), "action: Discrete(2) takes `discrete`, got `tensor`"),
        (CARTPOLE, act(Value()), "action: Discrete(2) takes `discrete`, got an empty Value"),
        (CAR, act(discrete=1), f"action: {BOX} takes `tensor`, got `discrete`"),
        (
            CAR,
            act(tensor([0.1, 0.2], "float32")),
            f"action: shape [2] does not match {BOX} (shape [1])",
        ),
        (
            CAR,
            act(tensor([2.0], "float32")),
            f"action: element [0] 2.0 is outside [-1.0, 1.0] of {BOX}",
        ),
        (
            CAR,
            act(tensor([np.nan], "float32")),
            f"action: element [0] nan is outside [-1.0, 1.0] of {BOX}",
        ),
        (
            CAR,
            act(tensor=Tensor(data=b"\x00\x00\x00", shape=[1], dtype="float32")),
            "action: 3 bytes of data for shape [1] float32 (expected 4)",
        ),
        (
            CAR,
            act(tensor=Tensor(data=b"\x00" * 8, shape=[1], dtype="complex64")),
            "action: unknown dtype 'complex64'; expected one of bool, float16, float32, "
            "float64, int16, int32, int64, int8, uint16, uint32, uint64, uint8",
        ),
    ],
)
def test_invalid_actions_are_refused_and_the_episode_goes_on(
    env: GymnasiumEnv, env_id: str, action: GymnasiumAction, message: str
) -> None:
    env.reset(seed=0, options=options(env_id))
    error = refused(env, action)
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert error.message == message
    assert error.exception_type == "openenv_grpc.environment.InvalidAction"
    assert env.step(act(_valid(env_id))).step_count == 1


def _valid(env_id: str) -> Value:
    return Value(discrete=0) if env_id == "CartPole-v1" else tensor([0.0], "float32")


@pytest.mark.parametrize(
    ("reset_options", "message"),
    [
        (
            options("NoSuchEnv-v0"),
            "unknown env_id 'NoSuchEnv-v0': Environment `NoSuchEnv` doesn't exist.",
        ),
        (
            options("CartPole-v9"),
            "unknown env_id 'CartPole-v9': Environment version `v9` for environment `CartPole` "
            "doesn't exist. It provides versioned environments: [ `v0`, `v1` ].",
        ),
        (
            options("os:CartPole-v1"),
            "env_id 'os:CartPole-v1' must be a registered id; module:id entry points are refused",
        ),
        (
            options("CartPole-v1", max_steps=0),
            "max_episode_steps must be at least 1 (leave it unset for the registry's limit)",
        ),
        (
            options("CartPole-v1", render_mode="human"),
            "kwargs ['render_mode'] are not allowed (use the render_mode and "
            "max_episode_steps fields)",
        ),
        (
            options("ALE/Pong-v5", frameskip=1e9),
            "kwargs frameskip=1000000000: must be a whole number from 1 to 64: it multiplies "
            "the work of every step",
        ),
        (
            options("ALE/Pong-v5", frameskip=[2, 5]),
            "kwargs frameskip=[2, 5]: must be a whole number from 1 to 64: it multiplies the "
            "work of every step",
        ),
        (
            options("ALE/Pong-v5", frameskip=0),
            "kwargs frameskip=0: must be a whole number from 1 to 64: it multiplies the work "
            "of every step",
        ),
        (
            options("FrozenLake-v1", map_name="9x9"),
            "kwarg map_name='9x9' is not served for 'FrozenLake-v1': map_name must be one of "
            "'4x4', '8x8'",
        ),
    ],
)
def test_refused_reset_options_leave_the_episode_running(
    env: GymnasiumEnv, reset_options: GymnasiumResetOptions, message: str
) -> None:
    first = env.reset(seed=0, options=options("CartPole-v1"))
    env.step(act(discrete=0))
    with pytest.raises(EnvError) as failed:
        env.reset(seed=0, options=reset_options)
    assert failed.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert failed.value.message == message
    stepped = env.step(act(discrete=0))
    assert (stepped.step_count, stepped.episode_id) == (2, first.episode_id)
    assert env.state().env.env_id == "CartPole-v1"


def test_bad_kwargs_and_missing_dependencies_are_named(env: GymnasiumEnv) -> None:
    with pytest.raises(EnvError) as failed:
        env.reset(options=options("CartPole-v1", bogus=1))
    assert failed.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert failed.value.message == (
        "kwarg 'bogus' is not served for 'CartPole-v1': it takes sutton_barto_reward on this "
        "server (an env's constructor arguments are allowed per env, with bounds)"
    )
    # Within its allowlist bounds, the constructor still has the last word.
    with pytest.raises(EnvError) as failed:
        env.reset(options=options("ALE/Pong-v5", mode=255))
    assert failed.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert failed.value.message == (
        "cannot make 'ALE/Pong-v5' with kwargs {'mode': 255}: RuntimeError: "
        "Invalid game mode requested"
    )
    with pytest.raises(EnvError) as failed:
        env.reset(options=options("phys2d/CartPole-v1"))  # needs jax
    assert failed.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert failed.value.message.startswith(
        "env_id 'phys2d/CartPole-v1' needs a package this server lacks: "
    )


def test_reset_without_an_env_id_or_default_is_refused(env: GymnasiumEnv) -> None:
    assert env.state().default_env_id == ""
    with pytest.raises(EnvError) as failed:
        env.reset(seed=0)
    assert failed.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert failed.value.message == (
        "no environment chosen: set GymnasiumResetOptions.env_id (or start the server with "
        "GYM_ENV_ID)"
    )


def test_the_default_env_id_comes_from_the_server(default_server: ServerProcess) -> None:
    with GymnasiumEnv(default_server.target) as env:
        before = env.state()
        assert before.default_env_id == "FrozenLake-v1" and not before.HasField("env")
        result = env.reset(seed=0)
        assert result.observation.env.env_id == "FrozenLake-v1"
        # Options without an env_id keep the env, with their own kwargs.
        result = env.reset(seed=0, options=options("", is_slippery=False))
        assert result.observation.env.env_id == "FrozenLake-v1"
        for move in FROZEN_LAKE_PATH:
            result = env.step(act(discrete=move))
        assert result.terminated and result.reward == 1.0
        # Another env id on the same session, then back to the default's config.
        assert env.reset(options=options("CartPole-v1")).observation.env.env_id == "CartPole-v1"
        result = env.reset(options=options(""))
        assert result.observation.env.env_id == "CartPole-v1"  # empty id: the current one


def test_a_neighbour_is_unaffected_by_errors(server: ServerProcess) -> None:
    def play(session: GymnasiumEnv, noisy: bool) -> list[bytes]:
        result = session.reset(seed=9, options=options("CartPole-v1"))
        trace = [result.observation.value.tensor.data]
        for move in [1, 0, 0, 1]:
            if noisy:
                for bad in (act(discrete=7), act(tensor([1.0], "float32"))):
                    with pytest.raises(EnvError):
                        session.step(bad)
                with pytest.raises(EnvError):
                    session.reset(options=options("NoSuchEnv-v0"))
            trace.append(session.step(act(discrete=move)).observation.value.tensor.data)
        return trace

    with GymnasiumEnv(server.target) as noisy, GymnasiumEnv(server.target) as quiet:
        noisy.reset(seed=1, options=options("ALE/Pong-v5"))  # a different env alongside
        quiet_trace = play(quiet, noisy=False)
        noisy_trace = play(noisy, noisy=True)
        assert quiet_trace == noisy_trace
        assert quiet.state().episode_steps == 4


# -- in-process: what the wire cannot show ------------------------------------------------


def test_switching_env_closes_the_old_one() -> None:
    environment = GymnasiumEnvironment()
    try:
        environment.reset(seed=0, episode_id="a", options=options("CartPole-v1"))
        old = environment._env
        assert old is not None
        closed: list[bool] = []
        original = old.close

        def spy() -> None:
            closed.append(True)
            original()

        old.close = spy  # type: ignore[method-assign]
        environment.reset(seed=0, episode_id="b", options=None)  # same config: kept
        assert environment._env is old and not closed
        environment.reset(seed=0, episode_id="c", options=options("FrozenLake-v1"))
        assert environment._env is not old and closed == [True]
    finally:
        environment.close()
    assert environment._env is None
