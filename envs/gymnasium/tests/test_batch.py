"""The native batch in process: ``GymnasiumEnvironment.make_batch`` against Gymnasium's own
``SyncVectorEnv``, step for step, in the three autoreset modes, for a discrete, a Box and
an image env; partial batches by index; per-index errors; the generic path's
join/split. (The same through real servers and the vector stream: tests/test_adapters.py.)"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode as GymAutoresetMode
from gymnasium.vector import SyncVectorEnv

from openenv_grpc import AutoresetMode, BatchTransition, InvalidAction
from openenv_grpc_envs.gymnasium import GymnasiumEnvironment, convert
from openenv_grpc_envs.gymnasium.adapters import reset_options
from openenv_grpc_envs.gymnasium.batch import GymnasiumBatch
from openenv_grpc_envs.gymnasium.batch_convert import (
    encode_rows,
    view_batch,
    view_observation_bytes,
)
from openenv_grpc_envs.gymnasium.configuration import register_ale
from openenv_grpc_envs.gymnasium.convert import ConversionError
from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import (
    GymnasiumAction,
    GymnasiumObservation,
    Value,
)

MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]
GYM_MODES = {
    AutoresetMode.NEXT_STEP: GymAutoresetMode.NEXT_STEP,
    AutoresetMode.SAME_STEP: GymAutoresetMode.SAME_STEP,
    AutoresetMode.DISABLED: GymAutoresetMode.DISABLED,
}
# (id, make kwargs, step limit, steps): CartPole (Box obs, Discrete actions), Pendulum
# (Box actions; short limit so episodes end), Pong frames (uint8 210x160x3).
CASES = {
    "cartpole": ("CartPole-v1", {}, None, 80),
    "pendulum": ("Pendulum-v1", {}, 7, 30),
    "pong": ("ALE/Pong-v5", {"frameskip": 4}, 6, 15),
}


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) or (isinstance(a, np.ndarray) and a.dtype.kind == "O"):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))


class Driver:
    """What a vector client does with a batch: assembles Gymnasium's batched tuples."""

    def __init__(self, batch: GymnasiumBatch, num_envs: int) -> None:
        self.batch, self.num_envs = batch, num_envs
        self.ended = np.zeros(num_envs, dtype=bool)

    @property
    def space(self) -> gymnasium.Space[Any]:
        assert self.batch.description is not None
        return convert.build_space(self.batch.description.observation_space)

    def view(self, observation: GymnasiumObservation, rows: int) -> Any:
        return view_batch(observation.value, self.space, rows)

    def infos(self, result: BatchTransition[GymnasiumObservation], rows: Sequence[int]) -> Any:
        vec = gymnasium.vector.VectorEnv()
        vec.num_envs = self.num_envs
        infos: dict[str, Any] = {}
        finals = iter(range(len(rows)))
        final = None
        if result.final_observation is not None:
            final = self.view(result.final_observation, sum(result.reset or []))
        for row, i in enumerate(rows):
            if result.reset and result.reset[row] and final is not None:
                j = next(finals)
                assert result.final_infos is not None
                ended = {"final_obs": final[j], "final_info": dict(result.final_infos[j] or {})}
                infos = vec._add_info(infos, ended, i)
            info = result.infos[row] if result.infos else None
            infos = vec._add_info(infos, dict(info or {}), i)
        return infos

    def reset(self, seed: int) -> tuple[Any, Any]:
        indices = list(range(self.num_envs))
        result = self.batch.reset(indices, [seed + i for i in indices], [None] * self.num_envs)
        assert not result.errors
        self.ended[:] = False
        return self.view(result.observation, self.num_envs), self.infos(result, indices)

    def step(self, actions: Any) -> tuple[Any, ...]:
        indices = list(range(self.num_envs))
        value = Value()
        encode_rows(value, list(actions), self.batch._require_backend().action_space)
        result = self.batch.step(indices, GymnasiumAction(value=value))
        assert not result.errors, result.errors
        terms = np.array(result.terminated, dtype=bool)
        truncs = np.array(result.truncated, dtype=bool)
        return (
            self.view(result.observation, self.num_envs),
            np.array(result.rewards, dtype=np.float64),
            terms,
            truncs,
            self.infos(result, indices),
        )


def make_batch(
    env_id: str, kwargs: dict[str, Any], steps: int | None, num_envs: int, mode: AutoresetMode
) -> GymnasiumBatch:
    batch = GymnasiumEnvironment.make_batch(num_envs, mode)
    options = reset_options(env_id, steps, kwargs)
    batch.reset(list(range(num_envs)), [None] * num_envs, [options] * num_envs)
    return batch


