"""Hardening of the session path (issue 16): size caps, a drain that keeps its grace,
step timeouts that measure the env and not the queue, and a cap on live envs.

Every test runs a real ``openenv-grpc serve`` process on loopback. Sessions are driven
through the raw generated ``grpc.aio`` stub, so the test reads every response itself,
notices (request_id 0) included.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf import any_pb2

from openenv_grpc.metadata import ADMITTED_KEY
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc
from openenv_grpc_envs.echo import EchoAction, EchoObservation, EchoResetOptions
from support.metrics import samples, sessions_ended

pytestmark = pytest.mark.timeout(60)

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


# -- helpers --------------------------------------------------------------------------


class Stream:
    """One Session stream on the raw aio stub. Notices are collected in ``notices``."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = pb_grpc.EnvServiceStub(channel).Session()
        self.notices: list[tuple[float, pb.Notice]] = []  # (monotonic arrival, notice)
        self._next_id = 0

    async def open(self) -> Stream:
        metadata = await self.call.initial_metadata()
        assert ADMITTED_KEY in dict(metadata), "session not admitted"
        return self

    async def send(self, request: pb.SessionRequest) -> int:
        self._next_id += 1
        request.request_id = self._next_id
        await self.call.write(request)
        return self._next_id

    async def answer(self, request_id: int, timeout: float = 20) -> pb.SessionResponse:
        """The response to ``request_id``; notices before it are kept."""
        while True:
            response = await asyncio.wait_for(self.call.read(), timeout)
            assert response is not grpc.aio.EOF, "stream ended"
            if response.request_id == 0:
                assert response.WhichOneof("outcome") == "notice", response
                self.notices.append((time.monotonic(), response.notice))
                continue
            assert response.request_id == request_id, response
            return response

    async def ask(self, request: pb.SessionRequest, timeout: float = 20) -> pb.SessionResponse:
        return await self.answer(await self.send(request), timeout)

    async def result(self, request: pb.SessionRequest) -> pb.StepResult:
        response = await self.ask(request)
        assert response.WhichOneof("outcome") == "result", response
        return response.result

    async def error(self, request: pb.SessionRequest, timeout: float = 20) -> pb.Error:
        response = await self.ask(request, timeout)
        assert response.WhichOneof("outcome") == "error", response
        return response.error

    async def close(self) -> None:
        response = await self.ask(pb.SessionRequest(close=pb.CloseCommand()))
        assert response.WhichOneof("outcome") == "closed", response
        await self.call.done_writing()


def reset(
    episode_id: str | None = None, options: EchoResetOptions | None = None
) -> pb.SessionRequest:
    request = pb.SessionRequest(reset=pb.ResetCommand())
    if episode_id is not None:
        request.reset.episode_id = episode_id
    if options is not None:
        request.reset.options.Pack(options)
    return request


def step(message: str) -> pb.SessionRequest:
    request = pb.SessionRequest()
    request.step.action.Pack(EchoAction(message=message))
    return request


def echoed(result: pb.StepResult) -> str:
    return EchoObservation.FromString(result.observation.value).echoed_message


async def open_stream(channel: grpc.aio.Channel) -> Stream:
    return await Stream(channel).open()


async def assert_full(channel: grpc.aio.Channel) -> None:
    """A new session is refused: the server is at its cap."""
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await pb_grpc.EnvServiceStub(channel).Session().read()
    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "server at capacity" in (refused.value.details() or "")


