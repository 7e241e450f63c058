"""The EnvPool backend in process: what it shares with Gymnasium's semantics and where it
differs (seeding, spaces, infos), pinned; choosing it by reset option or server setting."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import envpool
import gymnasium
import numpy as np
import pytest

from openenv_grpc import AutoresetMode, BatchTransition, InvalidAction
from openenv_grpc_envs.gymnasium import GymnasiumEnvironment, convert
from openenv_grpc_envs.gymnasium.adapters import reset_options
from openenv_grpc_envs.gymnasium.batch import BACKEND_VARIABLE, GymnasiumBatch
from openenv_grpc_envs.gymnasium.batch_convert import encode_rows, view_batch
from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import (
    Backend,
    GymnasiumAction,
    GymnasiumObservation,
    GymnasiumResetOptions,
    Value,
)

N = 4
ALL = list(range(N))


def pool_options(env_id: str = "CartPole-v1", **fields: Any) -> GymnasiumResetOptions:
    options = reset_options(env_id, fields.pop("max_episode_steps", None))
    options.backend = fields.pop("backend", Backend.BACKEND_ENVPOOL)
    return options


@pytest.fixture
def batch() -> Iterator[GymnasiumBatch]:
    made = GymnasiumEnvironment.make_batch(N, AutoresetMode.NEXT_STEP)
    yield made
    made.close()


def observations(batch: GymnasiumBatch, result: BatchTransition[GymnasiumObservation]) -> Any:
    space = batch._require_backend().observation_space
    return np.array(view_batch(result.observation.value, space, len(result.rewards)))


def step(batch: GymnasiumBatch, actions: list[int], indices: list[int] | None = None) -> Any:
    value = Value(tensor=convert.to_tensor(np.array(actions, dtype=np.int64)))
    return batch.step(indices or ALL, GymnasiumAction(value=value))


def test_envpool_serves_the_batch_and_says_so(batch: GymnasiumBatch) -> None:
    assert not batch.computes_in_threads()  # no backend yet
    result = batch.reset(ALL, [10, 11, 12, 13], [pool_options()] * N)
    assert result.observation.env.backend == Backend.BACKEND_ENVPOOL
    assert batch.computes_in_threads()  # EnvPool's workers: judged by process CPU
    assert batch.state(2).env.backend == Backend.BACKEND_ENVPOOL and batch.state(2).seed == 12
    # The same pool, made in process with the same seeds, steps identically.
    ref = envpool.make_gymnasium("CartPole-v1", num_envs=N, batch_size=N, env_seed=[10, 11, 12, 13])
    try:
        ref_obs, _ = ref.reset()
        assert np.array_equal(observations(batch, result), ref_obs)
        rng = np.random.default_rng(0)
        for _ in range(40):
            actions = rng.integers(2, size=N).tolist()
            got = step(batch, actions)
            want = ref.step(np.array(actions))
            assert np.array_equal(observations(batch, got), want[0])
            assert got.rewards == want[1].astype(np.float64).tolist()
            assert got.terminated == want[2].tolist() and got.truncated == want[3].tolist()
            assert got.infos is None  # EnvPool's env_id/players/elapsed_step are dropped
    finally:
        ref.close()


def test_seeding_differs_from_gymnasium_but_repeats(batch: GymnasiumBatch) -> None:
    """Pinned difference: the same seed gives other episodes than gymnasium.make (other
    generators); the same seeds give the same episodes again."""
    first = observations(batch, batch.reset(ALL, [0, 1, 2, 3], [pool_options()] * N))
    gym = np.stack([gymnasium.make("CartPole-v1").reset(seed=i)[0] for i in ALL])
    assert not np.allclose(first, gym)
    again = observations(batch, batch.reset(ALL, [0, 1, 2, 3], [None] * N))  # a new pool
    assert np.array_equal(first, again)
    unseeded = observations(batch, batch.reset(ALL, [None] * N, [None] * N))  # continues
    assert not np.array_equal(unseeded, first)
    with pytest.raises(InvalidAction, match="seeds its whole pool at once"):
        batch.reset([1], [5], [None])
    partial = batch.reset([1], [None], [None])  # unseeded partial resets are fine
    assert len(partial.rewards) == 1


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1", "MountainCar-v0"])
def test_classic_control_spaces_match_gymnasium_rewards_are_float32(
    batch: GymnasiumBatch, env_id: str
) -> None:
    """Same spaces as Gymnasium (a vector env does not change shape with the backend);
    pinned difference: rewards are EnvPool's float32 values, widened."""
    result = batch.reset(ALL, [None] * N, [pool_options(env_id)] * N)
    local = gymnasium.make(env_id)
    description = result.observation.env
    assert convert.build_space(description.observation_space) == local.observation_space
    assert convert.build_space(description.action_space) == local.action_space
    assert description.max_episode_steps == local.spec.max_episode_steps  # type: ignore[union-attr]
    space = batch._require_backend().action_space
    value = Value()
    encode_rows(value, [space.sample() for _ in ALL], space)
    rewards = batch.step(ALL, GymnasiumAction(value=value)).rewards
    assert all(float(np.float32(r)) == r for r in rewards)