@pytest.fixture
def closing() -> Iterator[Callable[[Any], Any]]:
    opened: list[Any] = []
    yield lambda thing: opened.append(thing) or thing
    for thing in opened:
        thing.close()


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("case", list(CASES))
def test_batch_equals_sync_vector_env(
    case: str, mode: AutoresetMode, closing: Callable[[Any], Any]
) -> None:
    env_id, kwargs, limit, steps = CASES[case]
    register_ale()
    num_envs = 3
    local = closing(
        SyncVectorEnv(
            [lambda: gymnasium.make(env_id, max_episode_steps=limit, **kwargs)] * num_envs,
            autoreset_mode=GYM_MODES[mode],
        )
    )
    driver = Driver(closing(make_batch(env_id, kwargs, limit, num_envs, mode)), num_envs)
    obs, infos = driver.reset(seed=3)
    ref, ref_infos = local.reset(seed=3)
    assert equal(obs, ref) and equal(infos, ref_infos)
    assert obs.dtype == ref.dtype and not obs.flags.writeable  # a view of the message bytes
    local.action_space.seed(5)
    ended = 0
    for _ in range(steps):
        actions = local.action_space.sample()
        got = driver.step(actions)
        want = local.step(actions)
        for name, a, b in zip(
            ("obs", "rewards", "terms", "truncs", "infos"), got, want, strict=True
        ):
            assert equal(a, b), (name, a, b)
        terms, truncs = want[2], want[3]
        ended += int(terms.sum() + truncs.sum())
        if mode is AutoresetMode.DISABLED and (terms | truncs).any():
            mask = terms | truncs
            indices = [int(i) for i in np.flatnonzero(mask)]
            result = driver.batch.reset(indices, [None] * len(indices), [None] * len(indices))
            local_obs, _ = local.reset(options={"reset_mask": mask})
            assert equal(driver.view(result.observation, len(indices)), local_obs[mask])
    assert ended >= 2  # autoreset (or the DISABLED resets) ran


def test_partial_steps_keep_the_others_and_their_pending_autoreset(
    closing: Callable[[Any], Any],
) -> None:
    """Stepping a subset by index leaves the other envs as they were, and an env that
    ended is reset on *its* next step, however many calls left it out."""
    batch = closing(make_batch("CartPole-v1", {}, 2, 3, AutoresetMode.NEXT_STEP))
    local = [closing(gymnasium.make("CartPole-v1", max_episode_steps=2)) for _ in range(3)]
    batch.reset([0, 1, 2], [0, 1, 2], [None] * 3)
    for i, env in enumerate(local):
        env.reset(seed=i)
    space = batch._require_backend().action_space

    def step(indices: list[int]) -> BatchTransition[GymnasiumObservation]:
        value = Value()
        encode_rows(value, [1] * len(indices), space)
        return batch.step(indices, GymnasiumAction(value=value))

    for _ in range(2):
        result = step([0, 2])
        ref = [local[i].step(1) for i in (0, 2)]
    assert result.truncated == [True, True]  # both truncated at their 2nd step
    space_obs = local[0].observation_space
    assert equal(view_batch(result.observation.value, space_obs, 2), [r[0] for r in ref])
    result = step([1])  # env 1 steps alone; 0 and 2 keep their pending reset
    assert result.reset is None and result.truncated == [False]
    assert equal(view_batch(result.observation.value, space_obs, 1)[0], local[1].step(1)[0])
    result = step([2])
    assert result.reset == [True] and result.rewards == [0.0]  # reset instead of stepped
    assert batch.state(2).episode_steps == 0 and batch.state(0).truncated


def test_bad_rows_answer_for_their_index_and_bad_batches_for_the_request(
    closing: Callable[[Any], Any],
) -> None:
    batch = closing(make_batch("CartPole-v1", {}, None, 3, AutoresetMode.NEXT_STEP))
    batch.reset([0, 1, 2], [0, 1, 2], [None] * 3)
    action = GymnasiumAction(value=Value(tensor=convert.to_tensor(np.array([0, 5, 1]))))
    result = batch.step([0, 1, 2], action)
    assert result.errors is not None and set(result.errors) == {1}
    assert isinstance(result.errors[1], InvalidAction)
    assert "5 is outside [0, 1]" in str(result.errors[1])
    assert len(result.rewards) == 2 and batch.state(1).episode_steps == 0  # not stepped
    assert batch.state(0).episode_steps == 1
    for bad, match in [
        (np.array([0, 1]), r"shape \[2\] does not match 3 rows"),
        (np.array([0.0, 1.0, 0.0]), "float64 cannot be cast to int64"),
    ]:
        with pytest.raises(InvalidAction, match=match):
            batch.step([0, 1, 2], GymnasiumAction(value=Value(tensor=convert.to_tensor(bad))))
    with pytest.raises(InvalidAction, match="takes `tensor` or `ints`"):
        batch.step([0, 1, 2], GymnasiumAction(value=Value(discrete=1)))
    assert batch.state(0).episode_steps == 1  # refused requests stepped nothing


def test_an_env_that_raises_answers_for_its_index_only(closing: Callable[[Any], Any]) -> None:
    batch = closing(make_batch("CartPole-v1", {}, None, 3, AutoresetMode.NEXT_STEP))
    batch.reset([0, 1, 2], [0, 1, 2], [None] * 3)
    backend = batch._require_backend()

    def broken(action: Any) -> Any:
        raise RuntimeError("physics exploded")

    backend._envs[1].step = broken  # type: ignore[attr-defined]
    value = Value(tensor=convert.to_tensor(np.array([0, 1, 1])))
    result = batch.step([0, 1, 2], GymnasiumAction(value=value))
    assert result.errors is not None and list(result.errors) == [1]
    assert str(result.errors[1]) == "physics exploded"
    assert len(result.rewards) == 2
    assert view_batch(result.observation.value, backend.observation_space, 2).shape == (2, 4)


