"""``--isolated 2`` and vector streams: a vector's envs are spread over both env processes
and stepped in parallel; a crash or a hung call in one process costs only the envs that
lived there (fresh ones take their place, to be reset) while the others answer on."""

from __future__ import annotations

import glob
import os
import signal
import threading
import time

import grpc

from openenv_grpc import VectorSession
from openenv_grpc_envs.echo import EchoAction, EchoVectorEnv
from support.echo_rows import echoed_pids, say
from support.raw_vector import RawVector


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


def test_a_hung_block_answers_deadline_exceeded_for_its_envs_only(start_server) -> None:
    server = start_server("support.envs:FaultyEnv", "--isolated", "2", "--step-timeout", "0.5")
    with VectorSession(server.target, 4) as envs:
        envs.reset()
        out = envs.step(say("sleep:30", "x", "y", "z"))  # killed at 0.5 s, not after 30
        assert out.indices == [2, 3]
        for index in (0, 1):
            assert out.errors[index].code is grpc.StatusCode.DEADLINE_EXCEEDED
        envs.reset(indices=[0, 1])
        assert envs.step(say("a", "b", "c", "d")).step_counts == [1, 1, 2, 2]


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


def _env_processes(server_pid: int) -> list[int]:
    """The server's env processes (its multiprocessing children, not the resource tracker)."""
    children: list[str] = []
    for path in glob.glob(f"/proc/{server_pid}/task/*/children"):
        with open(path) as listing:
            children += listing.read().split()
    found = []
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            if b"spawn_main" in cmdline.read():
                found.append(int(pid))
    return found


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
    [victim] = _env_processes(server.proc.pid)
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
