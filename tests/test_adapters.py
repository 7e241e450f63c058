"""The Gymnasium adapters against a real ``gymnasium`` server: Gymnasium's own env checker,
equality with local Gymnasium envs (single and vector, every autoreset mode), and that
closing releases every server slot."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any
from unittest import mock

import grpc
import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from gymnasium.utils.env_match import check_environments_match
from gymnasium.utils.passive_env_checker import env_render_passive_checker as passive_render_check
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from openenv_grpc import CapacityError, EnvError
from openenv_grpc.client.info import fetch_info
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.gymnasium import GymnasiumEnv
from openenv_grpc_envs.gymnasium.adapters import RemoteGymnasiumEnv, RemoteGymnasiumVectorEnv
from openenv_grpc_envs.gymnasium.adapters.registration import remote_id
from openenv_grpc_envs.gymnasium.adapters.vector_stream import VectorStream
from openenv_grpc_envs.gymnasium.configuration import register_ale
from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import Backend


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = ServerProcess("gymnasium", ["--max-concurrent-envs", "0"])
    yield process
    process.stop()


def wait_idle(server: ServerProcess) -> None:
    """Every session of the test is gone from the server."""
    server.wait_until(lambda: server.active() == 0, what="active sessions to return to 0")


def equal(a: Any, b: Any) -> bool:
    """Exact equality of observations (arrays, tuples, dicts, numbers)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, tuple) or (isinstance(a, np.ndarray) and a.dtype.kind == "O"):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))


# -- RemoteGymnasiumEnv ----------------------------------------------------------------


@pytest.mark.parametrize(
    "env_id",
    ["CartPole-v1", "Pendulum-v1", "Blackjack-v1", "FrozenLake-v1"],
    ids=["box-discrete", "box-box", "tuple-discrete", "discrete-discrete"],
)
def test_check_env_passes(server: ServerProcess, env_id: str) -> None:
    with RemoteGymnasiumEnv(server.target, env_id) as env:
        local = gymnasium.make(env_id)
        assert env.observation_space == local.observation_space
        assert env.action_space == local.action_space
        assert env.max_episode_steps == (local.spec.max_episode_steps or 0)  # type: ignore[union-attr]
        local.close()
        with warnings.catch_warnings():
            # Box spaces with infinite bounds and a missing spec only warn; errors raise.
            warnings.simplefilter("ignore")
            check_env(env)
    wait_idle(server)


def test_same_seed_and_actions_give_the_local_episode(server: ServerProcess) -> None:
    local = gymnasium.make("CartPole-v1")
    with RemoteGymnasiumEnv(server.target, "CartPole-v1") as env:
        for seed in (0, 7):
            obs, info = env.reset(seed=seed)
            ref, _ = local.reset(seed=seed)
            assert obs.dtype == np.float32 and equal(obs, ref) and info == {}
            rng = np.random.default_rng(seed)
            done = False
            while not done:
                action = int(rng.integers(2))
                obs, reward, terminated, truncated, info = env.step(action)
                ref, ref_reward, ref_term, ref_trunc, _ = local.step(action)
                assert equal(obs, ref) and reward == ref_reward
                assert (terminated, truncated) == (ref_term, ref_trunc)
                done = terminated or truncated
            assert terminated  # a random CartPole policy falls long before 500 steps
    local.close()


def test_truncation_and_info_pass_through(server: ServerProcess) -> None:
    with RemoteGymnasiumEnv(server.target, "CartPole-v1", max_episode_steps=3) as env:
        assert env.max_episode_steps == 3
        env.reset(seed=3)
        flags = [env.step(i % 2)[2:4] for i in range(3)]
        assert flags == [(False, False), (False, False), (False, True)]
    with RemoteGymnasiumEnv(server.target, "FrozenLake-v1") as env:
        _, info = env.reset(seed=1)
        assert info == {"prob": 1.0}  # gymnasium's own reset info, as JSON numbers


def test_reset_options_reconfigure_the_remote_env(server: ServerProcess) -> None:
    with RemoteGymnasiumEnv(server.target, "CartPole-v1") as env:
        obs, _ = env.reset(
            seed=0, options={"env_id": "FrozenLake-v1", "kwargs": {"is_slippery": False}}
        )
        assert env.observation_space == gymnasium.spaces.Discrete(16) and obs == 0
        for move in [1, 1, 2, 2, 1, 2]:  # the known path to the goal without slipping
            obs, reward, terminated, _, _ = env.step(move)
        assert (obs, reward, terminated) == (15, 1.0, True)
        env.reset()  # no options: keeps FrozenLake
        assert env.session.state().env.env_id == "FrozenLake-v1"
        with pytest.raises(ValueError, match="unknown reset options"):
            env.reset(options={"render_mode": "human"})


