"""Prometheus metrics move as sessions run (a vector stream counts as N sessions); log lines
carry the session id."""

from __future__ import annotations

import json
import re

import grpc
import pytest

from openenv_grpc import CapacityError, EnvError, Session, VectorSession
from openenv_grpc_envs.echo import EchoAction, EchoEnv
from support.metrics import samples
from support.raw_vector import RawVector

pytestmark = pytest.mark.shared_server


def scrape(server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:  # type: ignore[no-untyped-def]
    """Every sample as {(name, sorted labels without env): value}."""
    return {
        (sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "env"))): (
            sample.value
        )
        for sample in samples(server)
    }


def test_metrics_count_sessions_steps_errors_and_refusals(start_server) -> None:
    server = start_server(
        "support.envs:CountingEchoEnv", "--metrics-port", "0", "--max-concurrent-envs", "2"
    )
    before = scrape(server)
    assert before[("openenv_sessions_active", ())] == 0
    assert before[("openenv_sessions_capacity", ())] == 2
    with EchoEnv(server.target) as first, EchoEnv(server.target) as second:
        assert scrape(server)[("openenv_sessions_active", ())] == 2
        with pytest.raises(CapacityError):
            EchoEnv(server.target).open()
        with pytest.raises(EnvError):
            first.step(EchoAction(message="before reset"))
        for env in (first, second):
            env.reset()
            for i in range(5):
                env.step(EchoAction(message=str(i)))
    second_env = EchoEnv(server.target)
    second_env.open()
    second_env.abort()
    server.wait_until(lambda: server.active() == 0, what="sessions released")
    after = scrape(server)
    assert after[("openenv_sessions_active", ())] == 0
    assert after[("openenv_step_seconds_count", ())] == 10
    assert after[("openenv_request_errors_total", (("code", "FAILED_PRECONDITION"),))] == 1
    assert after[("openenv_sessions_refused_total", (("reason", "full"),))] == 1
    assert after[("openenv_session_duration_seconds_count", (("reason", "closed"),))] == 2
    # A cancel reaches the server as the end of the client's input, like a half-close, or
    # (when it lands while the handler awaits) as the cancellation of the handler's task.
    ended = [
        after.get(("openenv_session_duration_seconds_count", (("reason", reason),)), 0)
        for reason in ("client_ended", "cancelled")
    ]
    assert sum(ended) == 1, ended


def test_a_vector_stream_is_n_sessions_to_prometheus(start_server) -> None:
    server = start_server(
        "support.envs:FaultyEnv", "--metrics-port", "0", "--max-concurrent-envs", "6"
    )
    with VectorSession(server.target, 4) as envs:
        assert scrape(server)[("openenv_sessions_active", ())] == 4
        refused = RawVector(server.target, 3).refusal()
        assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        envs.reset()
        envs.step([EchoAction(message=m) for m in ("a", "b", "raise", "d")])
        envs.step([EchoAction(message=m) for m in ("a", "b", "c")], indices=[0, 1, 3])
    server.wait_until(lambda: server.active() == 0, what="slots released")
    after = scrape(server)
    assert after[("openenv_step_seconds_count", ())] == 6  # one per env that stepped
    assert after[("openenv_request_errors_total", (("code", "INTERNAL"),))] == 1
    assert after[("openenv_sessions_refused_total", (("reason", "full"),))] == 3
    assert after[("openenv_session_duration_seconds_count", (("reason", "closed"),))] == 4


def test_metrics_are_off_by_default(server) -> None:
    assert not any("metrics on" in line for line in server.stdout_lines)


def test_json_log_lines_carry_the_session_id(start_server) -> None:
    server = start_server("support.envs:FaultyEnv", "--log-format", "json", "--log-level", "DEBUG")
    with Session(server.target) as env:
        env.reset()
        with pytest.raises(EnvError) as failed:
            env.step(EchoAction(message="raise"))
        assert failed.value.code is grpc.StatusCode.INTERNAL
        session_id = env.session_id
    assert re.fullmatch(r"[0-9a-f]{16}", session_id)
    server.wait_until(lambda: "session ended" in server.stderr(), what="session end logged")
    lines = [json.loads(line) for line in server.stderr().splitlines() if line.startswith("{")]
    mine = [line for line in lines if line["session"] == session_id]
    messages = [line["message"] for line in mine]
    assert "session opened" in messages
    assert any(m.startswith("session ended (closed) after ") for m in messages)
    failure = next(line for line in mine if line["message"] == "environment step() raised")
    assert failure["level"] == "ERROR" and "RuntimeError: boom in step" in failure["exception"]
    assert all(line["session"] == "-" for line in lines if line not in mine)
