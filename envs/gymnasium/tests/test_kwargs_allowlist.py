"""``gymnasium.make`` kwargs are allowed per env id, with bounds (EnvPool's approach): a
kwarg the id does not list, or a value outside its bound, is refused INVALID_ARGUMENT
naming the id, the kwarg and what is allowed, before any env is made. Found by the
attack on issue 36 (row 5): a 62 x 62 FrozenLake ``desc`` (4,040 bytes, under
``GYM_MAX_KWARGS_BYTES``) on vector streams built 7.39 MiB per env, 7.4 GiB at the
default capacity, for one unauthenticated client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2

from openenv_grpc import EnvError, InvalidAction
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.gymnasium import (
    GymnasiumAction,
    GymnasiumEnv,
    GymnasiumResetOptions,
    GymnasiumVectorEnv,
    Value,
)
from openenv_grpc_envs.gymnasium.kwargs_allowlist import check_kwargs

pytestmark = [pytest.mark.timeout(120)]


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


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


# -- the bounds, checked in process (no env is made) ------------------------------------

ALLOWED = [
    ("CartPole-v1", {"sutton_barto_reward": True}),
    ("FrozenLake-v1", {"desc": _lake(16), "is_slippery": False, "success_rate": 0.5}),
    ("FrozenLake8x8-v1", {"map_name": "4x4", "reward_schedule": [1, -1, 0]}),
    ("Taxi-v4", {"is_rainy": True, "rainy_probability": 0.5}),
    ("LunarLander-v3", {"continuous": True, "gravity": -5.0, "wind_power": 20}),
    ("CarRacing-v3", {"domain_randomize": True, "lap_complete_percent": 0.5}),
    ("ALE/Pong-v5", {"frameskip": 4, "repeat_action_probability": 0, "obs_type": "ram"}),
]
REFUSED = [
    (
        "FrozenLake-v1",
        {"desc": _lake(62)},
        "kwarg desc=['SFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF... is not served "
        "for 'FrozenLake-v1': desc must be a list of 1 to 16 equal strings of 1 to 16 letters "
        "from 'SFHG', with at least one 'S'",
    ),
    (
        "FrozenLake-v1",
        {"desc": ["SF", "FFF"]},
        "kwarg desc=['SF', 'FFF'] is not served for 'FrozenLake-v1': desc must be a list of "
        "1 to 16 equal strings of 1 to 16 letters from 'SFHG', with at least one 'S'",
    ),
    (
        "FrozenLake-v1",
        {"desc": ["FF", "FG"]},
        "kwarg desc=['FF', 'FG'] is not served for 'FrozenLake-v1': desc must be a list of "
        "1 to 16 equal strings of 1 to 16 letters from 'SFHG', with at least one 'S'",
    ),
    (
        "FrozenLake-v1",
        {"is_slippery": 1},
        "kwarg is_slippery=1 is not served for 'FrozenLake-v1': is_slippery must be true or false",
    ),
    (
        "FrozenLake-v1",
        {"reward_schedule": [1, 0]},
        "kwarg reward_schedule=[1, 0] is not served for 'FrozenLake-v1': reward_schedule "
        "must be a list of 3 numbers, each a number from -1e+06 to 1e+06",
    ),
    (
        "Taxi-v4",
        {"rainy_probability": float("nan")},
        "kwarg rainy_probability=nan is not served for 'Taxi-v4': rainy_probability must be "
        "a number from 0 to 1",
    ),
    (
        "LunarLander-v3",
        {"gravity": -12},
        "kwarg gravity=-12 is not served for 'LunarLander-v3': gravity must be a number from "
        "-11.99 to -0.01",
    ),
    (
        "ALE/Pong-v5",
        {"frameskip": 2.5},
        "kwarg frameskip=2.5 is not served for 'ALE/Pong-v5': frameskip must be a whole "
        "number from 1 to 64",
    ),
    (
        "ALE/Pong-v5",
        {"game": "breakout"},
        "kwarg 'game' is not served for 'ALE/Pong-v5': it takes continuous, "
        "continuous_action_threshold, difficulty, frameskip, full_action_space, "
        "max_num_frames_per_episode, mode, obs_type, repeat_action_probability on this "
        "server (an env's constructor arguments are allowed per env, with bounds)",
    ),
    (
        "Acrobot-v1",
        {"book_or_nips": "nips"},
        "kwarg 'book_or_nips' is not served for 'Acrobot-v1': it takes no kwargs on this "
        "server (an env's constructor arguments are allowed per env, with bounds)",
    ),
    (  # not on the list at all (here: a shim whose constructor the server cannot know)
        "GymV26Environment-v0",
        {"env_id": "CartPole-v1"},
        "kwarg 'env_id' is not served for 'GymV26Environment-v0': it takes no kwargs on "
        "this server (an env's constructor arguments are allowed per env, with bounds)",
    ),
]


@pytest.mark.parametrize(("env_id", "kwargs"), ALLOWED)
def test_listed_kwargs_within_bounds_pass(env_id: str, kwargs: dict[str, Any]) -> None:
    check_kwargs(env_id, kwargs)


@pytest.mark.parametrize(("env_id", "kwargs", "message"), REFUSED)
def test_kwargs_off_the_list_or_out_of_bounds_are_named(
    env_id: str, kwargs: dict[str, Any], message: str
) -> None:
    from openenv_grpc_envs.gymnasium.configuration import register_ale

    register_ale()
    with pytest.raises(InvalidAction) as refused:
        check_kwargs(env_id, kwargs)
    assert str(refused.value) == message


def test_an_unregistered_id_is_left_to_make() -> None:
    check_kwargs("NoSuchEnv-v0", {"anything": 1})  # make() answers "unknown env_id"


# -- on a real server -------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = ServerProcess("gymnasium", [])
    yield process
    process.stop()


def test_allowed_kwargs_are_served_and_refusals_leave_the_episode(server: ServerProcess) -> None:
    with GymnasiumEnv(server.target) as env:
        lake = env.reset(seed=0, options=_options("FrozenLake-v1", desc=_lake(16)))
        assert lake.observation.env.env_id == "FrozenLake-v1"
        for env_id, kwargs in [
            ("CartPole-v1", {"sutton_barto_reward": True}),
            ("Taxi-v4", {"is_rainy": True}),
        ]:
            made = env.reset(seed=0, options=_options(env_id, **kwargs))
            assert dict(made.observation.env.kwargs) == kwargs
        with pytest.raises(EnvError) as refused:
            env.reset(options=_options("CartPole-v1", sutton_barto_reward="yes"))
        assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.message == (
            "kwarg sutton_barto_reward='yes' is not served for 'CartPole-v1': "
            "sutton_barto_reward must be true or false"
        )
        stepped = env.step(GymnasiumAction(value=Value(discrete=0)))
        assert stepped.step_count == 1  # the Taxi episode goes on


@pytest.mark.fresh_server
def test_a_huge_lake_on_vector_streams_is_refused_before_any_env_is_made() -> None:
    """The attack, three times: vector streams filling the default capacity (4 x 256 =
    1024 envs), every env asked for a 62 x 62 lake (4,040 bytes of kwargs, 7.39 MiB per
    env before). The server's RSS moves only by what decoding the requests costs."""
    process = ServerProcess("gymnasium", [])
    attack = _options("FrozenLake-v1", desc=_lake(62))
    assert len(attack.kwargs.SerializeToString()) < 4096 + 64  # under the bytes cap
    try:
        with GymnasiumVectorEnv(process.target, 4) as warm:  # imports, first stream
            warm.reset(seeds=0, options=_options("FrozenLake-v1", desc=_lake(16)))
        before = _rss_mib(process.proc.pid)
        growth: list[float] = []
        for _ in range(3):
            streams = [GymnasiumVectorEnv(process.target, 256) for _ in range(4)]
            try:
                for envs in streams:
                    envs.open()
                    with pytest.raises(EnvError) as refused:
                        envs.reset(seeds=0, options=attack)
                    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
                    assert refused.value.message.startswith("kwarg desc=['SFFF")
                    assert (
                        "is not served for 'FrozenLake-v1': desc must be a list of 1 to 16"
                        in refused.value.message
                    )
                assert process.active() == 1024  # every slot held, no env built
                growth.append(_rss_mib(process.proc.pid) - before)
                # The stream goes on: a map within the bound is served on it.
                served = streams[0].reset(
                    seeds=0, options=_options("FrozenLake-v1"), indices=[0, 1]
                )
                assert len(served.observations) == 2
            finally:
                for envs in streams:
                    envs.close()
        print(
            f"\nKWARGS 3 rounds of 1024 envs asked for a 62x62 lake: refused; server RSS "
            f"{before:.1f} MiB, growth per round {[round(g, 1) for g in growth]} MiB",
            flush=True,
        )
        # Before: 7.39 MiB per env, +7.4 GiB per round. Now what is left is decoding the
        # requests (4 x 1 MiB per round: the options go once per env), as for any refused
        # kwargs of that size, and no env's table.
        assert max(growth) < 64
    finally:
        process.stop()
