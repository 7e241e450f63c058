"""The client library over real servers: construction, typing, timeouts, loss, closing."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from openenv_grpc import (
    AsyncSession,
    EnvError,
    PayloadTypeError,
    Session,
    SessionLost,
    SessionStateError,
    SessionTimeout,
)
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc
from openenv_grpc_envs.echo import (
    AsyncEchoEnv,
    EchoAction,
    EchoEnv,
    EchoObservation,
    EchoResetOptions,
    EchoState,
)

pytestmark = [pytest.mark.timeout(20), pytest.mark.shared_server]

#: What a client sees when its server's process dies under it (the socket closes).
LOST_CODES = {grpc.StatusCode.UNAVAILABLE}
#: grpc.aio may fail the *write* to a dead stream before the transport's status arrives;
#: it then ends the call with INTERNAL "Internal error from Core" (grpc's, not the server's).
ASYNC_LOST_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL}

T = TypeVar("T")


def act(message: str) -> EchoAction:
    return EchoAction(message=message)


def assert_all_closed(server, count: int) -> None:  # type: ignore[no-untyped-def]
    server.wait_until(lambda: server.closed_envs() == count, what=f"{count} envs closed")
    assert server.created() == count
    server.wait_until(lambda: server.active() == 0, what="no active session")


# -- typing ---------------------------------------------------------------------------


def test_typed_client_rejects_wrong_action_type_before_sending(server) -> None:
    with EchoEnv(server.target) as env:
        first = env.reset(episode_id="ep")
        assert env.step(act("a")).step_count == 1
        expected = re.escape("action must be openenv_grpc_envs.echo.v1.EchoAction, got")
        with pytest.raises(PayloadTypeError, match=expected):
            env.step(EchoObservation(echoed_message="not an action"))  # type: ignore[arg-type]
        with pytest.raises(PayloadTypeError, match="action must be"):
            env.step(EchoResetOptions())  # type: ignore[arg-type]
        # Wrong reset options: had this been sent, the server would have reset the episode.
        with pytest.raises(PayloadTypeError, match="options must be"):
            env.reset(episode_id="other", options=act("x"))  # type: ignore[arg-type]
        result = env.step(act("b"))
        assert result.observation.echoed_message == "b"
        assert (result.episode_id, result.step_count) == (first.episode_id, 2)
        assert list(env.state().history) == ["a", "b"]
    assert_all_closed(server, 1)


def test_typed_async_client_rejects_wrong_action_type_before_sending(server) -> None:
    async def main() -> None:
        async with AsyncEchoEnv(server.target) as env:
            await env.reset(episode_id="ep")
            with pytest.raises(PayloadTypeError, match="action must be"):
                await env.step(EchoState())  # type: ignore[arg-type]
            with pytest.raises(PayloadTypeError, match="options must be"):
                await env.reset(episode_id="other", options=act("x"))  # type: ignore[arg-type]
            result = await env.step(act("ok"))
            assert (result.episode_id, result.step_count) == ("ep", 1)
            assert list((await env.state()).history) == ["ok"]

    asyncio.run(main())
    assert_all_closed(server, 1)


# -- construction ---------------------------------------------------------------------


def _round_trip(env: Session) -> None:  # type: ignore[type-arg]
    result = env.reset(options=EchoResetOptions(greeting="hey"))
    assert isinstance(result.observation, EchoObservation)
    assert result.observation.echoed_message == "hey"
    result = env.step(act("abc"))
    assert isinstance(result.observation, EchoObservation)
    assert (result.observation.echoed_message, result.step_count) == ("abc", 1)
    state = env.state()
    assert isinstance(state, EchoState)
    assert list(state.history) == ["abc"]


def test_session_from_target_string(server) -> None:
    with Session(server.target) as env:
        _round_trip(env)
    assert_all_closed(server, 1)


def test_session_from_channel_leaves_the_channel_open(server) -> None:
    with grpc.insecure_channel(server.target) as channel:
        with Session(channel) as env:
            _round_trip(env)
        # The session did not own the channel: a second session still uses it.
        with Session(channel) as env:
            _round_trip(env)
    assert_all_closed(server, 2)


def test_session_from_stub(server) -> None:
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        with Session(stub) as env, Session(stub) as other:
            _round_trip(env)
            _round_trip(other)
        with EchoEnv(stub) as typed:
            assert typed.reset().observation.echoed_message == "ready"
    assert_all_closed(server, 3)


async def _async_round_trip(env: AsyncSession) -> None:  # type: ignore[type-arg]
    result = await env.reset(options=EchoResetOptions(greeting="hey"))
    assert isinstance(result.observation, EchoObservation)
    assert result.observation.echoed_message == "hey"
    result = await env.step(act("abc"))
    assert isinstance(result.observation, EchoObservation)
    assert (result.observation.echoed_message, result.step_count) == ("abc", 1)
    state = await env.state()
    assert isinstance(state, EchoState)
    assert list(state.history) == ["abc"]


def test_async_session_from_target_string(server) -> None:
    async def main() -> None:
        async with AsyncSession(server.target) as env:
            await _async_round_trip(env)

    asyncio.run(main())
    assert_all_closed(server, 1)


def test_async_session_from_aio_channel_leaves_the_channel_open(server) -> None:
    async def main() -> None:
        async with grpc.aio.insecure_channel(server.target) as channel:
            async with AsyncSession(channel) as env:
                await _async_round_trip(env)
            async with AsyncSession(channel) as env:
                await _async_round_trip(env)

    asyncio.run(main())
    assert_all_closed(server, 2)


def test_async_session_from_aio_stub(server) -> None:
    async def main() -> None:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.EnvServiceStub(channel)
            async with AsyncSession(stub) as env, AsyncSession(stub) as other:
                await asyncio.gather(_async_round_trip(env), _async_round_trip(other))
            async with AsyncEchoEnv(stub) as typed:
                assert (await typed.reset()).observation.echoed_message == "ready"

    asyncio.run(main())
    assert_all_closed(server, 3)


def test_untyped_session_decodes_imported_types(server) -> None:
    with Session(server.target) as env:
        result = env.reset(options=EchoResetOptions(greeting="typed?"))
        assert type(result.observation) is EchoObservation
        result = env.step(act("yes"))
        assert type(result.observation) is EchoObservation
        assert result.observation.message_length == 3
        assert type(env.state()) is EchoState


def test_untyped_session_hands_over_raw_any_for_unimported_types(server) -> None:
    script = (
        "import sys\n"
        "from google.protobuf import any_pb2\n"
        "from openenv_grpc import Session\n"
        "assert not any(m.startswith('openenv_grpc_envs') for m in sys.modules)\n"
        "with Session(sys.argv[1]) as env:\n"
        "    obs = env.reset().observation\n"
        "    assert isinstance(obs, any_pb2.Any), type(obs)\n"
        "    print(obs.type_url)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, server.target],
        capture_output=True,
        text=True,
        timeout=15,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "type.googleapis.com/openenv_grpc_envs.echo.v1.EchoObservation"


# -- timeouts -------------------------------------------------------------------------


def test_async_step_timeout_then_next_step_gets_its_own_answer(start_server) -> None:
    faulty = start_server("support.envs:FaultyEnv")

    async def main() -> None:
        async with AsyncEchoEnv(faulty.target) as env:
            await env.reset()
            with pytest.raises(SessionTimeout):
                await env.step(act("sleep:1"), timeout=0.2)
            # The late answer to the slow step arrives first and is dropped as stale.
            result = await env.step(act("after"), timeout=5)
            assert result.observation.echoed_message == "after"
            assert result.step_count == 2  # the slow step did happen on the server
            result = await env.step(act("next"))
            assert (result.observation.echoed_message, result.step_count) == ("next", 3)

    asyncio.run(main())
    assert_all_closed(faulty, 1)


def test_async_step_timeout_then_untimed_state_gets_its_own_answer(start_server) -> None:
    faulty = start_server("support.envs:FaultyEnv")

    async def main() -> None:
        async with AsyncEchoEnv(faulty.target) as env:
            await env.reset()
            with pytest.raises(SessionTimeout):
                await env.step(act("sleep:1"), timeout=0.2)
            with pytest.raises(SessionTimeout):
                await env.step(act("sleep:1"), timeout=0.1)
            assert isinstance(await env.state(), EchoState)
            result = await env.step(act("last"))
            assert (result.observation.echoed_message, result.step_count) == ("last", 3)

    asyncio.run(main())
    assert_all_closed(faulty, 1)


def test_async_close_after_timeout_discards_the_stale_answer(start_server) -> None:
    faulty = start_server("support.envs:FaultyEnv")

    async def main() -> None:
        async with AsyncEchoEnv(faulty.target) as env:
            await env.reset()
            with pytest.raises(SessionTimeout):
                await env.step(act("sleep:1"), timeout=0.2)
        # Leaving the block closed gracefully: the late step answer did not confuse it.

    asyncio.run(main())
    assert_all_closed(faulty, 1)


def test_sync_step_timeout_then_next_step_gets_its_own_answer(start_server) -> None:
    faulty = start_server("support.envs:FaultyEnv")
    with EchoEnv(faulty.target) as env:
        env.reset()
        with pytest.raises(SessionTimeout, match="session stays open"):
            env.step(act("sleep:1"), timeout=0.2)
        # The late answer to the slow step arrives first and is dropped as stale.
        result = env.step(act("after"), timeout=5)
        assert (result.observation.echoed_message, result.step_count) == ("after", 2)
        result = env.step(act("next"))  # untimed again: the caller's thread reads
        assert (result.observation.echoed_message, result.step_count) == ("next", 3)
    assert_all_closed(faulty, 1)


def test_sync_timeouts_in_a_row_then_untimed_calls_and_close(start_server) -> None:
    faulty = start_server("support.envs:FaultyEnv")
    with EchoEnv(faulty.target) as env:
        env.reset()
        with pytest.raises(SessionTimeout):
            env.step(act("sleep:1"), timeout=0.2)
        with pytest.raises(SessionTimeout):
            env.step(act("sleep:1"), timeout=0.1)
        assert isinstance(env.state(), EchoState)
        result = env.step(act("last"))
        assert (result.observation.echoed_message, result.step_count) == ("last", 3)
        with pytest.raises(SessionTimeout):
            env.step(act("sleep:1"), timeout=0.2)  # close still works after a timeout
    assert_all_closed(faulty, 1)


def test_sync_timeout_on_a_lost_stream_reports_the_loss(server) -> None:
    env = EchoEnv(server.target)
    env.open()
    env.reset()
    server.proc.kill()
    server.proc.wait(timeout=10)
    with pytest.raises(SessionLost):
        env.step(act("gone"), timeout=5)
    env.close()


# -- a server that dies ---------------------------------------------------------------
# Each call below can end only by the client noticing its server's death: the server is
# gone, or the env waits at a gate no one opens. Each is run under a hang guard that
# fails naming what hung, not timed.


def _gate_entered(gate: Path) -> bool:
    return Path(f"{gate}.entered").exists()


def _hang_guarded(call: Callable[[], T], what: str, seconds: float = 10.0) -> T:
    """``call()`` on a thread: its result, or its exception raised here; fails naming
    ``what`` if it is still running after ``seconds``."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = call()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still waiting after {seconds:g}s: {what}")
    if "error" in outcome:
        raise outcome["error"]
    result: T = outcome["result"]
    return result


