"""Hostile Tensors (issue 19, break 3): a ~30-byte Tensor whose shape numpy cannot make
(``[1] * 100``: "maximum supported dimension ... 64"; ``[0, 2**62]``: "array is too big")
was INTERNAL and ended the episode; on a native CartPole vector batch all 4 envs were
lost. Every Tensor's rank, shape and byte length is now checked against the declared
space before numpy sees it: INVALID_ARGUMENT naming the field and what it accepts, and
the episode (or the batch's other envs) goes on. Real servers on loopback."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from openenv_grpc import EnvError
from openenv_grpc.codec import pack
from openenv_grpc.console import tensors as console_tensors
from openenv_grpc.testing import ServerProcess
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc_envs.gymnasium import (
    GymnasiumAction,
    GymnasiumEnv,
    GymnasiumResetOptions,
    Tensor,
    Value,
    convert,
)
from openenv_grpc_envs.gymnasium.batch_convert import view_observation_bytes
from openenv_grpc_envs.gymnasium.convert import ConversionError
from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import GymnasiumObservation
from openenv_grpc_envs.openspiel import client as openspiel_client
from openenv_grpc_envs.openspiel.v1.openspiel_pb2 import Tensor as OpenSpielTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from support.raw_vector import RawVector

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
#: The two tensors of the attack report: 30 bytes or less on the wire.
REPORTED = [[1] * 100, [0, 2**62]]
DTYPES = sorted(convert.DTYPES)
#: Dimensions that break numpy or the byte count: zero, huge, negative, the int64 edges.
DIMS = st.one_of(
    st.sampled_from([0, 1, 2, 3, 4, 64, 2**31, 2**32 + 1, 2**62, 2**63 - 1, -1, -(2**63)]),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
)


@st.composite
def hostile(draw: st.DrawFn, declared: tuple[int, ...], dtypes: list[str]) -> Tensor:
    """A Tensor whose shape is not ``declared`` (so no decoder may accept it): a rank up
    to 120, dims numpy refuses, a dtype name that may be junk, a few bytes of data."""
    rank = draw(st.one_of(st.integers(0, 4), st.integers(30, 120)))
    shape = draw(st.lists(DIMS, min_size=rank, max_size=rank))
    if tuple(shape) == declared:
        shape.append(draw(DIMS))
    dtype = draw(st.one_of(st.sampled_from(dtypes), st.text(max_size=8)))
    data = draw(st.binary(max_size=32))
    return Tensor(dtype=dtype, shape=shape, data=data)


FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = ServerProcess("gymnasium", ["--max-concurrent-envs", "0"])
    yield process
    process.stop()


def _float(value: float) -> Value:
    return Value(tensor=convert.to_tensor(np.asarray([value], dtype=np.float32)))


def test_the_reported_tensors_are_refused_and_the_episode_goes_on(server: ServerProcess) -> None:
    with GymnasiumEnv(server.target) as env:
        env.reset(seed=0, options=GymnasiumResetOptions(env_id="MountainCarContinuous-v0"))
        for shape in REPORTED:
            action = GymnasiumAction(value=Value(tensor=Tensor(dtype="float32", shape=shape)))
            assert action.ByteSize() <= 30 or shape == [1] * 100  # 100 dims: 115 bytes
            with pytest.raises(EnvError) as failed:
                env.step(action)
            assert failed.value.code is INVALID_ARGUMENT
            assert failed.value.message.startswith("action: shape ")
            assert "does not match Box(-1.0, 1.0, (1,), float32) (shape [1])" in (
                failed.value.message
            )
        assert env.step(GymnasiumAction(value=_float(0.5))).step_count == 1


def test_fuzzed_tensors_on_a_session_are_refused_and_the_episode_goes_on(
    server: ServerProcess,
) -> None:
    """300 hostile tensors as a Box action: each INVALID_ARGUMENT naming ``action``, none
    INTERNAL; the episode steps on from where it was."""
    seen: dict[str, int] = {}
    with GymnasiumEnv(server.target) as env:
        env.reset(seed=0, options=GymnasiumResetOptions(env_id="MountainCarContinuous-v0"))
        assert env.step(GymnasiumAction(value=_float(0.0))).step_count == 1

        @FUZZ
        @given(hostile((1,), DTYPES))
        def attack(tensor: Tensor) -> None:
            with pytest.raises(EnvError) as failed:
                env.step(GymnasiumAction(value=Value(tensor=tensor)))
            error = failed.value
            assert error.code is INVALID_ARGUMENT, error.message
            assert error.message.startswith("action: "), error.message
            assert len(error.message) < 400  # a million dims are not echoed back
            kind = "dtype" if "unknown dtype" in error.message else "shape"
            if kind == "shape":
                assert "(shape [1])" in error.message, error.message
            seen[kind] = seen.get(kind, 0) + 1

        attack()
        assert env.step(GymnasiumAction(value=_float(0.0))).step_count == 2
    print(f"\nsession: {sum(seen.values())} hostile tensors refused INVALID_ARGUMENT {seen}")
    assert sum(seen.values()) >= 300 and seen.get("shape", 0) >= 100, seen
    server.wait_until(lambda: server.active() == 0)


def _cartpole(num_envs: int, target: str) -> RawVector:
    stream = RawVector(target, num_envs)
    options = pack(GymnasiumResetOptions(env_id="CartPole-v1"))
    reset = stream.reset([pb.ResetCommand(seed=i, options=options) for i in range(num_envs)])
    assert list(reset.result.indices) == list(range(num_envs))
    return stream


def _push(stream: RawVector, rows: int = 4) -> pb.VectorSessionResponse:
    action = Value(tensor=convert.to_tensor(np.ones(rows, dtype=np.int64)))
    return stream.step_batch(GymnasiumAction(value=action))


def test_the_reported_tensors_on_a_native_vector_batch_lose_no_env(server: ServerProcess) -> None:
    stream = _cartpole(4, server.target)
    for shape in REPORTED:
        answer = stream.step_batch(
            GymnasiumAction(value=Value(tensor=Tensor(dtype="int64", shape=shape)))
        )
        assert answer.WhichOneof("outcome") == "error"
        assert answer.error.code == INVALID_ARGUMENT.value[0]
        assert answer.error.message.startswith("actions: shape ")
        assert "does not match 4 rows of Discrete(2) (shape [4])" in answer.error.message
    # All 4 envs are still in their episodes: each takes its first step now.
    assert list(_push(stream).result.step_counts) == [1, 1, 1, 1]
    stream.close()


def test_fuzzed_tensors_on_a_native_vector_batch_lose_no_env(server: ServerProcess) -> None:
    """300 hostile batch actions (and per-env actions) on a native CartPole batch of 4:
    each refused as a whole request with INVALID_ARGUMENT, every env steps on after."""
    stream = _cartpole(4, server.target)
    counts = {"batch": 0, "per_env": 0}

    @FUZZ
    @given(hostile((4,), DTYPES))
    def attack(tensor: Tensor) -> None:
        action = GymnasiumAction(value=Value(tensor=tensor))
        # Each tensor in both forms (a drawn boolean left one form short at times): the
        # batch form, and per env, where a Discrete takes no tensor (refused by its kind).
        for form, answer in (
            ("batch", stream.step_batch(action)),
            ("per_env", stream.step([action, action, action, action])),
        ):
            assert answer.WhichOneof("outcome") == "error", answer
            assert answer.error.code == INVALID_ARGUMENT.value[0], answer.error.message
            assert answer.error.message.startswith("actions"), answer.error.message
            assert len(answer.error.message) < 400
            counts[form] += 1

    attack()
    assert list(_push(stream).result.step_counts) == [1, 1, 1, 1]
    print(
        f"\nnative vector batch of 4: refused INVALID_ARGUMENT {counts}, 4 of 4 envs stepped after"
    )
    assert counts["batch"] == counts["per_env"] >= 100, counts
    stream.close()
    server.wait_until(lambda: server.active() == 0)


# -- the client-side decoders: what a hostile server could send ----------------------------


@settings(max_examples=300, deadline=None, database=None)
@given(hostile((), DTYPES))
def test_client_decoders_refuse_what_numpy_cannot_make(tensor: Tensor) -> None:
    """``to_numpy`` (gymnasium), the in-place observation view, openspiel's ``to_numpy``
    and the console's ``decode``: each refuses or returns, never numpy's own error."""
    for decode in (
        lambda: convert.to_numpy(tensor, what="observation"),
        lambda: view_observation_bytes(
            GymnasiumObservation(value=Value(tensor=tensor)).SerializeToString()
        ),
    ):
        try:
            array = decode()
        except ConversionError as exc:
            assert str(exc).startswith("observation: ")
        else:
            assert array is not None
            assert list(array.shape) == list(tensor.shape)
    spiel = OpenSpielTensor(dtype=tensor.dtype, shape=tensor.shape, data=tensor.data)
    try:
        array = openspiel_client.to_numpy(spiel)
    except openspiel_client.TensorError as exc:
        assert str(exc).startswith("tensor: ")
    else:
        assert list(array.shape) == list(tensor.shape)
    values = console_tensors.decode(tensor.data, tensor.dtype, list(tensor.shape))
    if values is not None:
        assert console_tensors.fits(tensor.data, list(tensor.shape), tensor.dtype)


def test_the_console_refuses_a_hostile_shape_typed_on_the_page() -> None:
    with pytest.raises(console_tensors.TensorInputError, match="at most 32"):
        console_tensors.encode({"dtype": "float32", "shape": [1] * 100, "values": [1.0]})
    with pytest.raises(console_tensors.TensorInputError, match="sizes from 0 to"):
        console_tensors.encode({"dtype": "float32", "shape": [0, 2**62], "values": []})
    assert console_tensors.decode(b"\0" * 4, "float32", [1] * 100) is None
    assert console_tensors.decode(b"\0" * 4, "float32", [1]) == [0.0]