async def until(server, predicate, timeout: float = 10.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    """``server.wait_until`` off the event loop, so the test's streams keep running."""
    await asyncio.to_thread(server.wait_until, predicate, timeout, what)


def scrape(server) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Every sample of the server's /metrics as {name: value} (labels dropped)."""
    return {sample.name: sample.value for sample in samples(server)}


# -- caps on client-chosen sizes ------------------------------------------------------


def test_an_8_mb_episode_id_is_invalid_argument_and_the_session_steps_on(server) -> None:
    async def main() -> None:
        async with grpc.aio.insecure_channel(server.target) as channel:
            env = await open_stream(channel)
            assert (await env.result(reset(episode_id="e" * 256))).episode_id == "e" * 256
            assert (await env.result(reset(episode_id="mine"))).episode_id == "mine"
            await env.result(step("one"))
            for episode_id, size in (("x" * 8 * 1024 * 1024, 8 * 1024 * 1024), ("é" * 129, 258)):
                error = await env.error(reset(episode_id=episode_id))
                assert error.code == INVALID_ARGUMENT
                assert error.message == (
                    f"episode_id is {size} bytes; at most 256 are allowed "
                    "(the episode is unchanged)"
                )
            result = await env.result(step("two"))
            assert (result.episode_id, result.step_count, echoed(result)) == ("mine", 2, "two")
            await env.close()

    asyncio.run(main())
    server.wait_until(lambda: server.active() == 0, what="session released")
    assert server.closed_envs() == server.created() == 1


def test_oversized_reset_options_and_type_urls_are_invalid_argument(server) -> None:
    async def main() -> None:
        async with grpc.aio.insecure_channel(server.target) as channel:
            env = await open_stream(channel)
            await env.result(reset(episode_id="kept"))
            # The echo env keeps its greeting for the episode: a store the client chooses.
            big = EchoResetOptions(greeting="g" * 70_000)
            error = await env.error(reset(options=big))
            assert error.code == INVALID_ARGUMENT
            size = len(big.SerializeToString())
            assert error.message == (
                f"reset options are {size} bytes; at most 65536 are allowed "
                "(the episode is unchanged)"
            )
            fits = await env.result(reset(options=EchoResetOptions(greeting="g" * 60_000)))
            assert echoed(fits) == "g" * 60_000
            # A type url is echoed when it is wrong: a huge one is refused, not echoed.
            for payload in ("action", "reset options"):
                request = step("x") if payload == "action" else reset()
                target: any_pb2.Any = (
                    request.step.action if payload == "action" else request.reset.options
                )
                target.type_url = "type.googleapis.com/" + "T" * 1_000_000
                error = await env.error(request)
                assert error.code == INVALID_ARGUMENT
                assert error.message == (
                    f"{payload} type_url is 1000020 bytes; at most 256 are allowed"
                )
            result = await env.result(step("on"))
            assert (result.step_count, echoed(result)) == (1, "on")
            await env.close()

    asyncio.run(main())
    server.wait_until(lambda: server.active() == 0, what="session released")


def test_an_observation_over_the_message_limit_fails_only_that_step(start_server) -> None:
    limit = 1024 * 1024
    server = start_server("support.envs:FaultyEnv", "--max-message-bytes", str(limit))

    async def main() -> None:
        async with grpc.aio.insecure_channel(server.target) as channel:
            env = await open_stream(channel)
            await env.result(reset())
            await env.result(step("first"))
            error = await env.error(step(f"big:{2 * limit}"))
            assert error.code == RESOURCE_EXHAUSTED
            assert f"over the server's message limit of {limit} bytes" in error.message
            assert "(--max-message-bytes)" in error.message
            # The step was taken (its answer could not be sent); the session goes on.
            result = await env.result(step("next"))
            assert (result.step_count, echoed(result)) == (3, "next")
            await env.close()

    asyncio.run(main())
    server.wait_until(lambda: server.active() == 0, what="session released")
    assert server.closed_envs() == 1


# -- drain ------------------------------------------------------------------------------


def test_drain_notice_reaches_held_sessions_at_once(start_server, tmp_path: Path) -> None:
    """SIGTERM with a 30 s grace, one session idle and one in a step held at a gate: the
    notice reaches both while that step is still held (so it waited for no call, nor for
    the grace), its seconds_left and deadline are the signal's time plus the grace (bounds
    from the clocks read around the signal and the arrival, no tolerance), and both
    sessions go on."""
    grace = 30.0
    server = start_server("support.envs:FaultyEnv", "--grace", str(grace))
    gate = tmp_path / "step-gate"

    async def main() -> None:
        async with grpc.aio.insecure_channel(server.target) as channel:
            idle = await open_stream(channel)
            busy = await open_stream(channel)
            await idle.result(reset())
            await busy.result(reset())
            # A step in flight while the notice goes out: notice and answer must both
            # arrive whole (writes on one stream never overlap).
            stepping = await busy.send(step(f"gate:{gate}"))
            await until(server, Path(f"{gate}.entered").exists, 30, "the step running")
            signalled, wall = time.monotonic(), time.time()
            server.proc.send_signal(signal.SIGTERM)
            try:
                response = await asyncio.wait_for(idle.call.read(), 20)
                arrived, wall_arrived = time.monotonic(), time.time()
            finally:
                gate.touch()  # only now: the notice came while the step was held
            print(f"DRAINING notice {arrived - signalled:.3f}s after SIGTERM (grace {grace:g}s)")
            assert response.request_id == 0
            assert response.WhichOneof("outcome") == "notice"
            notice = response.notice
            assert notice.kind == pb.NOTICE_KIND_DRAINING
            # Made between the signal and the arrival, for the signal's time + the grace.
            assert grace - (arrived - signalled) <= notice.seconds_left <= grace
            deadline = notice.deadline.ToNanoseconds() / 1e9
            assert wall + grace - 0.001 <= deadline <= wall_arrived + grace + 0.001
            assert "server is draining" in notice.message
            answer = await busy.answer(stepping)
            assert echoed(answer.result) == f"gate:{gate}"
            [(_, busy_notice)] = busy.notices
            assert busy_notice.kind == pb.NOTICE_KIND_DRAINING
            # Both sessions go on during the grace; one notice each.
            for env in (idle, busy):
                assert echoed(await env.result(step("after"))) == "after"
                await env.close()
            assert idle.notices == [] and len(busy.notices) == 1

    asyncio.run(main())
    # Every session closed: the drain ends long before the grace.
    assert server.proc.wait(15) == 0
    assert server.closed_envs() == 2


def test_drain_with_a_hung_env_call_exits_within_grace(start_server, tmp_path: Path) -> None:
    """A step held at a gate that is never opened (it would give up after 30 s): the
    drain ends every stream and the process exits 0 while that call is still held (the
    stuck-env line says so, and the exit comes well before the gate's 30 s), with every
    other env closed."""
    grace = 3.0
    server = start_server("support.envs:FaultyEnv", "--grace", str(grace))
    gate = tmp_path / "never-opened"

    async def main() -> float:
        async with grpc.aio.insecure_channel(server.target) as channel:
            hung = await open_stream(channel)
            others = [await open_stream(channel) for _ in range(2)]
            for env in (hung, *others):
                await env.result(reset())
            await hung.send(step(f"gate:{gate}"))  # blocks a pool thread for good
            await until(server, Path(f"{gate}.entered").exists, 30, "the hung step running")
            signalled = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            # The process exits: the clients see their streams end.
            for env in (hung, *others):
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    while True:
                        response = await asyncio.wait_for(env.call.read(), grace + 10)
                        if response is grpc.aio.EOF:
                            break
                        assert response.WhichOneof("outcome") == "notice"
                    await env.call  # the status
                assert ended.value.code() is grpc.StatusCode.UNAVAILABLE
            return signalled

    signalled = asyncio.run(main())
    # A deadline short of the gate's 30 s: the exit did not wait for the held call.
    assert server.proc.wait(20) == 0
    elapsed = time.monotonic() - signalled
    print(f"drain with a hung call, --grace {grace:g}: exit 0 after {elapsed:.2f}s")
    # Every env that could be closed was; the one stuck in its call could not.
    assert server.created() == 3
    assert server.closed_envs() == 2
    assert "openenv-grpc: drained, 1 environment(s) stuck in env code left unclosed\n" in (
        server.stdout_lines
    )


# -- step timeouts measure the env, not the queue --------------------------------------


def test_a_saturated_pool_never_costs_an_uninvolved_session_its_episode(
    start_server, tmp_path: Path
) -> None:
    """Both pool threads held at gates: the uninvolved session's step waits out the step
    timeout for a thread and is refused (RESOURCE_EXHAUSTED, episode unchanged); the two
    held steps are answered DEADLINE_EXCEEDED at their timeout while their calls are
    still held (so by the timeout, not by the call's end); once the gates open, the
    hung envs are closed and the uninvolved episode goes on."""
    timeout = 2.0
    gates = [tmp_path / "first-gate", tmp_path / "second-gate"]
    server = start_server(
        "support.envs:FaultyEnv",
        "--env-threads", "2", "--step-timeout", str(timeout), "--metrics-port", "0",
    )  # fmt: skip

    async def blocked(env: Stream, gate: Path) -> tuple[float, pb.Error]:
        started = time.monotonic()
        error = await env.error(step(f"gate:{gate}"))
        return time.monotonic() - started, error

    async def main() -> None:
        async with grpc.aio.insecure_channel(server.target) as channel:
            first, second, uninvolved = [await open_stream(channel) for _ in range(3)]
            for env in (first, second, uninvolved):
                await env.result(reset())
            assert (await uninvolved.result(step("n1"))).step_count == 1
            hung = [
                asyncio.create_task(blocked(env, gate))
                for env, gate in zip((first, second), gates, strict=True)
            ]
            try:
                for gate in gates:  # both pool threads are held in their steps now
                    await until(server, Path(f"{gate}.entered").exists, 30, "a held step")
                queued = time.monotonic()
                error = await uninvolved.error(step("n2"))
                waited = time.monotonic() - queued
                assert error.code == RESOURCE_EXHAUSTED
                assert error.message == (
                    "env thread pool saturated: 2 of 2 threads busy; the episode is unchanged, "
                    "retry"
                )
                assert waited >= timeout - 0.1  # it waited out its timeout (a lower bound)
                # The blocked sessions' timeouts fired at their timeout (from the start of
                # the call), while their calls were still held: the gates open only after.
                answers = await asyncio.gather(*hung)
            finally:
                for gate in gates:
                    gate.touch()
            print(
                f"saturated pool, step timeout {timeout:g}s: queued step refused after "
                f"{waited:.2f}s, held steps answered after "
                + ", ".join(f"{elapsed:.2f}s" for elapsed, _ in answers)
            )
            for elapsed, hung_error in answers:
                assert hung_error.code == DEADLINE_EXCEEDED
                assert hung_error.message.startswith(f"step did not finish within {timeout:g}s")
                assert elapsed >= timeout - 0.1, elapsed  # not before it (a lower bound)
            # Once the threads are free again the uninvolved episode simply goes on.
            await until(server, lambda: server.closed_envs() == 2, 15, "hung envs closed")
            result = await uninvolved.result(step("n3"))
            assert (result.step_count, echoed(result)) == (2, "n3")
            for env in (first, second):
                await env.result(reset())
            for env in (first, second, uninvolved):
                await env.close()

    asyncio.run(main())
    metrics = scrape(server)
    assert metrics["openenv_env_pool_saturated_total"] == 1
    server.wait_until(lambda: server.active() == 0, what="sessions released")


# -- the cap counts live envs -------------------------------------------------------------


def test_cancelled_opens_hold_their_slot_until_the_factory_env_is_closed(start_server) -> None:
    """An open cancelled while its factory is held at a gate: once the server has ended
    the stream (its metrics count a "cancelled" end) the slot is still taken, since the
    factory's env will exist; when the gate opens the orphan is closed and only then is
    the slot free."""
    server = start_server(
        "support.lifecycle_envs:GatedFactoryEnv",
        "--max-concurrent-envs", "1", "--metrics-port", "0",
    )  # fmt: skip
    hold = Path(f"{server.ledger}.hold-factory")
    gate = Path(f"{server.ledger}.factory-gate")
    hold.touch()  # the next factory waits at the gate

    def factory_waiting() -> bool:
        return any(gate.parent.glob(f"{gate.name}.*.entered"))

    def open_gate() -> None:
        hold.unlink()
        gate.touch()

    async def main() -> None:
        async with grpc.aio.insecure_channel(server.target) as channel:
            call = pb_grpc.EnvServiceStub(channel).Session()
            try:
                await until(server, factory_waiting, 30, "the factory running")
                assert server.active() == 1
                call.cancel()  # gone while its factory runs
                await until(
                    server, lambda: sessions_ended(server, "cancelled") == 1, 30, "stream ended"
                )
                # The factory still runs: its env will exist, so the slot stays taken.
                assert server.created() == 0
                assert server.active() == 1
                await assert_full(channel)
            finally:
                open_gate()
            # Once built, the orphan is closed and only then is its slot free.
            await until(server, lambda: server.closed_envs() == 1, 10, "orphan closed")
            await until(server, lambda: server.active() == 0, 5, "slot freed")
            env = await open_stream(channel)
            await env.result(reset())
            await env.close()

    asyncio.run(main())
    assert server.created() == server.closed_envs() == 2


def test_an_env_abandoned_in_a_hung_call_holds_its_slot_until_closed(
    start_server, tmp_path: Path
) -> None:
    """A step past the timeout, held at a gate: while it is held, its instance and the
    replacement take two slots; once the gate opens, the hung one is closed and its slot
    freed."""
    server = start_server(
        "support.envs:FaultyEnv", "--max-concurrent-envs", "2", "--step-timeout", "0.5"
    )
    gate = tmp_path / "step-gate"

    async def main() -> None:
        async with grpc.aio.insecure_channel(server.target) as channel:
            env = await open_stream(channel)
            await env.result(reset())
            try:
                error = await env.error(step(f"gate:{gate}"))
                assert error.code == DEADLINE_EXCEEDED
                # The hung instance and its replacement are both alive: two slots.
                await until(server, lambda: server.created() == 2, 10, "the replacement made")
                assert server.active() == 2 and server.closed_envs() == 0
                await assert_full(channel)
            finally:
                gate.touch()  # the hung call returns
            await until(server, lambda: server.closed_envs() == 1, 10, "hung env closed")
            await until(server, lambda: server.active() == 1, 5, "its slot freed")
            other = await open_stream(channel)
            await other.result(reset())
            for stream in (env, other):
                await stream.result(reset())
                await stream.close()

    asyncio.run(main())
    server.wait_until(lambda: server.active() == 0, what="sessions released")
    assert server.created() == server.closed_envs() == 3


def test_no_replacement_beyond_the_cap_ends_the_session(start_server, tmp_path: Path) -> None:
    """A step past the timeout, held at a gate, on a one-slot server: no fresh env can be
    made while the hung one holds the slot, so the session ends; the hung env is closed
    once its call returns."""
    server = start_server(
        "support.envs:FaultyEnv", "--max-concurrent-envs", "1", "--step-timeout", "0.5"
    )
    gate = tmp_path / "step-gate"

    async def main() -> None:
        async with grpc.aio.insecure_channel(server.target) as channel:
            env = await open_stream(channel)
            await env.result(reset())
            try:
                error = await env.error(step(f"gate:{gate}"))
                assert error.code == RESOURCE_EXHAUSTED
                assert error.message == (
                    "step did not finish within 0.5s and no fresh environment can be made: "
                    "server at capacity 1/1 sessions (an env stuck in a call holds its slot); "
                    "the session ends"
                )
                assert await env.call.read() is grpc.aio.EOF
                assert await env.call.code() is grpc.StatusCode.OK
                assert server.closed_envs() == 0 and server.active() == 1  # still held
            finally:
                gate.touch()  # the hung call returns

    asyncio.run(main())
    server.wait_until(lambda: server.closed_envs() == 1, 10, "hung env closed")
    server.wait_until(lambda: server.active() == 0, 5, "its slot freed")
    assert server.created() == 1


def test_clients_surface_the_drain_notice_as_env_draining(start_server) -> None:
    """Session and AsyncSession read the notice on their way to the next answer and show
    it as ``env.draining``; the session goes on until the grace ends."""
    from openenv_grpc import AsyncSession, Session
    from openenv_grpc.client import Draining

    grace = 30.0
    server = start_server("support.envs:FaultyEnv", "--grace", str(grace))

    async def main() -> None:
        with Session(server.target) as sync_env:
            async with AsyncSession(server.target) as async_env:
                sync_env.reset()
                await async_env.reset()
                assert sync_env.draining is None and async_env.draining is None
                signalled, wall = time.monotonic(), time.time()
                server.proc.send_signal(signal.SIGTERM)
                # Step each until it has read the notice (every step answers meanwhile).
                steps = {"sync": 0, "async": 0}

                def sync_step_saw_notice() -> bool:
                    steps["sync"] += 1
                    assert sync_env.step(EchoAction(message="a")).step_count == steps["sync"]
                    return sync_env.draining is not None

                await until(server, sync_step_saw_notice, 20, "the sync client's notice")
                while async_env.draining is None:
                    assert time.monotonic() - signalled < 20, "the async client saw no notice"
                    steps["async"] += 1
                    result = await async_env.step(EchoAction(message="b"))
                    assert result.step_count == steps["async"]
                now, wall_now = time.monotonic(), time.time()
                for env in (sync_env, async_env):
                    notice = env.draining
                    assert isinstance(notice, Draining)
                    assert "server is draining" in notice.message
                    # Bounds from the clocks read around the signal, no tolerance.
                    assert grace - (time.monotonic() - signalled) <= notice.remaining() <= grace
                    assert wall + grace - 0.001 <= notice.deadline <= wall_now + grace + 0.001
                print(f"notice read by both clients within {now - signalled:.3f}s, steps {steps}")
                # Still usable during the grace period.
                step_count = sync_env.step(EchoAction(message="c")).step_count
                assert step_count == steps["sync"] + 1
                step_count = (await async_env.step(EchoAction(message="d"))).step_count
                assert step_count == steps["async"] + 1

    asyncio.run(main())
    assert server.proc.wait(15) == 0
