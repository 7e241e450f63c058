"""The batch paths' fast cases answer as the general ones: integer rows checked without
numpy's error-state switch, the books kept with slices when the envs named are one run,
batch actions read by a decoder made once per space, and EnvPool stepped through its C++
send/recv without its Python wrapper."""

from __future__ import annotations

from typing import Any, ClassVar

import gymnasium
import numpy as np
import pytest
from gymnasium import spaces

from openenv_grpc import AutoresetMode
from openenv_grpc_envs.gymnasium.backends import rows_index
from openenv_grpc_envs.gymnasium.batch import GymnasiumBatch
from openenv_grpc_envs.gymnasium.batch_convert import (
    BatchDecoder,
    _bounds,
    _outside_rows,
    decode_batch,
    encode_stacked,
)
from openenv_grpc_envs.gymnasium.convert import ConversionError, fill_tensor
from openenv_grpc_envs.gymnasium.envpool_backend import RawStep, _infos
from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import (
    Backend,
    GymnasiumAction,
    GymnasiumResetOptions,
    Value,
)

SPACES = [
    spaces.Discrete(3, start=-1),
    spaces.MultiDiscrete([2, 5, 3]),
    spaces.MultiDiscrete([[2, 3], [4, 5]], start=[[1, 0], [0, -2]]),
    spaces.MultiBinary(4),
    spaces.Box(low=np.array([0, -3]), high=np.array([9, 3]), dtype=np.int8),
    spaces.Box(low=np.array([0, -3]), high=np.array([9, 3]), dtype=np.float64),
    spaces.Box(low=0, high=255, shape=(2, 3), dtype=np.uint8),
    spaces.Box(low=-1.0, high=1.0, shape=(3,), dtype=np.float32),
]


def _reference(array: np.ndarray, space: spaces.Space) -> np.ndarray:  # type: ignore[type-arg]
    low, high = _bounds(space)
    with np.errstate(invalid="ignore"):
        inside = np.asarray((array >= low) & (array <= high))
    if inside.ndim > 1:
        inside = inside.reshape(len(array), -1).all(axis=1)
    return np.logical_not(inside)


@pytest.mark.parametrize("space", SPACES, ids=lambda s: repr(s)[:40])
def test_rows_outside_a_space_are_found_as_before(space: spaces.Space) -> None:  # type: ignore[type-arg]
    rng = np.random.default_rng(0)
    rows = np.stack([space.sample() for _ in range(16)])
    if rows.dtype.kind != "f":  # out of range on either side: a type the values fit
        rows = rows.astype(np.int64)
    flat = rows.reshape(16, -1)  # a view: rows change with it
    if rows.dtype.kind == "f":
        flat[3, 0], flat[5, -1] = 99.0, np.nan
    else:
        flat[3, 0] = int(np.max(_bounds(space)[1])) + 1
        flat[5, -1] = int(np.min(_bounds(space)[0])) - 1
    rows = rows[rng.permutation(16)]
    got = _outside_rows(rows, space)
    assert got.dtype == np.bool_ and got.shape == (16,)
    assert got.tolist() == _reference(rows, space).tolist()
    assert got.sum() == 2


@pytest.mark.parametrize("mode", list(AutoresetMode))
def test_books_of_whole_and_partial_steps_agree(mode: AutoresetMode) -> None:
    """A stream stepped whole keeps the books a stream stepped in two halves keeps."""
    whole = GymnasiumBatch(8, mode, "CartPole-v1", Backend.BACKEND_GYMNASIUM)
    halves = GymnasiumBatch(8, mode, "CartPole-v1", Backend.BACKEND_GYMNASIUM)
    options = [GymnasiumResetOptions(env_id="CartPole-v1")] * 8
    for batch in (whole, halves):
        batch.reset(list(range(8)), list(range(8)), options)
    rng = np.random.default_rng(1)
    space = gymnasium.spaces.Discrete(2)
    for _ in range(60):
        actions = rng.integers(0, 2, 8)
        done_whole = whole._ended.copy()
        if mode is AutoresetMode.DISABLED and done_whole.any():
            ended = np.flatnonzero(done_whole).tolist()
            for batch in (whole, halves):
                batch.reset(ended, [None] * len(ended), [None] * len(ended))
        action = GymnasiumAction()
        encode_stacked(action.value, actions, space)
        whole.step(list(range(8)), action)
        for part in (range(4), range(4, 8)):
            half = GymnasiumAction()
            encode_stacked(half.value, actions[list(part)], space)
            halves.step(list(part), half)
        for name in ("_steps", "_returns", "_terminated", "_truncated", "_ended"):
            assert getattr(whole, name).tolist() == getattr(halves, name).tolist(), name
    assert whole._steps.max() > 0
    whole.close()
    halves.close()


