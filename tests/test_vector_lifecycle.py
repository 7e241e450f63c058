"""Every ending of a VectorSession stream closes all N envs and frees all N slots, once:
a close, a cancel, a SIGKILLed client holding two streams, the idle timeout, a drain."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest

from openenv_grpc import VectorSession
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc_envs.echo import EchoAction
from support.raw_vector import RawVector

ROOT = Path(__file__).resolve().parent


def _all_released(server, closed: int, timeout: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    server.wait_until(lambda: server.closed_envs() == closed, timeout, f"{closed} envs closed")
    server.wait_until(lambda: server.active() == 0, timeout, "no slot held")
    assert server.open_envs() == 0


CLIENT = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from support.raw_vector import RawVector
    from openenv_grpc_envs.echo import EchoAction

    streams = [RawVector(sys.argv[1], 3), RawVector(sys.argv[1], 2)]
    for stream in streams:
        stream.reset()
        stream.step([EchoAction(message="before the kill")] * 3 if stream is streams[0]
                    else [EchoAction(message="x")] * 2)
    print("ready", flush=True)
    time.sleep(600)
    """
)


def test_a_sigkilled_client_holding_two_vector_streams_frees_every_slot(server) -> None:
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, server.target, str(ROOT)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert client.stdout is not None
        line = client.stdout.readline()
        assert line.strip() == "ready", client.stderr.read() if client.stderr else ""
        assert server.active() == 5 and server.open_envs() == 5
        client.send_signal(signal.SIGKILL)
        assert client.wait(10) == -signal.SIGKILL
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    _all_released(server, 5)
    assert server.created() == 5


def test_cancel_and_half_close_close_every_env(server) -> None:
    cancelled = RawVector(server.target, 4)
    cancelled.reset()
    cancelled.call.cancel()
    _all_released(server, 4)
    half = RawVector(server.target, 3)
    half.reset()
    half.end()  # no close command: the end of input is the end of the stream
    _all_released(server, 7)


def test_idle_timeout_closes_every_env_of_a_vector_stream(start_server) -> None:
    server = start_server("support.envs:CountingEchoEnv", "--idle-timeout", "0.5")
    idle = RawVector(server.target, 3)
    idle.reset()
    busy = RawVector(server.target, 2)
    busy.reset()

    def busy_steps_until_idle_reaped() -> bool:
        assert not busy.step([EchoAction(message="tick")] * 2).result.errors
        return server.closed_envs() == 3

    server.wait_until(busy_steps_until_idle_reaped, 10.0, "the idle stream reaped")
    assert server.active() == 2
    with pytest.raises(grpc.RpcError) as ended:
        idle.step([EchoAction(message="too late")] * 3)
    assert ended.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert "idle" in (ended.value.details() or "")
    busy.close()
    _all_released(server, 5)


def test_drain_tells_a_vector_stream_then_closes_all_its_envs(start_server) -> None:
    server = start_server("support.envs:CountingEchoEnv", "--grace", "1")
    stream = RawVector(server.target, 4)
    stream.reset()
    server.proc.send_signal(signal.SIGTERM)
    server.wait_until(lambda: server.proc.poll() is not None or _noticed(stream), 10, "notice")
    assert stream.notices and stream.notices[0].kind == pb.NOTICE_KIND_DRAINING
    assert "draining" in stream.notices[0].message
    deadline = time.monotonic() + 10
    with pytest.raises(grpc.RpcError) as ended:
        while time.monotonic() < deadline:  # steps go on during the grace, then it ends
            stream.step([EchoAction(message="during grace")] * 4)
            time.sleep(0.05)
    assert ended.value.code() is grpc.StatusCode.UNAVAILABLE
    assert server.proc.wait(10) == 0
    assert server.closed_envs() == 4 and server.open_envs() == 0


def _noticed(stream: RawVector) -> bool:
    """Step once (the notice arrives before the answer); True once a notice was read."""
    try:
        stream.step([EchoAction(message="poll")] * 4)
    except grpc.RpcError:
        return True
    return bool(stream.notices)


def test_a_factory_failure_frees_all_n_slots(start_server) -> None:
    server = start_server("support.envs:failing_factory", "--max-concurrent-envs", "4")
    refused = RawVector(server.target, 4).refusal()
    assert refused.code() is grpc.StatusCode.INTERNAL
    assert "no GPU left" in (refused.details() or "")
    server.wait_until(lambda: server.active() == 0, 10, "slots freed")


def test_a_vector_stream_is_n_sessions_to_prometheus(start_server) -> None:
    from test_observability import metrics_url, scrape

    server = start_server(
        "support.envs:FaultyEnv", "--metrics-port", "0", "--max-concurrent-envs", "6"
    )
    url = metrics_url(server)
    with VectorSession(server.target, 4) as envs:
        assert scrape(url)[("openenv_sessions_active", ())] == 4
        refused = RawVector(server.target, 3).refusal()
        assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        envs.reset()
        envs.step(_echo("a", "b", "raise", "d"))
        envs.step(_echo("a", "b", "c"), indices=[0, 1, 3])
    server.wait_until(lambda: server.active() == 0, what="slots released")
    after = scrape(url)
    assert after[("openenv_step_seconds_count", ())] == 6  # one per env that stepped
    assert after[("openenv_request_errors_total", (("code", "INTERNAL"),))] == 1
    assert after[("openenv_sessions_refused_total", (("reason", "full"),))] == 3
    assert after[("openenv_session_duration_seconds_count", (("reason", "closed"),))] == 4


def test_a_vector_open_without_the_token_is_unauthenticated_before_any_env(start_server) -> None:
    server = start_server("support.envs:CountingEchoEnv", extra_env={"AUTH_TOKEN": "s3cret"})
    refused = RawVector(server.target, 3).refusal()
    assert refused.code() is grpc.StatusCode.UNAUTHENTICATED
    assert server.created() == 0
    with VectorSession(server.target, 3, token="s3cret") as envs:
        assert envs.reset().indices == [0, 1, 2]
    server.wait_until(lambda: server.closed_envs() == 3)


def _echo(*messages: str) -> list[EchoAction]:
    return [EchoAction(message=m) for m in messages]
