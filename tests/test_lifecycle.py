"""Stream lifecycles over real server processes: every way a Session or VectorSession
stream ends closes each of its envs and frees each slot exactly once; plus Info,
reflection and the env execution modes. Where the promise is the same for both streams
the test is parametrized over them (``_Stream``: a Session is a vector of one)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pool as protobuf_descriptor_pool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

import openenv_grpc
from openenv_grpc import (
    AsyncVectorSession,
    CapacityError,
    EnvError,
    Session,
    SessionLost,
    SessionRefused,
    VectorSession,
)
from openenv_grpc.client import aio_channel
from openenv_grpc.client.info import message_classes
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc
from openenv_grpc_envs.echo import (
    AsyncEchoEnv,
    EchoAction,
    EchoEnv,
    EchoEnvironment,
    EchoObservation,
    EchoState,
)
from support.metrics import sessions_ended
from support.raw_vector import RawVector

pytestmark = pytest.mark.shared_server

SERVICE = "openenv_grpc.v1.EnvService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _open(target: str | grpc.Channel) -> EchoEnv:
    env = EchoEnv(target)
    env.open()
    return env


def _wait_released(server, closed: int, *, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    server.wait_until(lambda: server.closed_envs() == closed, timeout, f"{closed} env(s) closed")
    server.wait_until(lambda: server.active() == 0, timeout, "no active session")
    assert server.open_envs() == 0


#: The two streams: a Session (one env) and a VectorSession of three.
STREAMS = [pytest.param(1, id="session"), pytest.param(3, id="vector")]


class _Stream:
    """A Session (``rows`` 1) or a VectorSession of ``rows`` envs, driven alike: each step
    sends one echo action to every env and returns (echo, step count) per env."""

    def __init__(self, target: str, rows: int) -> None:
        self.rows = rows
        self.client: Any = EchoEnv(target) if rows == 1 else VectorSession(target, rows)

    def open(self) -> _Stream:
        self.client.open()
        return self

    def step(self, message: str) -> list[tuple[str, int]]:
        action = EchoAction(message=message)
        if self.rows == 1:
            result = self.client.step(action)
            return [(result.observation.echoed_message, result.step_count)]
        outcome = self.client.step([action] * self.rows)
        assert not outcome.errors, outcome.errors
        rows = zip(outcome.observations, outcome.step_counts, strict=True)
        return [(observation.echoed_message, count) for observation, count in rows]


# -- a vanished client ----------------------------------------------------------------

CLIENT_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from openenv_grpc import VectorSession
    from openenv_grpc_envs.echo import EchoAction, EchoEnv

    streams = []
    for rows in map(int, sys.argv[2].split(",")):  # a Session where rows is 1
        stream = EchoEnv(sys.argv[1]) if rows == 1 else VectorSession(sys.argv[1], rows)
        stream.open()
        stream.reset()
        action = EchoAction(message="before the kill")
        if rows == 1:
            assert stream.step(action).step_count == 1
        else:
            assert stream.step([action] * rows).step_counts == [1] * rows
        streams.append(stream)
    print("ready", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize(
    "streams", [pytest.param("1", id="session"), pytest.param("3,2", id="two-vector-streams")]
)
def test_a_sigkilled_client_frees_every_slot_and_closes_every_env(server, streams: str) -> None:
    envs = sum(map(int, streams.split(",")))
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT_SCRIPT, server.target, streams],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert client.stdout is not None
        line = client.stdout.readline()
        assert line.strip() == "ready", client.stderr.read() if client.stderr else ""
        assert server.active() == envs
        assert server.open_envs() == envs
        client.send_signal(signal.SIGKILL)
        assert client.wait(10) == -signal.SIGKILL
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    # The dead peer's connection is reset (or keepalive notices it): the streams end.
    _wait_released(server, envs, timeout=15.0)
    assert server.created() == envs


# -- idle timeout ---------------------------------------------------------------------


@pytest.mark.parametrize("rows", STREAMS)
def test_idle_timeout_closes_every_env_and_the_client_gets_deadline_exceeded(
    start_server, rows: int
) -> None:
    server = start_server("support.envs:CountingEchoEnv", "--idle-timeout", "0.5")
    idle = _Stream(server.target, rows).open()
    busy = _Stream(server.target, rows).open()
    try:
        idle.client.reset()
        busy.client.reset()
        steps = 0

        def busy_steps_then_idle_reaped() -> bool:
            nonlocal steps
            steps += 1
            assert busy.step(f"tick {steps}") == [(f"tick {steps}", steps)] * rows
            return server.closed_envs() == rows

        # The busy stream steps every poll (~50 ms apart) while the idle one is reaped.
        server.wait_until(busy_steps_then_idle_reaped, 10.0, "the idle stream reaped")
        assert server.active() == rows
        assert server.open_envs() == rows

        with pytest.raises(SessionLost) as lost:
            idle.step("too late")
        assert lost.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "idle" in lost.value.message

        # The busy stream survived the reaper.
        assert busy.step("alive") == [("alive", steps + 1)] * rows
        busy.client.close()
    finally:
        idle.client.abort()
        busy.client.abort()
    _wait_released(server, 2 * rows)


@pytest.mark.parametrize("stream", ["session", "vector"])
def test_a_write_racing_the_servers_end_still_reports_the_servers_status(
    start_server, stream: str
) -> None:
    """The async client writes on a stream whose end its loop has not yet read: gRPC
    refuses the write and grpc.aio says INTERNAL ("Internal error from Core"), which can
    replace the server's status (grpc/grpc#36066). The caller gets the server's status.

    Blocking the client's loop past the idle timeout opens that window every time."""
    server = start_server("support.envs:CountingEchoEnv", "--idle-timeout", "0.5")
    envs = 1 if stream == "session" else 2

    async def go() -> SessionLost:
        async with aio_channel(server.target) as channel:
            client: Any = AsyncEchoEnv(channel) if envs == 1 else AsyncVectorSession(channel, 2)
            async with client:
                await client.reset()
                # The loop cannot run while the server reaps the stream and sends its status.
                server.wait_until(lambda: server.closed_envs() == envs, 10.0, "idle reaped")
                time.sleep(0.5)  # noqa: ASYNC251 (the point: the loop is blocked)
                action = EchoAction(message="too late")
                with pytest.raises(SessionLost) as lost:
                    await client.step(action if envs == 1 else [action] * envs)
                return lost.value

    lost = asyncio.run(go())
    assert lost.code is grpc.StatusCode.DEADLINE_EXCEEDED, lost
    assert "idle" in lost.message
    _wait_released(server, envs)