def test_bad_configuration_and_actions_are_errors(server: ServerProcess) -> None:
    with pytest.raises(EnvError, match="unknown env_id"):
        RemoteGymnasiumEnv(server.target, "NoSuchEnv-v0")
    with RemoteGymnasiumEnv(server.target, "CartPole-v1") as env:
        env.reset(seed=0)
        with pytest.raises(EnvError) as refused:
            env.step(2)
        assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
        env.step(0)  # the session goes on
    wait_idle(server)


def test_wraps_an_open_session_and_closes_it(server: ServerProcess) -> None:
    session = GymnasiumEnv(server.target)
    session.open()
    env = RemoteGymnasiumEnv(session, "Acrobot-v1")
    assert env.session is session and server.active() == 1
    obs, _ = env.reset(seed=1)
    assert obs in env.observation_space
    env.close()
    env.close()  # idempotent
    wait_idle(server)


def test_registered_ids_make_the_adapter_and_the_checker_tests_render_modes(
    server: ServerProcess,
) -> None:
    """``gymnasium.make("openenv-grpc/<id>", target=...)`` builds the adapter with a spec,
    and check_env makes one env per declared render mode from that spec and checks its
    frames (rgb_array, rendered by the server)."""
    rendered: list[Any] = []

    def record(env: gymnasium.Env[Any, Any]) -> None:
        rendered.append((env.render_mode, env.render()))
        passive_render_check(env)

    for made in (
        gymnasium.make("openenv-grpc/CartPole-v1", target=server.target).unwrapped,
        RemoteGymnasiumEnv(server.target, "CartPole-v1"),  # made directly: the same spec
    ):
        assert isinstance(made, RemoteGymnasiumEnv)
        assert made.spec is not None and made.spec.id == "openenv-grpc/CartPole-v1"
        assert made.spec.kwargs == {"env_id": "CartPole-v1", "target": server.target}
        assert made.metadata["render_modes"] == ["rgb_array"]
        with (
            warnings.catch_warnings(),
            mock.patch("gymnasium.utils.env_checker.env_render_passive_checker", record),
        ):
            warnings.simplefilter("ignore")  # infinite Box bounds only warn
            check_env(made)
        made.close()
    assert [mode for mode, _ in rendered] == ["rgb_array", "rgb_array"]
    for _, frame in rendered:
        assert frame.dtype == np.uint8 and frame.shape == (400, 600, 3)
    wait_idle(server)


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Acrobot-v1"])
def test_gymnasiums_match_checker_finds_the_local_env_frames_included(
    server: ServerProcess, env_id: str
) -> None:
    """gymnasium.utils.env_match: the remote env and gymnasium.make(...) give identical
    observations, rewards, flags, infos and rendered frames for 40 seeded steps. (Its
    rewards compare types too: envs whose reward is a numpy scalar, e.g. Pendulum, give a
    float remotely; their values are equal, see test_vector_stream_matches_sync_vector_env.)"""
    remote = gymnasium.make(f"openenv-grpc/{env_id}", target=server.target,
                            render_mode="rgb_array")  # fmt: skip
    local = gymnasium.make(env_id, render_mode="rgb_array")
    try:
        check_environments_match(remote, local, num_steps=40, seed=3)
    finally:
        remote.close()
        local.close()
    wait_idle(server)


def test_the_generic_id_takes_any_server_side_id(server: ServerProcess) -> None:
    env = gymnasium.make(
        "openenv-grpc/Remote-v0", target=server.target, env_id="ALE/Pong-v5",
        render_mode="rgb_array", kwargs={"frameskip": 4},
    )  # fmt: skip
    try:
        obs, _ = env.reset(seed=0)
        assert obs.shape == (210, 160, 3)
        assert env.metadata["render_fps"] == 30
        assert env.render().shape == (210, 160, 3)  # type: ignore[union-attr]
        assert env.spec is not None and env.spec.id == "openenv-grpc/Remote-v0"
    finally:
        env.close()
    with pytest.raises(ValueError, match="render_mode 'human'"):
        RemoteGymnasiumEnv(server.target, "CartPole-v1", render_mode="human")
    assert remote_id("ALE/Pong-v5") == remote_id("NotLocal-v0") == "openenv-grpc/Remote-v0"
    wait_idle(server)


