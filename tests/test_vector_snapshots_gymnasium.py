"""Vector snapshots on the gymnasium env's native batch, over real gRPC: a GRPO-style group
of CartPole branches forked from one session's prefix repeats the session's continuation
in every row; an env of the batch and a session trade snapshots; a snapshot of another
configuration and the EnvPool backend are refused per index, saying why."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import gymnasium
import pytest

from openenv_grpc.client import VectorEnvError
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.gymnasium import GymnasiumAction, GymnasiumEnv, GymnasiumResetOptions
from openenv_grpc_envs.gymnasium.client import GymnasiumVectorEnv
from openenv_grpc_envs.gymnasium.convert import encode
from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import Backend

pytestmark = pytest.mark.timeout(120)

CARTPOLE = GymnasiumResetOptions(env_id="CartPole-v1")
#: Actions that keep a CartPole episode going for all the steps below.
ACTIONS = [0, 1, 1, 0, 0, 1, 0, 1, 1, 0, 1, 0]
G = 6


def push(side: int) -> GymnasiumAction:
    return GymnasiumAction(value=encode(side, gymnasium.spaces.Discrete(2)))


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    started = ServerProcess(
        "gymnasium", [], {"SNAPSHOT_KEYS": "k1:0123456789abcdef0123456789abcdef"}
    )
    yield started
    started.stop()


def session_prefix(env: GymnasiumEnv) -> tuple[bytes, list[tuple[bytes, float]]]:
    """Reset CartPole seeded, take 4 steps, snapshot; then the continuation (observation
    bytes and reward per step) of the rest of ACTIONS."""
    env.reset(seed=21, options=CARTPOLE)
    for side in ACTIONS[:4]:
        env.step(push(side))
    data = env.snapshot()
    rest = []
    for side in ACTIONS[4:]:
        outcome = env.step(push(side))
        rest.append((outcome.observation.value.SerializeToString(), outcome.reward))
    return data, rest


def test_a_group_of_branches_repeats_the_sessions_continuation(server: ServerProcess) -> None:
    with GymnasiumEnv(server.target) as env:
        data, rest = session_prefix(env)
        with GymnasiumVectorEnv.forked(env, [data] * G) as group:
            assert group.native  # the gymnasium env's own batch, not the loop
            assert group.step_counts == [4] * G
            for side, (observation, reward) in zip(ACTIONS[4:], rest, strict=True):
                outcome = group.step([push(side)] * G)
                assert not outcome.errors and outcome.rewards == [reward] * G
                rows = {o.value.SerializeToString() for o in outcome.observations}
                assert rows == {observation}
            assert group.step_counts == [len(ACTIONS)] * G
            # The batch's own snapshot of a row continues in a session just the same.
            again = group.snapshot(indices=[G - 1])[0]
            expected = group.step([push(1)] * G).observations[G - 1].value
        env.restore(again)
        assert env.step(push(1)).observation.value == expected
    server.wait_until(lambda: server.active() == 0)


def test_a_snapshot_of_another_configuration_is_refused_for_its_index(
    server: ServerProcess,
) -> None:
    with GymnasiumEnv(server.target) as env:
        env.reset(seed=1, options=GymnasiumResetOptions(env_id="MountainCar-v0"))
        other = env.snapshot()
        with GymnasiumVectorEnv(server.target, 3) as envs:
            envs.reset(seeds=5, options=CARTPOLE)
            own = envs.snapshot(indices=[0])[0]
            with pytest.raises(VectorEnvError) as refused:
                envs.restore([own, other, own])
            error = refused.value.errors[1]
            assert error.code is grpc.StatusCode.INVALID_ARGUMENT
            assert "MountainCar-v0" in error.message and "one configuration" in error.message
            assert refused.value.done == [0, 2]
            assert envs.step_counts == [0, 0, 0]
            assert len(envs.step([push(0)] * 3).indices) == 3  # the stream goes on
    server.wait_until(lambda: server.active() == 0)


def test_the_envpool_backend_answers_unimplemented_per_index(server: ServerProcess) -> None:
    pooled = GymnasiumResetOptions(env_id="CartPole-v1", backend=Backend.BACKEND_ENVPOOL)
    with GymnasiumVectorEnv(server.target, 2) as envs:
        envs.reset(seeds=0, options=pooled)
        with pytest.raises(VectorEnvError) as refused:
            envs.snapshot()
        assert {i: e.code for i, e in refused.value.errors.items()} == {
            0: grpc.StatusCode.UNIMPLEMENTED, 1: grpc.StatusCode.UNIMPLEMENTED,
        }  # fmt: skip
        assert "EnvPool backend cannot snapshot" in refused.value.errors[0].message
        assert len(envs.step([push(0)] * 2).indices) == 2
    server.wait_until(lambda: server.active() == 0)