def test_configuration_is_one_per_batch(closing: Callable[[Any], Any]) -> None:
    batch = closing(make_batch("CartPole-v1", {}, None, 2, AutoresetMode.NEXT_STEP))
    other = reset_options("Acrobot-v1")
    with pytest.raises(InvalidAction, match="needs a reset of all 2 envs"):
        batch.reset([0], [None], [other])
    with pytest.raises(InvalidAction, match="run one configuration"):
        batch.reset([0, 1], [None, None], [other, reset_options("CartPole-v1")])
    with pytest.raises(InvalidAction, match="unknown env_id"):
        batch.reset([0, 1], [None, None], [reset_options("NoSuch-v0")] * 2)
    assert batch.description is not None and batch.description.env_id == "CartPole-v1"
    assert batch.cost_class() == "CartPole-v1/BACKEND_GYMNASIUM/2"  # measured placement
    assert not batch.computes_in_threads()  # gymnasium envs: judged by their waits
    result = batch.reset([0, 1], [1, 2], [other, other])
    assert result.observation.env.env_id == "Acrobot-v1"
    assert batch.state(1).seed == 2 and batch.state(1).env.env_id == "Acrobot-v1"


def test_join_and_split_serve_per_env_clients(closing: Callable[[Any], Any]) -> None:
    """The generic path: one payload per env in, one observation per env out."""
    batch = closing(make_batch("Blackjack-v1", {}, None, 3, AutoresetMode.NEXT_STEP))
    result = batch.reset([0, 1, 2], [4, 5, 6], [None] * 3)
    local = [closing(gymnasium.make("Blackjack-v1")) for _ in range(3)]
    refs = [env.reset(seed=4 + i)[0] for i, env in enumerate(local)]
    space = convert.build_space(result.observation.env.observation_space)
    split = batch.split_observation(result.observation, 3)
    assert all(s.env.env_id == "Blackjack-v1" for s in split)  # reset rows describe the env
    assert [convert.decode(s.value, space) for s in split] == refs
    actions = [GymnasiumAction(value=Value(discrete=0)) for _ in range(3)]
    result = batch.step([0, 1, 2], batch.join_actions(actions))
    refs = [env.step(0)[0] for env in local]
    assert [
        convert.decode(s.value, space) for s in batch.split_observation(result.observation, 3)
    ] == refs
    with pytest.raises(InvalidAction, match=r"actions\[1\]: Discrete\(2\) takes `discrete`"):
        batch.join_actions(
            [actions[0], GymnasiumAction(value=Value(tensor=convert.to_tensor(np.zeros(1))))]
        )


def test_state_and_rendering(closing: Callable[[Any], Any]) -> None:
    batch = closing(GymnasiumEnvironment.make_batch(2, AutoresetMode.NEXT_STEP))
    options = reset_options("CartPole-v1")
    options.render_mode = "rgb_array"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch.reset([0, 1], [7, 8], [options, options])
    state = batch.state(1)
    assert state.env.render_mode == "rgb_array" and state.seed == 8
    frame = convert.to_numpy(state.frame)
    assert frame.dtype == np.uint8 and frame.shape == (400, 600, 3)
    local = gymnasium.make("CartPole-v1")
    assert equal(convert.decode(state.last_observation), local.reset(seed=8)[0])
    options.render_mode = "human"
    with pytest.raises(InvalidAction, match="no display"):
        batch.reset([0, 1], [None, None], [options, options])


def test_observation_bytes_are_viewed_in_place_or_refused() -> None:
    """The client's one-copy path: a one-tensor batch observation is viewed inside the
    received bytes; other values fall back to parsing; malformed bytes are refused."""
    frames = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    message = GymnasiumObservation(value=Value(tensor=convert.to_tensor(frames)))
    message.env.env_id = "ALE/Pong-v5"  # a reset's description is skipped over
    data = message.SerializeToString()
    view = view_observation_bytes(data)
    assert view is not None and np.array_equal(view, frames) and not view.flags.writeable
    assert np.shares_memory(view, np.frombuffer(data, dtype=np.uint8))  # no copy
    discrete = GymnasiumObservation(value=Value(discrete=1))
    assert view_observation_bytes(discrete.SerializeToString()) is None
    tuple_value = GymnasiumObservation()
    tuple_value.value.tuple.SetInParent()
    assert view_observation_bytes(tuple_value.SerializeToString()) is None
    with pytest.raises(ConversionError, match="truncated"):
        view_observation_bytes(data[:-5])
    short = GymnasiumObservation(value=Value(tensor=convert.to_tensor(frames)))
    short.value.tensor.data = b"\x00" * 5
    with pytest.raises(ConversionError, match="5 bytes of data for shape"):
        view_observation_bytes(short.SerializeToString())
    with pytest.raises(ConversionError, match="malformed varint"):
        view_observation_bytes(b"\x0a\xff")