# -- RemoteGymnasiumVectorEnv ----------------------------------------------------------


TRANSPORTS = ["vector", "sessions"]
# (id, make kwargs, step limit, vector steps): a Discrete-action env, a Box-action env with
# a short limit so episodes end, and Atari frames (uint8 210x160x3) with a short limit.
CASES = {
    "cartpole": ("CartPole-v1", {}, None, 100),
    "pendulum": ("Pendulum-v1", {}, 6, 20),
    "pong": ("ALE/Pong-v5", {"frameskip": 4}, 5, 11),
}


def run_pair(
    server: ServerProcess,
    mode: AutoresetMode,
    case: str = "cartpole",
    transport: str = "vector",
    num_envs: int = 4,
) -> int:
    """The same seeded actions through the remote vector env and a local SyncVectorEnv,
    compared step for step (observations, rewards, flags, infos; in DISABLED the ended
    envs reset by mask on both); returns how many episodes ended."""
    env_id, kwargs, limit, steps = CASES[case]
    register_ale()
    local = SyncVectorEnv(
        [lambda: gymnasium.make(env_id, max_episode_steps=limit, **kwargs)] * num_envs,
        autoreset_mode=mode,
    )
    remote = RemoteGymnasiumVectorEnv(
        server.target, num_envs, env_id, max_episode_steps=limit, kwargs=kwargs,
        autoreset_mode=mode, transport=transport,  # type: ignore[arg-type]
    )  # fmt: skip
    ended = 0
    try:
        assert remote.metadata["autoreset_mode"] is mode
        assert remote.observation_space == local.observation_space
        assert remote.action_space == local.action_space
        assert remote.single_action_space == local.single_action_space
        obs, infos = remote.reset(seed=11)
        ref, ref_infos = local.reset(seed=11)
        assert equal(obs, ref) and equal(infos, ref_infos)
        local.action_space.seed(0)
        for _ in range(steps):
            actions = local.action_space.sample()
            got, want = remote.step(actions), local.step(actions)
            for name, a, b in zip(("obs", "rewards", "terms", "truncs", "infos"), got, want,
                                  strict=True):  # fmt: skip
                assert equal(a, b), (name, a, b)
            assert got[0].dtype == want[0].dtype and got[1].dtype == np.float64
            done = want[2] | want[3]
            ended += int(done.sum())
            if mode is AutoresetMode.DISABLED and done.any():
                options = {"reset_mask": done}
                assert equal(remote.reset(options=dict(options))[0],
                             local.reset(options=dict(options))[0])  # fmt: skip
    finally:
        remote.close()
        local.close()
    return ended


MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("case", list(CASES))
def test_vector_stream_matches_sync_vector_env(
    server: ServerProcess, case: str, mode: AutoresetMode
) -> None:
    """One vector stream equals SyncVectorEnv step for step, in every autoreset mode, for
    a discrete, a Box and an image env; episodes end and autoreset (or mask resets) run."""
    assert run_pair(server, mode, case, "vector") >= 2
    wait_idle(server)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_session_streams_still_match_sync_vector_env(
    server: ServerProcess, mode: AutoresetMode
) -> None:
    assert run_pair(server, mode, "cartpole", "sessions") >= 10
    wait_idle(server)


def test_vector_stream_matches_with_isolated_env_processes() -> None:
    """With --isolated the native batch runs in an env process: still SyncVectorEnv's."""
    isolated = ServerProcess("gymnasium", ["--max-concurrent-envs", "0", "--isolated", "2"])
    try:
        assert run_pair(isolated, AutoresetMode.SAME_STEP, "cartpole", "vector") >= 10
        wait_idle(isolated)
    finally:
        isolated.stop()