def test_a_batch_view_reuses_the_last_layout_only_where_it_fits() -> None:
    """The vector stream parses a batch observation's wire layout once and matches the
    next ones against it; any other layout (rows, dtype, a second field) is parsed."""
    from google.protobuf import any_pb2

    from openenv_grpc_envs.gymnasium.adapters.vector_stream import VectorStream
    from openenv_grpc_envs.gymnasium.batch_convert import view_observation_bytes
    from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import GymnasiumObservation

    space = spaces.Box(-10.0, 10.0, (4,), np.float32)
    stream = VectorStream.__new__(VectorStream)  # only its view of batches is used here
    stream._observation_space = space
    stream._layout = None
    rng = np.random.default_rng(2)

    def payload(array: np.ndarray) -> any_pb2.Any:  # type: ignore[type-arg]
        observation = GymnasiumObservation()
        encode_stacked(observation.value, array, spaces.Box(-10.0, 10.0, array.shape[1:],
                                                            array.dtype))  # fmt: skip
        packed = any_pb2.Any()
        packed.Pack(observation)
        return packed

    for rows, dtype in [(8, np.float32), (8, np.float32), (3, np.float32), (8, np.float32),
                        (4, np.float64), (8, np.float32)]:  # fmt: skip
        array = rng.standard_normal((rows, 4)).astype(dtype)
        message = payload(array)
        want = view_observation_bytes(message.value)
        assert want is not None
        if dtype is np.float64:  # another dtype: the last layout does not fit it
            assert stream._layout is not None and not stream._layout.fits(message.value)
            continue
        got = stream._view(message, rows)
        assert got.dtype == want.dtype and got.shape == (rows, 4) and not got.flags.writeable
        assert got.tolist() == array.tolist()


def _decoded(call: Any) -> tuple[str, Any]:
    """What a decode answered or raised, comparable across two decoders."""
    try:
        batch, outside = call()
    except ConversionError as exc:
        return "raised", str(exc)
    assert batch.flags.writeable
    return "answered", (batch.dtype, batch.shape, batch.tolist(), outside.tolist())


@pytest.mark.parametrize("space", SPACES, ids=lambda s: repr(s)[:40])
def test_the_batch_decoder_answers_and_refuses_as_decode_batch(space: spaces.Space) -> None:  # type: ignore[type-arg]
    decoder = BatchDecoder(space)
    rng = np.random.default_rng(3)
    good = np.stack([space.sample() for _ in range(6)])
    good = good.astype(np.int64) if isinstance(space, spaces.Discrete) else good
    outside = good.copy()
    outside.reshape(6, -1)[2, 0] = 99
    values = []
    for array in (good, outside, good[:5], good.astype(np.float64), good.reshape(6, -1)[:, :1]):
        value = Value()
        fill_tensor(value.tensor, array)
        values.append(value)
    shaped = Value()
    shaped.CopyFrom(values[0])
    shaped.tensor.shape[:] = [3, 2, *good.shape[1:]]  # same bytes, other rows
    ints = Value()
    ints.ints.values[:] = rng.integers(0, 2, 6).tolist()
    values += [shaped, Value(), ints]
    for value in values:
        for rows in (6, 5):
            want = _decoded(lambda: decode_batch(value, space, rows))  # noqa: B023
            assert _decoded(lambda: decoder(value, rows)) == want  # noqa: B023


def test_rows_index_is_a_slice_for_a_run_only() -> None:
    assert rows_index([0, 1, 2, 3]) == slice(0, 4)
    assert rows_index([4, 5, 6, 7]) == slice(4, 8)
    assert rows_index([3]) == slice(3, 4)
    assert rows_index([0, 2, 3]).tolist() == [0, 2, 3]
    assert rows_index([]).tolist() == []


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1", "Acrobot-v1"])
def test_the_raw_envpool_step_answers_as_the_pools_own(env_id: str) -> None:
    """EnvPool's C++ send/recv without its Python wrapper: the same observations, rewards,
    flags and infos as ``pool.step`` for whole and partial steps (Acrobot has an info)."""
    envpool = pytest.importorskip("envpool")
    n = 6
    ours = envpool.make_gymnasium(env_id, num_envs=n, batch_size=n, env_seed=list(range(n)))
    theirs = envpool.make_gymnasium(env_id, num_envs=n, batch_size=n, env_seed=list(range(n)))
    try:
        raw = RawStep.of(ours)
        assert raw is not None
        ids = np.arange(n, dtype=np.int32)
        ours.reset(ids.copy())
        theirs.reset(ids.copy())
        rng = np.random.default_rng(4)
        for t in range(120):  # long enough for episodes to end and autoreset
            sub = ids if t % 3 else np.flatnonzero(rng.integers(0, 2, n)).astype(np.int32)
            if not len(sub):
                continue
            actions = np.stack([theirs.action_space.sample() for _ in sub])
            want = theirs.step(actions, sub.copy())
            got = raw.step(actions, sub.copy())
            for mine, other in zip(got[:4], want[:4], strict=True):
                assert mine.dtype == other.dtype and mine.tolist() == other.tolist()
            assert _infos(got[4], len(sub)) == _infos(want[4], len(sub))
            assert got[4]["env_id"].tolist() == sub.tolist()
    finally:
        ours.close()
        theirs.close()


def test_the_raw_envpool_step_leaves_other_layouts_to_the_wrapper() -> None:
    class Pool:  # a pool of another layout (two players per env)
        _action_keys = ("env_id", "players.env_id", "action")
        _state_keys = ("obs", "reward", "done", "trunc", "info:env_id")
        _spec = type("Spec", (), {"_action_spec": [(np.dtype(np.int32),)]})()
        config: ClassVar[dict[str, int]] = {"max_num_players": 2}

        def _send(self, actions: Any) -> None: ...
        def _recv(self) -> Any: ...

    assert RawStep.of(Pool()) is None
    Pool.config = {"max_num_players": 1}
    assert RawStep.of(Pool()) is not None
    Pool._state_keys = ("obs:rgb", "obs:depth", "reward", "done", "trunc", "info:env_id")
    assert RawStep.of(Pool()) is None  # a nested observation
    Pool._state_keys = ("obs", "reward", "done", "trunc", "info:env_id", "info:a.b")
    assert RawStep.of(Pool()) is None  # a nested info
    assert RawStep.of(object()) is None  # other internals