async def _hang_guarded_async(awaitable: Awaitable[T], what: str, seconds: float = 10.0) -> T:
    """``await awaitable``; fails naming ``what`` if it is still pending after ``seconds``."""
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        task.cancel()
        pytest.fail(f"still waiting after {seconds:g}s: {what}")
    return task.result()


@pytest.mark.timeout(15)
def test_sync_session_lost_when_server_killed_between_calls(server) -> None:
    env = EchoEnv(server.target)
    env.open()
    env.reset()
    env.step(act("alive"))
    server.proc.kill()
    server.proc.wait(5)
    with pytest.raises(SessionLost) as raised:
        _hang_guarded(lambda: env.step(act("anyone?")), "a step on a killed server")
    assert raised.value.code in LOST_CODES
    # The session is over; it says so rather than hanging.
    with pytest.raises(SessionStateError, match="not open"):
        env.step(act("again"))
    env.close()


@pytest.mark.timeout(15)
def test_sync_session_lost_when_server_killed_mid_step(start_server, tmp_path: Path) -> None:
    faulty = start_server("support.envs:FaultyEnv")
    gate = tmp_path / "gate"
    with EchoEnv(faulty.target) as env:
        env.reset()

        def kill_at_the_gate() -> None:
            faulty.wait_until(lambda: _gate_entered(gate), 10, "the step at its gate")
            faulty.proc.kill()

        killer = threading.Thread(target=kill_at_the_gate, daemon=True)
        killer.start()
        with pytest.raises(SessionLost) as raised:
            _hang_guarded(lambda: env.step(act(f"gate:{gate}")), "a step whose server died")
        killer.join()
        assert _gate_entered(gate) and not gate.exists()  # it died mid-step
        assert raised.value.code in LOST_CODES