def test_vector_stream_uses_one_stream_and_views_the_received_bytes(
    server: ServerProcess,
) -> None:
    with RemoteGymnasiumVectorEnv(server.target, 8, "CartPole-v1") as envs:
        assert server.active() == 8 and isinstance(envs.remote, VectorStream)
        envs.reset(seed=0)
        obs, *_ = envs.step(envs.action_space.sample())
        assert not obs.flags.writeable and obs.base is not None  # a view, not a copy
        again, *_ = envs.step(envs.action_space.sample())
        assert not np.shares_memory(obs, again)  # never shared between calls
    wait_idle(server)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_next_step_autoreset_after_termination(server: ServerProcess, transport: str) -> None:
    with RemoteGymnasiumVectorEnv(server.target, 2, "CartPole-v1", transport=transport) as envs:  # type: ignore[arg-type]
        envs.reset(seed=[5, None])
        pushes = np.array([1, 0])
        for _ in range(200):
            obs, rewards, terms, truncs, _ = envs.step(pushes)
            if terms[0]:
                break
        assert terms[0] and rewards[0] == 1.0  # pushed right until the pole fell
        obs, rewards, terms, truncs, _ = envs.step(pushes)  # sub-env 0 resets now
        assert rewards[0] == 0.0 and not terms[0] and not truncs[0]
        assert np.all(np.abs(obs[0]) <= 0.05)  # CartPole's first observations lie in ±0.05


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_seeds_int_and_list(server: ServerProcess, transport: str) -> None:
    with RemoteGymnasiumVectorEnv(server.target, 3, "CartPole-v1", transport=transport) as envs:  # type: ignore[arg-type]
        by_int, _ = envs.reset(seed=40)
        by_list, _ = envs.reset(seed=[40, 41, 42])
        assert equal(by_int, by_list)
        for i in range(3):
            ref, _ = gymnasium.make("CartPole-v1").reset(seed=40 + i)
            assert equal(by_int[i], ref)
        with pytest.raises(ValueError, match="num_envs=3"):
            envs.reset(seed=[1, 2])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_disabled_mode_and_reset_mask(server: ServerProcess, transport: str) -> None:
    with RemoteGymnasiumVectorEnv(
        server.target, 2, "CartPole-v1", autoreset_mode="Disabled", max_episode_steps=2,
        transport=transport,  # type: ignore[arg-type]
    ) as envs:  # fmt: skip
        envs.reset(seed=0)
        envs.step(np.array([0, 1]))
        _, _, _, truncs, _ = envs.step(np.array([0, 1]))
        assert truncs.tolist() == [True, True]
        with pytest.raises(RuntimeError, match="reset_mask"):
            envs.step(np.array([0, 0]))
        before, _ = envs.reset(seed=0)
        envs.step(np.array([0, 1]))
        partial, _ = envs.reset(seed=[0, None], options={"reset_mask": np.array([True, False])})
        assert equal(partial[0], before[0]) and not equal(partial[1], before[1])
        with pytest.raises(ValueError, match="reset_mask"):
            envs.reset(options={"reset_mask": [True, True]})


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_close_releases_every_slot(server: ServerProcess, transport: str) -> None:
    channels = 2 if transport == "sessions" else 1
    envs = RemoteGymnasiumVectorEnv(server.target, 24, "CartPole-v1", channels=channels,
                                    transport=transport)  # type: ignore[arg-type]  # fmt: skip
    assert server.active() == 24
    envs.reset(seed=0)
    envs.step(envs.action_space.sample())
    envs.close()
    assert envs.closed
    wait_idle(server)
    envs.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        envs.step(envs.action_space.sample())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_capacity_refusal_leaves_nothing_open(transport: str) -> None:
    small = ServerProcess("gymnasium", ["--max-concurrent-envs", "2"])
    try:
        with pytest.raises(CapacityError):
            RemoteGymnasiumVectorEnv(small.target, 3, "CartPole-v1", transport=transport)  # type: ignore[arg-type]
        wait_idle(small)
        with RemoteGymnasiumVectorEnv(small.target, 2, "CartPole-v1", transport=transport) as envs:  # type: ignore[arg-type]
            assert envs.reset(seed=0)[0].shape == (2, 4)
    finally:
        small.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_vector_tuple_observations_batch(server: ServerProcess, transport: str) -> None:
    with RemoteGymnasiumVectorEnv(server.target, 3, "Blackjack-v1", transport=transport) as envs:  # type: ignore[arg-type]
        obs, _ = envs.reset(seed=1)
        assert obs in envs.observation_space
        assert isinstance(obs, tuple) and all(part.shape == (3,) for part in obs)
        obs, *_ = envs.step(np.zeros(3, dtype=np.int64))
        assert obs in envs.observation_space
        local = SyncVectorEnv([lambda: gymnasium.make("Blackjack-v1")] * 3)
        local.reset(seed=1)
        assert equal(obs, local.step(np.zeros(3, dtype=np.int64))[0])
        local.close()