def test_idle_timeout_slot_is_reusable_at_capacity(start_server) -> None:
    server = start_server(
        "support.envs:CountingEchoEnv", "--idle-timeout", "0.5", "--max-concurrent-envs", "1"
    )
    idle = _open(server.target)
    with pytest.raises(CapacityError):
        _open(server.target)
    server.wait_until(lambda: server.closed_envs() == 1, 10.0, "the idle session reaped")
    server.wait_until(lambda: server.active() == 0, 10.0, "slot freed")
    fresh = _open(server.target)
    try:
        fresh.reset()
        assert fresh.step(EchoAction(message="x")).observation.echoed_message == "x"
    finally:
        fresh.close()
        idle.abort()


# -- drain on SIGTERM -------------------------------------------------------------------


def test_sigterm_drain_with_open_sessions(start_server) -> None:
    server = start_server("support.envs:CountingEchoEnv", "--grace", "2")
    busy = _open(server.target)
    idle_a = _open(server.target)
    idle_b = _open(server.target)
    never_reset = _open(server.target)
    try:
        for env in (busy, idle_a, idle_b):
            env.reset()
        assert server.active() == 4

        server.proc.send_signal(signal.SIGTERM)

        # During the grace period: health reports NOT_SERVING for both names...
        server.wait_until(lambda: server.health("") == NOT_SERVING, 5.0, "NOT_SERVING")
        assert server.health(SERVICE) == NOT_SERVING
        info = server.info()
        assert info.capacity.draining
        assert info.capacity.active_sessions == 4
        # ...new sessions are refused as UNAVAILABLE (not as a capacity problem)...
        with pytest.raises(SessionRefused) as refused:
            _open(server.target)
        assert not isinstance(refused.value, CapacityError)
        assert refused.value.code is grpc.StatusCode.UNAVAILABLE
        assert "draining" in refused.value.message
        assert server.created() == 4
        # ...and running sessions still work.
        result = busy.step(EchoAction(message="during grace"))
        assert result.observation.echoed_message == "during grace"

        # After the grace every session is ended and every env closed; the process exits 0.
        assert server.proc.wait(15) == 0
        assert server.created() == 4
        assert server.closed_envs() == 4
        assert server.open_envs() == 0
        for env in (busy, idle_a, idle_b, never_reset):
            with pytest.raises(SessionLost) as lost:
                env.step(EchoAction(message="after grace"))
            assert lost.value.code is grpc.StatusCode.UNAVAILABLE
            assert "draining" in lost.value.message
        server.wait_until(
            lambda: "openenv-grpc: drained, every environment closed\n" in server.stdout_lines,
            5.0,
            "the drained line",
        )
    finally:
        for env in (busy, idle_a, idle_b, never_reset):
            env.abort()


