"""``--isolated``: when a call loses an env process, the envs of its block that the call
did not name are fresh ones too. Each is told so (UNAVAILABLE, "reset it") by the next
step, state or snapshot that names it -- never stepped unreset as if its episode went on
-- until a reset or a restore gives it an episode again."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from openenv_grpc import EnvError, VectorSession
from openenv_grpc_envs.echo import EchoVectorEnv
from support.echo_rows import echoed_pids, say

pytestmark = pytest.mark.timeout(60)


def test_the_unnamed_envs_of_a_lost_block_say_so_until_reset(start_server) -> None:
    server = start_server("support.envs:FaultyEnv", "--isolated", "2")
    with VectorSession(server.target, 4) as envs:
        envs.reset()
        before = echoed_pids(envs.step(say("pid", "pid", "pid", "pid")))
        assert before[0] == before[1] != before[2] == before[3]  # blocks [0, 1] and [2, 3]
        # A step of env 0 alone kills the process that holds envs 0 and 1.
        out = envs.step(say("exit"), indices=[0])
        assert out.indices == [] and out.errors[0].code is grpc.StatusCode.UNAVAILABLE
        # Env 1 was not named, but its env is a fresh one: a step says so, not an echo.
        out = envs.step(say("b", "c", "d"), indices=[1, 2, 3])
        assert out.indices == [2, 3] and out.step_counts == [2, 2]
        error = out.errors[1]
        assert error.code is grpc.StatusCode.UNAVAILABLE
        assert error.message.startswith("its env process was lost during a step of other envs")
        assert error.message.endswith("a fresh environment took this one's place: reset it")
        # Told once: from now on it is an env with no episode, as env 0 is.
        again = envs.step(say("b"), indices=[1])
        assert again.errors[1].code is grpc.StatusCode.FAILED_PRECONDITION
        envs.reset(indices=[0, 1])
        after = echoed_pids(envs.step(say("pid", "pid", "pid", "pid")))
        assert after[0] == after[1] != before[0] and after[2:] == before[2:]
        assert envs.step_counts == [1, 1, 3, 3]
    # Six envs were made; the two of the killed process died with it, the rest closed.
    server.wait_until(lambda: server.active() == 0 and server.closed_envs() == 4)
    assert server.created() == 6


def test_a_state_or_snapshot_of_an_unnamed_lost_env_says_so(start_server) -> None:
    server = start_server("support.envs:FaultyEnv", "--isolated", "2")
    with VectorSession(server.target, 4) as envs:
        envs.reset()
        envs.step(say("exit"), indices=[2])  # envs 2 and 3 live in the process it kills
        with pytest.raises(Exception) as failed:
            envs.states(indices=[3])
        assert "reset it" in str(failed.value)
        # Told once; the other block's envs were never touched.
        assert envs.step(say("a", "b"), indices=[0, 1]).step_counts == [1, 1]
        envs.reset(indices=[2, 3])
        assert envs.step(say("c", "d"), indices=[2, 3]).step_counts == [1, 1]
    server.wait_until(lambda: server.active() == 0)


def test_a_restore_gives_a_lost_env_its_episode_back(start_server) -> None:
    server = start_server("support.envs:SnapshotEchoEnv", "--isolated", "2")
    with EchoVectorEnv(server.target, 4) as envs:
        envs.reset(seeds=1)
        pids = echoed_pids(envs.step(say("pid", "pid", "pid", "pid")))
        snapshot = envs.snapshot(indices=[1])[0]
        os.kill(pids[0], signal.SIGKILL)  # the process of envs 0 and 1
        out = envs.step(say("a"), indices=[0])
        assert out.errors[0].code is grpc.StatusCode.UNAVAILABLE
        envs.restore([snapshot], indices=[1])  # env 1 was lost unnamed: a restore revives it
        assert envs.step(say("b"), indices=[1]).step_counts == [2]
    server.wait_until(lambda: server.active() == 0)


def test_requests_in_flight_that_lost_the_same_block_are_each_told_once(
    start_server, tmp_path
) -> None:
    server = start_server("support.envs:FaultyEnv", "--isolated", "2")
    with VectorSession(server.target, 4) as envs:
        envs.reset()
        pids = echoed_pids(envs.step(say("pid", "pid", "pid", "pid")))
        gate = tmp_path / "gate"
        envs.send(say(f"gate:{gate}"), indices=[0])  # holds the process of envs 0 and 1
        envs.send(say("y"), indices=[1])  # queued behind it in the same process
        deadline = time.monotonic() + 30
        while not (tmp_path / "gate.entered").exists():
            assert time.monotonic() < deadline, "the gated step never started"
            time.sleep(0.01)
        os.kill(pids[0], signal.SIGKILL)
        answers = [envs.recv(timeout=30), envs.recv(timeout=30)]
        for answer in answers:
            (index,) = answer.errors
            assert answer.errors[index].code is grpc.StatusCode.UNAVAILABLE
        assert sorted(i for a in answers for i in a.errors) == [0, 1]
        # Each was told by its own answer: a state of either is a fresh env's, not an error.
        assert len(envs.states(indices=[0, 1])) == 2
        envs.reset(indices=[0, 1])
        assert envs.step(say("a", "b"), indices=[0, 1]).step_counts == [1, 1]
    server.wait_until(lambda: server.active() == 0)


def test_a_refused_reset_leaves_a_lost_env_lost(start_server) -> None:
    server = start_server("support.exiting_envs:PooledExitEnv", "--isolated", "2")
    with VectorSession(server.target, 4) as envs:
        envs.reset()
        envs.step(say("exit"), indices=[0])  # env 1, not named, is lost with env 0
        refused = envs.reset(seeds=[5], indices=[1])  # the env refuses this reset
        assert refused.errors[1].code is grpc.StatusCode.INVALID_ARGUMENT
        # No episode began: env 1 is still a fresh env that was never reset.
        out = envs.step(say("b"), indices=[1])
        assert out.indices == [] and out.errors[1].code is grpc.StatusCode.UNAVAILABLE
        assert out.errors[1].message.endswith("reset it")
        envs.reset(indices=[0, 1])
        assert envs.step(say("a", "b"), indices=[0, 1]).step_counts == [1, 1]
    server.wait_until(lambda: server.active() == 0)


def test_a_state_that_finds_its_env_process_gone_ends_the_episode(start_server) -> None:
    server = start_server("support.exiting_envs:PooledExitEnv", "--isolated", "2")
    with VectorSession(server.target, 4) as envs:
        envs.reset()
        pids = echoed_pids(envs.step(say("pid", "pid", "pid", "pid")))
        os.kill(pids[0], signal.SIGKILL)  # the process of envs 0 and 1, from outside
        with pytest.raises(EnvError) as failed:
            envs.states(indices=[0])
        assert failed.value.code is grpc.StatusCode.UNAVAILABLE
        # The state told env 0 its env is fresh: a step now is refused, never run on it.
        out = envs.step(say("a"), indices=[0])
        assert out.errors[0].code is grpc.StatusCode.FAILED_PRECONDITION
        # Env 1 was not named by the state: its first request learns it.
        out = envs.step(say("b", "c", "d"), indices=[1, 2, 3])
        assert out.indices == [2, 3] and out.errors[1].code is grpc.StatusCode.UNAVAILABLE
        envs.reset(indices=[0, 1])
        assert envs.step(say("a", "b"), indices=[0, 1]).step_counts == [1, 1]
    server.wait_until(lambda: server.active() == 0)


def test_a_hung_blocks_envs_are_told_it_was_their_own_call(start_server) -> None:
    server = start_server("support.envs:FaultyEnv", "--isolated", "2", "--step-timeout", "0.5")
    with VectorSession(server.target, 4) as envs:
        envs.reset()
        out = envs.step(say("sleep:30", "x"), indices=[0, 1])
        assert out.errors[0].code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert out.errors[0].message == (
            "the call did not finish within 0.5s; the environment's worker process was "
            "stopped; a fresh environment took this one's place: reset it"
        )