def test_bad_actions_are_errors_and_the_stream_goes_on(server: ServerProcess) -> None:
    with RemoteGymnasiumVectorEnv(server.target, 3, "CartPole-v1") as envs:
        envs.reset(seed=0)
        with pytest.raises(EnvError, match=r"env 1: action: 5 is outside \[0, 1\]") as bad:
            envs.step(np.array([0, 5, 1]))
        assert bad.value.code is grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(EnvError, match="does not match 3 rows") as wrong:
            envs.step(np.array([0, 1]))
        assert wrong.value.code is grpc.StatusCode.INVALID_ARGUMENT
        obs, *_ = envs.step(np.array([0, 1, 1]))  # the stream goes on
        assert obs.shape == (3, 4)


def test_envpool_backend_is_envpools_semantics_over_the_wire(server: ServerProcess) -> None:
    """Pinned: with backend="envpool" the remote vector env equals an in-process EnvPool
    pool with the same seeds step for step, and not SyncVectorEnv (other generators)."""
    import envpool

    n, seed = 4, 3
    pool = envpool.make_gymnasium("CartPole-v1", num_envs=n, batch_size=n,
                                  env_seed=[seed + i for i in range(n)])  # fmt: skip
    with RemoteGymnasiumVectorEnv(server.target, n, "CartPole-v1", backend="envpool") as envs:
        assert envs.description.backend == Backend.BACKEND_ENVPOOL
        obs, infos = envs.reset(seed=seed)
        ref, _ = pool.reset()
        assert equal(obs, ref) and infos == {}  # EnvPool's bookkeeping infos are dropped
        gym_obs, _ = SyncVectorEnv([lambda: gymnasium.make("CartPole-v1")] * n).reset(seed=seed)
        assert not np.allclose(obs, gym_obs)
        rng = np.random.default_rng(1)
        ended = 0
        for _ in range(60):
            actions = rng.integers(2, size=n)
            got, want = envs.step(actions), pool.step(actions)
            assert equal(got[0], want[0]) and equal(got[1], want[1].astype(np.float64))
            assert equal(got[2], want[2]) and equal(got[3], want[3])
            ended += int(got[2].sum())
        assert ended >= 2  # NEXT_STEP autoresets ran, the same on both
    pool.close()
    info = fetch_info(server.target)  # strangers learn it from Info too
    assert info.vector.native_batch and "EnvPool" in info.env_description
    assert "seeded per pool" in info.env_description
    with pytest.raises(ValueError, match="needs transport='sessions'"):
        RemoteGymnasiumVectorEnv(server.target, 2, "CartPole-v1", channels=2)
    with pytest.raises(ValueError, match="needs transport='vector'"):
        RemoteGymnasiumVectorEnv(server.target, 2, "CartPole-v1", backend="envpool",
                                 transport="sessions")  # fmt: skip
    wait_idle(server)


def test_vector_env_spec_make_vec_and_render(server: ServerProcess) -> None:
    envs = gymnasium.make_vec("openenv-grpc/CartPole-v1", num_envs=3, target=server.target,
                              render_mode="rgb_array")  # fmt: skip
    try:
        assert isinstance(envs, RemoteGymnasiumVectorEnv) and envs.render_mode == "rgb_array"
        assert envs.spec is not None and envs.spec.id == "openenv-grpc/CartPole-v1"
        envs.reset(seed=0)
        frames = envs.render()
        assert frames is not None and len(frames) == 3
        assert all(f.shape == (400, 600, 3) and f.dtype == np.uint8 for f in frames)
    finally:
        envs.close()
    direct = RemoteGymnasiumVectorEnv(server.target, 2, "CartPole-v1")
    try:
        assert direct.spec is not None and direct.spec.kwargs["num_envs"] == 2
        again = gymnasium.make_vec(direct.spec)  # the spec makes the same vector env
        assert isinstance(again, RemoteGymnasiumVectorEnv) and again.num_envs == 2
        again.close()
    finally:
        direct.close()
    wait_idle(server)