def test_sigterm_with_sessions_that_close_during_grace_exits_before_grace_ends(
    start_server,
) -> None:
    server = start_server("support.envs:CountingEchoEnv", "--grace", "60")
    env = _open(server.target)
    env.reset()
    server.proc.send_signal(signal.SIGTERM)
    server.wait_until(lambda: server.health("") == NOT_SERVING, 5.0, "NOT_SERVING")
    env.close()
    # The drain ends as soon as the last session does, long before the 60 s grace.
    assert server.proc.wait(15) == 0
    assert server.closed_envs() == 1


def test_sigterm_without_sessions_exits_zero_fast(start_server) -> None:
    server = start_server("support.envs:CountingEchoEnv", "--grace", "60")
    # Well under the 60 s grace: with nothing to drain there is nothing to wait for.
    assert server.terminate(timeout=10) == 0
    server.wait_until(
        lambda: "openenv-grpc: drained, every environment closed\n" in server.stdout_lines,
        5.0,
        "the drained line",
    )
    assert server.created() == 0


def test_sigterm_right_after_the_serving_line_still_drains_and_exits_zero(start_server) -> None:
    """The serving line announces readiness, so SIGTERM from then on must be handled.

    Twenty servers, each sent SIGTERM the moment its serving line is read (what a supervisor
    or a test harness does): every one must drain and exit 0, none may die of the signal.
    """
    codes = []
    for _ in range(20):
        server = start_server("support.envs:CountingEchoEnv", "--grace", "60")
        codes.append(server.terminate(timeout=10))
    assert codes == [0] * 20


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


# -- client-side endings -----------------------------------------------------------------


def test_sync_session_abort_closes_env(server) -> None:
    env = _open(server.target)
    env.reset()
    env.step(EchoAction(message="x"))
    assert server.open_envs() == 1
    env.abort()
    _wait_released(server, 1)


def test_async_session_abort_closes_env(server) -> None:
    async def main() -> None:
        env = AsyncEchoEnv(server.target)
        await env.open()
        await env.reset()
        await env.step(EchoAction(message="x"))
        await env.abort()

    asyncio.run(main())
    _wait_released(server, 1)


def test_exception_inside_with_block_aborts_and_closes_env(server) -> None:
    with pytest.raises(KeyError), EchoEnv(server.target) as env:
        env.reset()
        raise KeyError("trainer bug")
    _wait_released(server, 1)


def test_half_close_without_close_command_closes_env(server) -> None:
    reset = pb.SessionRequest(request_id=1)
    reset.reset.episode_id = "half"
    with grpc.insecure_channel(server.target) as channel:
        # The request iterator ends after the reset: the client half-closes the stream.
        call = pb_grpc.EnvServiceStub(channel).Session(iter([reset]))
        responses = list(call)
        assert call.code() is grpc.StatusCode.OK
    assert len(responses) == 1
    assert responses[0].request_id == 1
    assert responses[0].WhichOneof("outcome") == "result"
    assert responses[0].result.episode_id == "half"
    _wait_released(server, 1)


def test_a_cancel_or_a_half_close_closes_every_env_of_a_vector_stream(server) -> None:
    cancelled = RawVector(server.target, 4)
    cancelled.reset()
    cancelled.call.cancel()
    _wait_released(server, 4)
    half = RawVector(server.target, 3)
    half.reset()
    half.end()  # no close command: the end of input is the end of the stream
    _wait_released(server, 7)


