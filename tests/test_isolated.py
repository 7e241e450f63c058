"""Isolated mode (``--isolated K``): envs live in env processes, never in the server's.

A Session's env, or a vector's envs in blocks, are placed on the least-loaded env process.
A crash or a hung call in one process costs only what lived there: a Session on it is
lost, a vector's envs there are replaced by fresh ones, each told so (UNAVAILABLE or
DEADLINE_EXCEEDED, "reset it") once, by the next request that names it, never stepped
unreset as if its episode went on. Everyone else answers on, and the pool replaces the
process for the next open.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import grpc
import pytest

from openenv_grpc import EnvError, Session, SessionLost, SessionRefused, VectorSession, fetch_info
from openenv_grpc_envs.echo import EchoAction, EchoVectorEnv
from support.echo_rows import echoed_pids, say
from support.procs import env_processes
from support.raw_vector import RawVector

pytestmark = pytest.mark.timeout(60)


# -- placement: in env processes, a vector spread over them in blocks ------------------


def test_sessions_run_in_worker_processes(start_server) -> None:
    server = start_server("support.envs:CountingEchoEnv", "--isolated", "2")
    with Session(server.target) as first, Session(server.target) as second:
        for env, word in ((first, "one"), (second, "two")):
            env.reset()
            assert env.step(EchoAction(message=word)).observation.echoed_message == word
        assert fetch_info(server.target).capacity.active_sessions == 2
    server.wait_until(lambda: server.closed_envs() == 2, what="both envs closed")
    assert server.created() == 2


def test_a_vectors_envs_are_spread_over_the_env_processes_and_step_in_parallel(
    start_server, tmp_path
) -> None:
    server = start_server("support.envs:FaultyEnv", "--isolated", "2")
    with VectorSession(server.target, 4) as envs:
        envs.reset()
        pids = echoed_pids(envs.step(say("pid", "pid", "pid", "pid")))
        assert pids[0] == pids[1] and pids[2] == pids[3] and pids[0] != pids[2]
        assert server.proc.pid not in pids
        assert server.created() == 4 and server.active() == 4
        # Envs 0 and 2 live in different processes and each waits for the other to start:
        # they can only both answer if the two processes step at the same time.
        meet = f"meet:{tmp_path}:2"
        out = envs.step(say(meet, "x", meet, "y"))
        assert out.errors == {}, out.errors
        assert out.indices == [0, 1, 2, 3] and out.step_counts == [2, 2, 2, 2]
        assert envs.states(indices=[1, 2]) == [envs.state(1), envs.state(2)]
    server.wait_until(lambda: server.closed_envs() == 4 and server.active() == 0)


def test_a_native_batch_lives_in_one_env_process(start_server) -> None:
    server = start_server("support.envs:BatchingEchoEnv", "--isolated", "2")
    with EchoVectorEnv(server.target, 3) as envs:
        assert envs.native
        envs.reset(batch=True)
        out = envs.step_batch(EchoAction(message="a\nb\nc"))
        assert out.batch_observation is not None
        assert out.batch_observation.echoed_message == "a\nb\nc"
        assert envs.step(say("x", "y", "z"), indices=None).step_counts == [2, 2, 2]
    server.wait_until(lambda: server.closed_envs() == 3 and server.active() == 0)


# -- crashes: only what lived in the dead process is lost ------------------------------


@pytest.mark.parametrize("crash", ["exit", "segfault"])
def test_a_crash_ends_only_the_sessions_on_that_worker(start_server, crash: str) -> None:
    server = start_server("support.envs:FaultyEnv", "--isolated", "2")
    # Least loaded first: the two sessions land on different workers.
    with Session(server.target) as doomed, Session(server.target) as neighbour:
        doomed.reset()
        neighbour.reset()
        with pytest.raises(SessionLost) as lost:
            doomed.step(EchoAction(message=crash))
        assert lost.value.code is grpc.StatusCode.UNAVAILABLE
        assert lost.value.message == "session lost: the environment's worker process died"
        for i in range(5):
            echoed = neighbour.step(EchoAction(message=f"still {i}")).observation.echoed_message
            assert echoed == f"still {i}"
    server.wait_until(lambda: server.active() == 0, what="slots released")
    # The pool replaced the dead worker: new sessions work.
    for _ in range(3):
        with Session(server.target) as fresh:
            fresh.reset()
            assert fresh.step(EchoAction(message="new")).observation.echoed_message == "new"
    assert server.proc.poll() is None


def test_a_crashed_env_process_loses_only_its_envs_and_the_stream_goes_on(start_server) -> None:
    server = start_server("support.envs:FaultyEnv", "--isolated", "2")
    with VectorSession(server.target, 4) as envs, EchoVectorEnv(server.target, 2) as other:
        envs.reset()
        other.reset()
        before = echoed_pids(envs.step(say("pid", "pid", "pid", "pid")))
        out = envs.step(say("exit", "x", "y", "z"))  # env 0's process dies mid-step
        assert out.indices == [2, 3] and out.step_counts == [2, 2]
        for index in (0, 1):
            assert out.errors[index].code is grpc.StatusCode.UNAVAILABLE
            assert "reset it" in out.errors[index].message
        # Envs 0 and 1 are fresh ones now: they answer once reset.
        refused = envs.step(say("a", "b", "c", "d"))
        assert refused.indices == [2, 3]
        assert refused.errors[0].code is grpc.StatusCode.FAILED_PRECONDITION
        envs.reset(indices=[0, 1])
        after = echoed_pids(envs.step(say("pid", "pid", "pid", "pid")))
        assert after[0] == after[1] != before[0] and after[2:] == before[2:]
        assert envs.step_counts == [1, 1, 4, 4]
        # The other stream's envs on the dead process were lost and replaced too, or
        # lived on the other process: either way it answers.
        answered = other.step(say("p", "q"))
        assert len(answered.indices) + len(answered.errors) == 2
    server.wait_until(lambda: server.active() == 0)


def test_factory_failure_in_a_worker_is_reported(start_server) -> None:
    server = start_server("support.envs:failing_factory", "--isolated", "1")
    with pytest.raises(SessionRefused) as refused:
        Session(server.target).open()
    assert refused.value.code is grpc.StatusCode.INTERNAL
    assert refused.value.message == (
        "could not create the environment: RuntimeError: no GPU left for this env"
    )
    server.wait_until(lambda: server.active() == 0, what="slot released")


def test_an_env_process_dying_during_the_open_is_unavailable_and_leaves_nothing(
    start_server,
) -> None:
    """UNAVAILABLE (not INTERNAL): nothing was made and another open may succeed, as the
    next one here does once the pool has replaced the process."""
    server = start_server(
        "support.envs:SlowFactoryEnv",
        *("--isolated", "1"),
        extra_env={"OPENENV_TEST_FACTORY_SECONDS": "2"},
    )
    [victim] = env_processes(server.proc.pid)
    refusal: list[grpc.RpcError] = []
    opening = threading.Thread(target=lambda: refusal.append(RawVector(server.target, 2).refusal()))
    opening.start()
    server.wait_until(lambda: server.active() == 2, what="the open admitted")
    time.sleep(0.5)  # the factories are running in the env process now
    os.kill(victim, signal.SIGKILL)
    opening.join(30)
    [call] = refusal
    assert call.code() is grpc.StatusCode.UNAVAILABLE
    assert "could not create the environment" in call.details()
    assert "open again" in call.details()
    server.wait_until(lambda: server.active() == 0, what="both slots freed")
    with VectorSession(server.target, 2) as envs:  # a fresh env process serves the next open
        envs.reset()
        assert envs.step(say("a", "b")).step_counts == [1, 1]
    server.wait_until(lambda: server.active() == 0)


# -- a lost block: the envs a call did not name are told too --------------------------


def starts_over(envs: VectorSession) -> None:
    """Envs 0 and 1, of the lost block, take a reset and step from there."""
    envs.reset(indices=[0, 1])
    assert envs.step(say("a", "b"), indices=[0, 1]).step_counts == [1, 1]


def env_1_is_told_it_was_lost(envs: VectorSession) -> Any:
    """Step envs 1 to 3 after the process of envs 0 and 1 was lost to a call that did not
    name env 1: envs 2 and 3 step, env 1 is told (UNAVAILABLE, reset it). The outcome."""
    out = envs.step(say("b", "c", "d"), indices=[1, 2, 3])
    assert out.indices == [2, 3]
    error = out.errors[1]
    assert error.code is grpc.StatusCode.UNAVAILABLE
    assert error.message.endswith("a fresh environment took this one's place: reset it")
    return out


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
        told = env_1_is_told_it_was_lost(envs)
        assert told.step_counts == [2, 2]
        assert told.errors[1].message.startswith(
            "its env process was lost during a step of other envs"
        )
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
        with pytest.raises(EnvError) as failed:
            envs.states(indices=[3])
        assert failed.value.code is grpc.StatusCode.UNAVAILABLE
        assert "env 3: its env process was lost" in failed.value.message
        assert failed.value.message.endswith("a fresh environment took this one's place: reset it")
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
        server.wait_until((tmp_path / "gate.entered").exists, 30, "the gated step running")
        os.kill(pids[0], signal.SIGKILL)
        answers = [envs.recv(timeout=30), envs.recv(timeout=30)]
        for answer in answers:
            (index,) = answer.errors
            assert answer.errors[index].code is grpc.StatusCode.UNAVAILABLE
        assert sorted(i for a in answers for i in a.errors) == [0, 1]
        # Each was told by its own answer: a state of either is a fresh env's, not an error.
        assert len(envs.states(indices=[0, 1])) == 2
        starts_over(envs)
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
        starts_over(envs)
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
        env_1_is_told_it_was_lost(envs)
        starts_over(envs)
    server.wait_until(lambda: server.active() == 0)


# -- a hung call: answered at the step timeout, its process replaced --------------------


def test_a_hung_block_answers_deadline_exceeded_for_its_envs_only(start_server) -> None:
    """Envs 0 and 1 share a process; env 0's step hangs: both are told it was their own
    call (killed at 0.5 s, not after 30), while the other block's envs step on."""
    server = start_server("support.envs:FaultyEnv", "--isolated", "2", "--step-timeout", "0.5")
    with VectorSession(server.target, 4) as envs:
        envs.reset()
        out = envs.step(say("sleep:30", "x", "y", "z"))
        assert out.indices == [2, 3] and out.step_counts == [1, 1]
        for index in (0, 1):
            assert out.errors[index].code is grpc.StatusCode.DEADLINE_EXCEEDED
            assert out.errors[index].message == (
                "the call did not finish within 0.5s; the environment's worker process was "
                "stopped; a fresh environment took this one's place: reset it"
            )
        envs.reset(indices=[0, 1])
        assert envs.step(say("a", "b", "c", "d")).step_counts == [1, 1, 2, 2]
    server.wait_until(lambda: server.active() == 0)


# -- drain --------------------------------------------------------------------------------


def test_drain_closes_envs_in_the_workers(start_server) -> None:
    server = start_server("support.envs:CountingEchoEnv", "--isolated", "2", "--grace", "1")
    sessions = [Session(server.target) for _ in range(3)]
    for env in sessions:
        env.open()
        env.reset()
    assert server.terminate() == 0
    assert server.created() == server.closed_envs() == 3
    for env in sessions:
        env.abort()
