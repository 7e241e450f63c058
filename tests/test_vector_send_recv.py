"""EnvPool's asynchronous calls on the vector clients: ``send`` / ``recv`` on
``VectorSession`` and ``AsyncVectorSession`` (several steps in flight on one stream,
outcomes as they come), and ``batch_size < num_envs`` on ``RemoteGymnasiumVectorEnv``
(``async_reset``, ``send(actions, env_id)``, ``recv()`` with ``info["env_id"]``), equal
to ``SyncVectorEnv`` env for env. Concurrency is shown with gates, never a clock."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import gymnasium
import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv

from openenv_grpc import EnvError
from openenv_grpc.client import AsyncVectorSession, VectorSession
from openenv_grpc.client.errors import SessionStateError, SessionTimeout
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.echo import EchoAction
from openenv_grpc_envs.gymnasium.adapters import RemoteGymnasiumVectorEnv


def _say(*messages: str) -> list[EchoAction]:
    return [EchoAction(message=m) for m in messages]


def _entered(gate: Path) -> bool:
    return Path(f"{gate}.entered").exists()


# -- VectorSession / AsyncVectorSession ----------------------------------------------------


def test_two_halves_in_flight_are_received_as_each_completes(start_server) -> None:
    server = start_server("support.envs:FaultyEnv")
    with VectorSession(server.target, 4, autoreset="disabled") as envs:
        envs.reset()
        first = envs.send(_say("a", "b"), [0, 1])
        second = envs.send(_say("c", "d"), [2, 3])
        assert second == first + 1 and envs.in_flight == 2
        got = [envs.recv(), envs.recv()]
        assert envs.in_flight == 0
        assert sorted(tuple(o.indices) for o in got) == [(0, 1), (2, 3)]
        by_rows = {tuple(o.indices): o for o in got}
        assert [o.echoed_message for o in by_rows[(0, 1)].observations] == ["a", "b"]
        assert [o.echoed_message for o in by_rows[(2, 3)].observations] == ["c", "d"]
        assert envs.step_counts == [1, 1, 1, 1]
        # step = send + recv, and a send of all envs is one request.
        envs.send(_say("w", "x", "y", "z"))
        assert envs.recv().step_counts == [2, 2, 2, 2]
        with pytest.raises(SessionStateError, match=r"recv\(\) with no request in flight"):
            envs.recv()
        assert envs.step(_say("1", "2", "3", "4")).step_counts == [3, 3, 3, 3]
    server.wait_until(lambda: server.active() == 0 and server.closed_envs() == 4)


def test_a_send_on_an_env_in_flight_is_refused_and_the_rest_go_on(
    start_server, tmp_path: Path
) -> None:
    server = start_server("support.envs:FaultyEnv")
    gate = tmp_path / "gate"
    with VectorSession(server.target, 2, autoreset="disabled") as envs:
        envs.reset()
        envs.send(_say(f"gate:{gate}"), [0])
        server.wait_until(lambda: _entered(gate), what="env 0 at the gate")
        envs.send(_say("again"), [0])
        with pytest.raises(EnvError) as refused:
            envs.recv()  # the refusal is answered while env 0 is still at the gate
        assert refused.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert "env 0 (request 2) still in flight" in refused.value.message
        # A timed-out recv leaves the step in flight; a later recv gets it.
        with pytest.raises(SessionTimeout):
            envs.recv(timeout=0.2)
        assert envs.in_flight == 1
        gate.touch()
        outcome = envs.recv(timeout=30)
        assert outcome.indices == [0] and outcome.step_counts == [1]
        assert envs.step(_say("x", "y")).step_counts == [2, 1]
    server.wait_until(lambda: server.active() == 0 and server.closed_envs() == 2)


def test_past_the_servers_cap_recv_raises_resource_exhausted(start_server, tmp_path: Path) -> None:
    server = start_server("support.envs:FaultyEnv")  # --max-vector-in-flight 4
    gate = tmp_path / "gate"
    with VectorSession(server.target, 5, autoreset="disabled") as envs:
        envs.reset()
        envs.send(_say(f"gate:{gate}"), [0])
        server.wait_until(lambda: _entered(gate), what="env 0 at the gate")
        for index in (1, 2, 3):
            envs.send(_say("behind"), [index])
        envs.send(_say("fifth"), [4])
        with pytest.raises(EnvError) as refused:
            envs.recv()
        assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "MAX_VECTOR_IN_FLIGHT = 4" in refused.value.message
        gate.touch()
        rows = sorted(envs.recv().indices[0] for _ in range(4))
        assert rows == [0, 1, 2, 3]
        assert envs.step(_say("a", "b", "c", "d", "e")).step_counts == [2, 2, 2, 2, 1]
    server.wait_until(lambda: server.active() == 0 and server.closed_envs() == 5)


def test_a_step_while_a_send_is_in_flight_keeps_that_answer_for_recv(start_server) -> None:
    server = start_server("support.envs:FaultyEnv")
    with VectorSession(server.target, 2, autoreset="disabled") as envs:
        envs.reset()
        envs.send(_say("sent"), [0])
        # Answered after the send's (one batch call at a time in process): the step reads
        # that answer first and keeps it.
        stepped = envs.step(_say("stepped"), indices=[1])
        assert stepped.indices == [1] and stepped.observations[0].echoed_message == "stepped"
        assert envs.in_flight == 1
        kept = envs.recv(timeout=0)
        assert kept.indices == [0] and kept.observations[0].echoed_message == "sent"
    server.wait_until(lambda: server.active() == 0)


def test_a_call_after_a_timed_out_one_waits_for_its_envs(start_server, tmp_path: Path) -> None:
    """The server refuses a request on envs in flight: the client first takes the late
    answer of the call it gave up on (dropped), then sends."""
    server = start_server("support.envs:FaultyEnv")
    gate = tmp_path / "gate"

    async def main() -> None:
        async with AsyncVectorSession(server.target, 2, autoreset="disabled") as envs:
            await envs.reset()
            stepping = asyncio.ensure_future(envs.step(_say(f"gate:{gate}", "x"), timeout=0.3))
            with pytest.raises(SessionTimeout):
                await stepping
            gate.touch()
            after = await envs.step(_say("after", "after"), timeout=30)
            assert [o.echoed_message for o in after.observations] == ["after", "after"]
            assert after.step_counts == [2, 2]
            # send / recv on the asyncio client.
            await envs.send(_say("a"), [0])
            await envs.send(_say("b"), [1])
            got = sorted([(await envs.recv()).indices, (await envs.recv()).indices])
            assert got == [[0], [1]] and envs.step_counts == [3, 3]
            await envs.send_reset(indices=[1])
            reset = await envs.recv()
            assert reset.indices == [1] and envs.step_counts == [3, 0]

    asyncio.run(main())
    server.wait_until(lambda: server.active() == 0 and server.closed_envs() == 2)


# -- RemoteGymnasiumVectorEnv, batch_size < num_envs ---------------------------------------


@pytest.fixture(scope="module")
def gym_server() -> Iterator[ServerProcess]:
    process = ServerProcess("gymnasium", ["--max-concurrent-envs", "0"])
    yield process
    process.stop()


@pytest.mark.parametrize("backend", ["gymnasium", "envpool"])
def test_send_recv_in_two_batches_equals_sync_vector_env(
    gym_server: ServerProcess, backend: str
) -> None:
    """Two batches of 2 in flight, each stepped with the actions SyncVectorEnv gets for
    its envs: every env's rows equal the local ones (episodes end and autoreset)."""
    n = 4
    remote = RemoteGymnasiumVectorEnv(
        gym_server.target, n, "CartPole-v1", batch_size=2, backend=backend
    )
    local = SyncVectorEnv([lambda: gymnasium.make("CartPole-v1")] * n)
    try:
        assert remote.batch_size == 2
        obs, _ = remote.reset(seed=3)
        ref, _ = local.reset(seed=3)
        if backend == "gymnasium":
            assert np.array_equal(obs, ref)
        else:  # EnvPool seeds its own way: follow the remote envs' own starts
            ref = obs
        local.action_space.seed(1)
        ended = 0
        for round_ in range(60):
            actions = local.action_space.sample()
            # The halves go out in either order (the second reversed), like a trainer's.
            remote.send(actions[:2], np.array([0, 1]))
            remote.send(actions[2:][::-1], np.array([3, 2]))
            rows: dict[int, tuple[object, ...]] = {}
            for _ in range(2):
                got_obs, rewards, terminated, truncated, info = remote.recv()
                assert got_obs.shape == (2, 4) and info["env_id"].dtype == np.int32
                for r, env in enumerate(info["env_id"].tolist()):
                    rows[env] = (got_obs[r], rewards[r], terminated[r], truncated[r])
            assert sorted(rows) == [0, 1, 2, 3]
            if backend == "gymnasium":
                want = local.step(actions)
                for env in range(n):
                    assert np.array_equal(rows[env][0], want[0][env]), (round_, env)
                    assert rows[env][1:] == (want[1][env], want[2][env], want[3][env])
            ended += sum(bool(rows[e][2] or rows[e][3]) for e in range(n))
        assert ended >= 2
    finally:
        remote.close()
        local.close()
    gym_server.wait_until(lambda: gym_server.active() == 0, what="every slot back")


