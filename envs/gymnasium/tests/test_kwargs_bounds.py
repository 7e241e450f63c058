"""A client's ``gymnasium.make`` kwargs are bounded by what they can cost: kwargs larger
than ``GYM_MAX_KWARGS_BYTES`` (4096 bytes of JSON by default) and kwargs that name the
server's files are refused in-band (INVALID_ARGUMENT) before any env is made; the episode
running goes on. Found by the attack on issue 19's fixes: a 63 KB FrozenLake ``desc``
built a ~123 MiB transition table per env. The bytes bound is the coarse first check; each
id's allowlist (test_kwargs_allowlist.py) bounds what the env makes of the kwargs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2

from openenv_grpc import EnvError
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.gymnasium import GymnasiumAction, GymnasiumEnv, GymnasiumResetOptions, Value

pytestmark = [pytest.mark.timeout(60), pytest.mark.shared_server]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = ServerProcess("gymnasium", [])
    yield process
    process.stop()


def _options(env_id: str, **kwargs: Any) -> GymnasiumResetOptions:
    struct = struct_pb2.Struct()
    struct.update(kwargs)
    return GymnasiumResetOptions(env_id=env_id, kwargs=struct)


def _lake(side: int) -> list[str]:
    """A FrozenLake map of side x side: start top left, goal bottom right."""
    rows = ["F" * side for _ in range(side)]
    rows[0] = "S" + rows[0][1:]
    rows[-1] = rows[-1][:-1] + "G"
    return rows


def test_kwargs_over_the_bound_are_refused_and_the_episode_goes_on(server: ServerProcess) -> None:
    with GymnasiumEnv(server.target) as env:
        first = env.reset(seed=0, options=_options("CartPole-v1"))
        with pytest.raises(EnvError) as failed:
            env.reset(options=_options("FrozenLake-v1", desc=_lake(251)))  # ~63 KB
        assert failed.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert failed.value.message.startswith("kwargs are 63")
        assert failed.value.message.endswith(
            "bytes (as JSON), over this server's limit of 4096 bytes (GYM_MAX_KWARGS_BYTES): "
            "a constructor argument's size can make every env cost without bound"
        )
        stepped = env.step(GymnasiumAction(value=Value(discrete=0)))
        assert (stepped.step_count, stepped.episode_id) == (1, first.episode_id)
        # A map within the bound is served as before.
        lake = env.reset(seed=0, options=_options("FrozenLake-v1", desc=_lake(16)))
        assert lake.observation.env.env_id == "FrozenLake-v1"


@pytest.mark.parametrize("key", ["xml_file", "model_path", "data_dir", "path", "ASSET-ROOT"])
def test_kwargs_naming_server_files_are_refused(server: ServerProcess, key: str) -> None:
    with GymnasiumEnv(server.target) as env:
        with pytest.raises(EnvError) as failed:
            env.reset(options=_options("CartPole-v1", **{key: "/etc/passwd"}))
        assert failed.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert failed.value.message == (
            f"kwargs [{key!r}] are not allowed: a client cannot choose files on the server"
        )


def test_a_kwarg_that_only_sounds_like_a_path_meets_the_allowlist(server: ServerProcess) -> None:
    # Not refused as a path; then the id's allowlist (kwargs_allowlist.py) refuses it.
    with GymnasiumEnv(server.target) as env:
        with pytest.raises(EnvError) as failed:
            env.reset(options=_options("CartPole-v1", profile=1))
        assert failed.value.message.startswith(
            "kwarg 'profile' is not served for 'CartPole-v1': it takes sutton_barto_reward"
        )


@pytest.mark.fresh_server
def test_the_operator_sets_the_bound(tmp_path: Any) -> None:
    # 0 lifts the bytes bound; the allowlist's own bound on a map (16 x 16) still holds.
    process = ServerProcess("gymnasium", [], {"GYM_MAX_KWARGS_BYTES": "0"})
    try:
        with GymnasiumEnv(process.target) as env:
            lake = env.reset(seed=0, options=_options("FrozenLake-v1", desc=_lake(16)))
            assert lake.observation.env.env_id == "FrozenLake-v1"
            with pytest.raises(EnvError) as failed:
                env.reset(seed=0, options=_options("FrozenLake-v1", desc=_lake(80)))
            assert failed.value.code is grpc.StatusCode.INVALID_ARGUMENT
            assert "desc must be a list of 1 to 16 equal strings" in failed.value.message
    finally:
        process.stop()
    process = ServerProcess("gymnasium", [], {"GYM_MAX_KWARGS_BYTES": "64"})
    try:
        with GymnasiumEnv(process.target) as env:
            with pytest.raises(EnvError) as failed:
                env.reset(options=_options("FrozenLake-v1", desc=_lake(8)))
            assert "over this server's limit of 64 bytes" in failed.value.message
    finally:
        process.stop()