def test_close_command_closes_env_and_ends_stream_ok(server) -> None:
    reset = pb.SessionRequest(request_id=1)
    reset.reset.episode_id = "closing"
    close = pb.SessionRequest(request_id=2)
    close.close.SetInParent()
    with grpc.insecure_channel(server.target) as channel:
        # The close command, then the stream stays open from the client's side: the
        # server ends it, with OK.
        gate = threading.Event()

        def requests():  # type: ignore[no-untyped-def]
            yield reset
            yield close
            gate.wait(30)

        call = pb_grpc.EnvServiceStub(channel).Session(requests())
        responses = list(call)
        gate.set()
        assert call.code() is grpc.StatusCode.OK, call.details()
    assert [r.request_id for r in responses][:1] == [1]
    assert responses[0].result.episode_id == "closing"
    _wait_released(server, 1)


def test_abort_mid_step_of_pooled_env_closes_env_once_step_returns(
    start_server, tmp_path: Path
) -> None:
    """The step is held at a gate in the env; the client aborts. Once the server has
    ended the session (its metrics count one "cancelled" end: the moment a close that
    overlapped the step would have happened) the env is still open and its slot held;
    only when the gate opens and the step returns is the env closed, once."""
    server = start_server("support.envs:FaultyEnv", "--metrics-port", "0")
    gate = tmp_path / "step-gate"

    async def main() -> None:
        env = AsyncEchoEnv(server.target)
        await env.open()
        await env.reset()
        # The step is on the server, held at the gate; give up waiting, then cancel.
        with pytest.raises(TimeoutError):
            await env.step(EchoAction(message=f"gate:{gate}"), timeout=0.2)
        server.wait_until(lambda: Path(f"{gate}.entered").exists(), 30, "the step running")
        assert server.open_envs() == 1
        await env.abort()

    asyncio.run(main())
    server.wait_until(lambda: sessions_ended(server, "cancelled") == 1, 30, "the session ended")
    # close() never overlaps the step still running on the pool: the env stays open
    # (and its slot taken) until the step returns.
    assert server.closed_envs() == 0 and server.open_envs() == 1
    assert server.active() == 1
    gate.touch()
    _wait_released(server, 1, timeout=30)
    assert server.created() == 1
    assert "closed twice" not in server.stderr()


def test_drain_ends_a_session_stuck_in_a_step_and_closes_its_env(
    start_server, tmp_path: Path
) -> None:
    """A step held at a gate past the 0.3 s grace: the drain ends its session while the
    step is still held (the gate opens only after the client saw the end), and the env
    is closed once the step returns, within the drain's close budget."""
    server = start_server("support.envs:FaultyEnv", "--grace", "0.3")
    gate = tmp_path / "step-gate"

    async def main() -> None:
        env = AsyncEchoEnv(server.target)
        await env.open()
        await env.reset()
        # The step is on the server, holding a pool thread at the gate.
        with pytest.raises(TimeoutError):
            await env.step(EchoAction(message=f"gate:{gate}"), timeout=0.2)
        server.wait_until(lambda: Path(f"{gate}.entered").exists(), 30, "the step running")
        server.proc.send_signal(signal.SIGTERM)
        try:
            with pytest.raises(SessionLost) as lost:
                await env.state(timeout=10)
            assert lost.value.code is grpc.StatusCode.UNAVAILABLE
            assert "draining" in lost.value.message
            assert server.closed_envs() == 0  # the step still holds it
        finally:
            gate.touch()  # the step returns: its env can be closed now

    asyncio.run(main())
    assert server.proc.wait(15) == 0
    assert server.created() == 1
    assert server.closed_envs() == 1
    server.wait_until(
        lambda: "openenv-grpc: drained, every environment closed\n" in server.stdout_lines,
        5.0,
        "the drained line",
    )
    assert "closed twice" not in server.stderr()


# -- failing factories and closes ----------------------------------------------------------


