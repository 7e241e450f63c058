"""Isolated mode: envs in worker processes; a crash ends only that worker's sessions."""

from __future__ import annotations

import grpc
import pytest

from openenv_grpc import Session, SessionLost, SessionRefused, fetch_info
from openenv_grpc_envs.echo import EchoAction


def test_sessions_run_in_worker_processes(start_server) -> None:
    server = start_server("support.envs:CountingEchoEnv", "--isolated", "2")
    with Session(server.target) as first, Session(server.target) as second:
        for env, word in ((first, "one"), (second, "two")):
            env.reset()
            assert env.step(EchoAction(message=word)).observation.echoed_message == word
        assert fetch_info(server.target).capacity.active_sessions == 2
    server.wait_until(lambda: server.closed_envs() == 2, what="both envs closed")
    assert server.created() == 2


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


def test_factory_failure_in_a_worker_is_reported(start_server) -> None:
    server = start_server("support.envs:failing_factory", "--isolated", "1")
    with pytest.raises(SessionRefused) as refused:
        Session(server.target).open()
    assert refused.value.code is grpc.StatusCode.INTERNAL
    assert refused.value.message == (
        "could not create the environment: RuntimeError: no GPU left for this env"
    )
    server.wait_until(lambda: server.active() == 0, what="slot released")


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