def test_async_reset_then_recv_returns_each_batch(gym_server: ServerProcess) -> None:
    with RemoteGymnasiumVectorEnv(gym_server.target, 6, "CartPole-v1", batch_size=2) as envs:
        envs.async_reset()
        seen: list[int] = []
        for _ in range(3):
            obs, rewards, terminated, truncated, info = envs.recv()
            assert obs.shape == (2, 4)
            assert not rewards.any() and not terminated.any() and not truncated.any()
            seen += info["env_id"].tolist()
            envs.send(np.zeros(2, dtype=np.int64), info["env_id"])
        assert sorted(seen) == [0, 1, 2, 3, 4, 5]
        for _ in range(3):
            _, rewards, _, _, info = envs.recv()
            assert rewards.tolist() == [1.0, 1.0]
        with pytest.raises(RuntimeError, match="with nothing in flight"):
            envs.recv()
    gym_server.wait_until(lambda: gym_server.active() == 0, what="every slot back")


def test_async_mode_errors_leave_the_env_usable(gym_server: ServerProcess) -> None:
    target = gym_server.target
    for bad in (0, 5, 2.5):
        with pytest.raises(ValueError, match="batch_size"):
            RemoteGymnasiumVectorEnv(target, 4, "CartPole-v1", batch_size=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs transport='vector'"):
        RemoteGymnasiumVectorEnv(target, 4, "CartPole-v1", batch_size=2, transport="sessions")
    with RemoteGymnasiumVectorEnv(target, 4, "CartPole-v1", batch_size=2) as envs:
        with pytest.raises(RuntimeError, match="before send"):
            envs.send(np.zeros(2, dtype=np.int64), [0, 1])
        envs.async_reset()
        with pytest.raises(RuntimeError, match="requests in flight"):
            envs.async_reset()
        for env_id in ([0, 0], [3, 4], [-1, 1], []):
            with pytest.raises(ValueError, match="env_id must name distinct sub-envs"):
                envs.send(np.zeros(len(env_id), dtype=np.int64), env_id)
        for _ in range(2):
            envs.recv()
        with pytest.raises(RuntimeError, match="with nothing in flight"):
            envs.recv()
        # The synchronous calls work again once nothing is in flight.
        obs, _ = envs.reset(seed=0)
        assert envs.step(np.zeros(4, dtype=np.int64))[0].shape == obs.shape == (4, 4)
    gym_server.wait_until(lambda: gym_server.active() == 0, what="every slot back")