@pytest.mark.timeout(15)
def test_async_session_lost_when_server_killed_between_calls(server) -> None:
    async def main() -> None:
        env = AsyncEchoEnv(server.target)
        await env.open()
        await env.reset()
        await env.step(act("alive"))
        server.proc.kill()
        await asyncio.to_thread(server.proc.wait, 5)
        with pytest.raises(SessionLost) as raised:
            await _hang_guarded_async(env.step(act("anyone?")), "a step on a killed server")
        assert raised.value.code in ASYNC_LOST_CODES
        with pytest.raises(SessionStateError, match="not open"):
            await env.step(act("again"))
        await env.close()

    asyncio.run(main())


@pytest.mark.timeout(15)
def test_async_session_lost_when_server_killed_mid_step(start_server, tmp_path: Path) -> None:
    faulty = start_server("support.envs:FaultyEnv")
    gate = tmp_path / "gate"

    async def main() -> None:
        async with AsyncEchoEnv(faulty.target) as env:
            await env.reset()
            step = asyncio.ensure_future(env.step(act(f"gate:{gate}")))
            await asyncio.to_thread(
                faulty.wait_until, lambda: _gate_entered(gate), 10, "the step at its gate"
            )
            assert not step.done()
            faulty.proc.kill()
            with pytest.raises(SessionLost) as raised:
                await _hang_guarded_async(step, "a step whose server died")
            assert raised.value.code in ASYNC_LOST_CODES

    asyncio.run(main())