@pytest.mark.parametrize("rows", STREAMS)
def test_a_factory_failure_refuses_with_internal_and_leaks_no_slot(start_server, rows: int) -> None:
    bad = start_server("support.envs:failing_factory", "--max-concurrent-envs", str(rows))
    # Three in a row on a server with just the slots asked for: a leaked slot would turn
    # the later ones into RESOURCE_EXHAUSTED.
    for _ in range(3):
        with pytest.raises(SessionRefused) as refused:
            _Stream(bad.target, rows).open()
        assert not isinstance(refused.value, CapacityError)
        assert refused.value.code is grpc.StatusCode.INTERNAL
        assert refused.value.message == (
            "could not create the environment: RuntimeError: no GPU left for this env"
        )
        assert bad.active() == 0
    assert bad.created() == 0

    good = start_server()
    stream = _Stream(good.target, rows).open()
    stream.client.reset()
    assert stream.step("fine") == [("fine", 1)] * rows
    stream.client.close()
    _wait_released(good, rows)


def test_raising_close_still_frees_slot_and_reports_env_error(start_server) -> None:
    server = start_server("support.envs:RaisingCloseEnv", "--max-concurrent-envs", "1")
    env = _open(server.target)
    env.reset()
    with pytest.raises(EnvError) as failed:
        env.close()
    assert failed.value.code is grpc.StatusCode.INTERNAL
    assert failed.value.message == "close failed: OSError: close failed on purpose"
    assert failed.value.exception_type == "builtins.OSError"
    # close() ran exactly once (the ledger raises on a second close) and the slot is free.
    _wait_released(server, 1)
    env.close()  # a second close on the client is a no-op
    # The slot is reusable; the raising close on the way out of `with` propagates.
    with pytest.raises(EnvError, match="close failed on purpose"), EchoEnv(server.target) as again:
        again.reset()
        assert server.active() == 1
        assert server.created() == 2
    _wait_released(server, 2)


def test_raising_close_on_abort_frees_slot(start_server) -> None:
    server = start_server("support.envs:RaisingCloseEnv", "--max-concurrent-envs", "1")
    env = _open(server.target)
    env.reset()
    env.abort()
    _wait_released(server, 1)
    fresh = _open(server.target)
    fresh.abort()
    _wait_released(server, 2)


# -- execution modes -------------------------------------------------------------------------


def test_pooled_sync_env_end_to_end(start_server) -> None:
    server = start_server("support.envs:PooledEchoEnv")
    with EchoEnv(server.target) as env:
        first = env.reset(seed=3, episode_id="pooled")
        assert first.observation.echoed_message == "ready"
        for i in range(1, 4):
            result = env.step(EchoAction(message="ab" * i))
            assert result.observation.echoed_message == "ab" * i
            assert result.reward == pytest.approx(0.2 * i)
            assert result.step_count == i
            assert result.episode_id == "pooled"
        state = env.state()
        assert isinstance(state, EchoState)
        assert (state.seed, state.total_length, list(state.history)) == (
            3,
            12,
            ["ab", "abab", "ababab"],
        )
    _wait_released(server, 1)


def test_async_env_end_to_end(start_server) -> None:
    server = start_server("support.envs:AsyncEchoEnv")
    assert server.info().env_name == "async-echo"

    async def main() -> None:
        async with AsyncEchoEnv(server.target) as env:
            first = await env.reset(episode_id="async")
            assert first.observation.echoed_message == "async ready"
            for i in range(1, 4):
                result = await env.step(EchoAction(message=f"m{i}"))
                assert result.observation.echoed_message == f"m{i}"
                assert result.reward == float(i)
                assert result.step_count == i
                assert result.episode_id == "async"
            assert (await env.state()).total_length == 3

    asyncio.run(main())
    _wait_released(server, 1)


def test_fifty_async_sessions_on_one_channel_step_independently(server) -> None:
    count, steps = 50, 5

    async def one(channel: grpc.aio.Channel, index: int) -> None:
        env = AsyncEchoEnv(channel)
        await env.open()
        try:
            first = await env.reset(seed=index, episode_id=f"ep-{index}")
            assert first.episode_id == f"ep-{index}"
            for k in range(1, steps + 1):
                message = f"session {index} step {k}"
                result = await env.step(EchoAction(message=message))
                assert result.observation.echoed_message == message
                assert result.step_count == k
                assert result.episode_id == f"ep-{index}"
                await asyncio.sleep(0)  # interleave with the other sessions
            state = await env.state()
            assert state.seed == index
            assert list(state.history) == [f"session {index} step {k}" for k in range(1, 6)]
        finally:
            await env.close()

    async def main() -> None:
        channel = aio_channel(server.target)
        try:
            await asyncio.gather(*(one(channel, i) for i in range(count)))
        finally:
            await channel.close()

    asyncio.run(main())
    assert server.created() == count
    _wait_released(server, count)