def test_next_step_autoreset_is_gymnasiums(batch: GymnasiumBatch) -> None:
    batch.reset(ALL, [0, 1, 2, 3], [pool_options(max_episode_steps=3)] * N)
    for _ in range(2):
        assert step(batch, [1] * N).reset is None
    ended = step(batch, [1] * N)
    assert ended.truncated == [True] * N and ended.reset is None
    # Env 0 steps alone: it is reset instead (reward 0, flags False), the others wait.
    alone = step(batch, [0], [0])
    assert alone.reset == [True] and alone.rewards == [0.0] and alone.truncated == [False]
    assert batch.state(0).episode_steps == 0 and batch.state(1).truncated
    rest = step(batch, [1, 1, 1, 1])
    assert rest.reset == [False, True, True, True] and rest.rewards == [1.0, 0.0, 0.0, 0.0]


def test_same_step_autoreset_hands_the_final_observations() -> None:
    batch = GymnasiumEnvironment.make_batch(N, AutoresetMode.SAME_STEP)
    try:
        batch.reset(ALL, [0, 1, 2, 3], [pool_options(max_episode_steps=2)] * N)
        step(batch, [1] * N)
        ended = step(batch, [1] * N)
        assert ended.truncated == [True] * N and ended.reset == [True] * N
        assert ended.final_observation is not None
        space = batch._require_backend().observation_space
        final = view_batch(ended.final_observation.value, space, N)
        first = observations(batch, ended)
        assert np.all(np.abs(first) <= 0.05) and not np.allclose(final, first)
        after = step(batch, [1] * N)  # a normal step: the pending reset was cleared
        assert after.reset is None and batch.state(0).episode_steps == 1
    finally:
        batch.close()


def test_auto_and_the_server_setting_choose_the_backend(
    batch: GymnasiumBatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    auto = Backend.BACKEND_AUTO
    result = batch.reset(ALL, [None] * N, [pool_options(backend=auto)] * N)
    assert result.observation.env.backend == Backend.BACKEND_ENVPOOL
    result = batch.reset(ALL, [None] * N, [pool_options("Taxi-v4", backend=auto)] * N)
    assert result.observation.env.backend == Backend.BACKEND_GYMNASIUM  # EnvPool lacks it
    monkeypatch.setenv(BACKEND_VARIABLE, "envpool")
    served = GymnasiumEnvironment.make_batch(2, AutoresetMode.NEXT_STEP)
    try:
        result = served.reset([0, 1], [None] * 2, [reset_options("CartPole-v1")] * 2)
        assert result.observation.env.backend == Backend.BACKEND_ENVPOOL
    finally:
        served.close()
    monkeypatch.setenv(BACKEND_VARIABLE, "warp-drive")
    with pytest.raises(InvalidAction, match="GYM_VECTOR_BACKEND='warp-drive'"):
        GymnasiumEnvironment.make_batch(2, AutoresetMode.NEXT_STEP)


def test_what_envpool_cannot_do_is_refused(batch: GymnasiumBatch) -> None:
    with pytest.raises(InvalidAction, match="EnvPool does not serve 'Taxi-v4'"):
        batch.reset(ALL, [None] * N, [pool_options("Taxi-v4")] * N)
    rendering = pool_options()
    rendering.render_mode = "rgb_array"
    with pytest.raises(InvalidAction, match="does not render"):
        batch.reset(ALL, [None] * N, [rendering] * N)
    with pytest.raises(InvalidAction, match=r"seeds 0\.\.2147483647"):
        batch.reset(ALL, [2**40] * N, [pool_options()] * N)
    assert batch.description is None  # nothing was made
    single = GymnasiumEnvironment()
    with pytest.raises(InvalidAction, match="vector streams only"):
        single.reset(seed=None, episode_id="e", options=pool_options())
    single.close()