# -- closing --------------------------------------------------------------------------


def test_sync_session_use_after_close_raises_runtime_error(server) -> None:
    env = EchoEnv(server.target)
    with env:
        env.reset()
    for call in (env.reset, env.state, lambda: env.step(act("late"))):
        with pytest.raises(SessionStateError, match="not open"):
            call()
    assert_all_closed(server, 1)


def test_async_session_use_after_close_raises_runtime_error(server) -> None:
    async def main() -> None:
        env = AsyncEchoEnv(server.target)
        async with env:
            await env.reset()
        with pytest.raises(SessionStateError, match="not open"):
            await env.reset()
        with pytest.raises(SessionStateError, match="not open"):
            await env.step(act("late"))
        with pytest.raises(SessionStateError, match="not open"):
            await env.state()

    asyncio.run(main())
    assert_all_closed(server, 1)


def test_sync_close_twice_is_fine(server) -> None:
    env = EchoEnv(server.target)
    env.open()
    env.reset()
    env.close()
    env.close()
    with EchoEnv(server.target) as other:
        other.reset()
        other.close()  # closing inside the block, then again on leaving it
    assert_all_closed(server, 2)


def test_async_close_twice_is_fine(server) -> None:
    async def main() -> None:
        env = AsyncEchoEnv(server.target)
        await env.open()
        await env.reset()
        await env.close()
        await env.close()

    asyncio.run(main())
    assert_all_closed(server, 1)


class Boom(Exception):
    pass


def test_sync_with_block_exception_aborts_and_server_closes_env(server) -> None:
    with pytest.raises(Boom), EchoEnv(server.target) as env:
        env.reset()
        env.step(act("x"))
        raise Boom
    with pytest.raises(SessionStateError, match="not open"):
        env.step(act("after abort"))
    assert_all_closed(server, 1)


def test_sync_with_block_exception_aborts_a_step_in_flight(start_server, tmp_path: Path) -> None:
    faulty = start_server("support.envs:FaultyEnv")
    gate = tmp_path / "gate"
    outcome: list[BaseException] = []
    with pytest.raises(Boom), EchoEnv(faulty.target) as env:
        env.reset()

        def slow_step() -> None:
            try:
                env.step(act(f"gate:{gate}"))
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=slow_step, daemon=True)
        thread.start()
        faulty.wait_until(lambda: _gate_entered(gate), 10, "the step at its gate")
        raise Boom
    # Left at once, the step still at its shut gate (a graceful close would have waited
    # for the step, which cannot end until the gate opens, and the env's close).
    assert faulty.closed_envs() == 0
    thread.join(5)
    assert not thread.is_alive(), "the step in flight did not end with the abort"
    gate.touch()
    assert len(outcome) == 1 and isinstance(outcome[0], SessionLost), outcome
    assert outcome[0].code is grpc.StatusCode.CANCELLED  # type: ignore[attr-defined]
    # The server closes the env once the running step is over.
    assert_all_closed(faulty, 1)


def test_async_with_block_exception_aborts_and_server_closes_env(
    start_server, tmp_path: Path
) -> None:
    faulty = start_server("support.envs:FaultyEnv")
    gate = tmp_path / "gate"

    async def main() -> None:
        with pytest.raises(Boom):
            async with AsyncEchoEnv(faulty.target) as env:
                await env.reset()
                step = asyncio.ensure_future(env.step(act(f"gate:{gate}")))
                await asyncio.to_thread(
                    faulty.wait_until, lambda: _gate_entered(gate), 10, "the step at its gate"
                )
                raise Boom
        # Left at once, the step still at its shut gate (a graceful close would have
        # waited for the step, which cannot end until the gate opens, and the env's close).
        assert faulty.closed_envs() == 0
        # The orphaned step ends too (grpc.aio surfaces the cancelled call as a
        # cancellation of the read; the sync client gets SessionLost(CANCELLED)).
        with pytest.raises((SessionLost, asyncio.CancelledError)):
            await _hang_guarded_async(step, "the orphaned step")
        gate.touch()

    asyncio.run(main())
    assert_all_closed(faulty, 1)


def test_with_block_env_error_also_aborts(server) -> None:
    with pytest.raises(EnvError), EchoEnv(server.target) as env:
        env.step(act("before reset"))  # FAILED_PRECONDITION, escapes the block
    assert_all_closed(server, 1)