# -- Info and reflection ---------------------------------------------------------------------


def test_info_rpc_fields(server) -> None:
    info = server.info()
    assert info.env_name == "echo"
    assert info.env_version == EchoEnvironment.version
    assert info.env_description == EchoEnvironment.description
    assert info.action_type == "openenv_grpc_envs.echo.v1.EchoAction"
    assert info.observation_type == "openenv_grpc_envs.echo.v1.EchoObservation"
    assert info.state_type == "openenv_grpc_envs.echo.v1.EchoState"
    assert info.reset_options_type == "openenv_grpc_envs.echo.v1.EchoResetOptions"
    assert info.server_version == openenv_grpc.__version__
    assert info.protocol == "openenv_grpc.v1"
    assert info.capacity.max_sessions == 1024
    assert info.capacity.active_sessions == 0
    assert not info.capacity.draining


def test_info_descriptors_decode_a_real_observation(server) -> None:
    info = server.info()
    classes = message_classes(info)
    assert set(classes) == {"action", "observation", "state", "reset_options"}
    # Built from the FileDescriptorSet alone, not from this process's generated code.
    assert classes["observation"] is not EchoObservation

    action = classes["action"](message="decoded by descriptors")
    reset = pb.SessionRequest(request_id=1)
    reset.reset.SetInParent()
    step = pb.SessionRequest(request_id=2)
    step.step.action.type_url = f"type.googleapis.com/{info.action_type}"
    step.step.action.value = action.SerializeToString()
    close = pb.SessionRequest(request_id=3)
    close.close.SetInParent()
    with grpc.insecure_channel(server.target) as channel:
        responses = list(pb_grpc.EnvServiceStub(channel).Session(iter([reset, step, close])))
    assert [r.WhichOneof("outcome") for r in responses] == ["result", "result", "closed"]
    payload = responses[1].result.observation
    assert payload.type_url.endswith("/" + info.observation_type)
    observation = classes["observation"].FromString(payload.value)
    assert observation.echoed_message == "decoded by descriptors"
    assert observation.message_length == len("decoded by descriptors")
    _wait_released(server, 1)


def test_info_reports_active_sessions(server) -> None:
    with EchoEnv(server.target), EchoEnv(server.target):
        assert server.info().capacity.active_sessions == 2
    server.wait_until(lambda: server.active() == 0, what="sessions closed")


def test_reflection_lists_services(server) -> None:
    with grpc.insecure_channel(server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (response,) = list(stub.ServerReflectionInfo(iter([request]), timeout=5))
        names = {service.name for service in response.list_services_response.service}
    assert {
        "openenv_grpc.v1.EnvService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names


def test_reflection_describes_env_service(server) -> None:
    with grpc.insecure_channel(server.target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert "openenv_grpc.v1.EnvService" in set(database.get_services())
        pool = protobuf_descriptor_pool.DescriptorPool(database)
        service = pool.FindServiceByName("openenv_grpc.v1.EnvService")
        methods = {method.name: method for method in service.methods}
    assert set(methods) == {"Session", "VectorSession", "Info"}
    for stream in ("Session", "VectorSession"):
        assert methods[stream].client_streaming and methods[stream].server_streaming
    assert methods["Info"].output_type.full_name == "openenv_grpc.v1.InfoResponse"


# -- health ---------------------------------------------------------------------------------


def test_health_serving_for_both_names(server) -> None:
    assert server.health("") == SERVING
    assert server.health(SERVICE) == SERVING


def test_sessions_on_separate_threads_do_not_share_envs(server) -> None:
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            with Session(server.target) as env:
                env.reset(episode_id=f"t{index}")
                for k in range(1, 4):
                    result = env.step(EchoAction(message=f"{index}:{k}"))
                    assert result.observation.echoed_message == f"{index}:{k}"
                    assert result.step_count == k
                    assert result.episode_id == f"t{index}"
        except BaseException as exc:  # collected for the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    assert not errors, errors
    _wait_released(server, 8)
