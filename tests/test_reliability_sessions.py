"""Hardening of the session path (issue 16): size caps, a drain that keeps its grace,
step timeouts that measure the env and not the queue, and a cap on live envs.

Every test runs a real ``openenv-grpc serve`` process on loopback. Sessions are driven
through the raw generated ``grpc.aio`` stub, so the test reads every response itself,
notices (request_id 0) included.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
import urllib.request

import grpc
import pytest
from google.protobuf import any_pb2
from prometheus_client.parser import text_string_to_metric_families

from openenv_grpc.metadata import ADMITTED_KEY
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc
from openenv_grpc_envs.echo import EchoAction, EchoObservation, EchoResetOptions

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
    url = next(
        match.group(1)
        for line in server.stdout_lines
        if (match := re.search(r"metrics on (http://\S+/metrics)", line))
    )
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


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


def test_drain_notice_reaches_held_sessions_at_once(start_server) -> None:
    grace = 30.0
    server = start_server("support.envs:FaultyEnv", "--grace", str(grace))

    async def main() -> None:
        async with grpc.aio.insecure_channel(server.target) as channel:
            idle = await open_stream(channel)
            busy = await open_stream(channel)
            await idle.result(reset())
            await busy.result(reset())
            # A step in flight while the notice goes out: notice and answer must both
            # arrive whole (writes on one stream never overlap).
            stepping = await busy.send(step("sleep:1"))
            await asyncio.sleep(0.3)
            signalled = time.monotonic()
            wall = time.time()
            server.proc.send_signal(signal.SIGTERM)
            response = await asyncio.wait_for(idle.call.read(), 10)
            arrived = time.monotonic()
            assert response.request_id == 0
            assert response.WhichOneof("outcome") == "notice"
            notice = response.notice
            assert notice.kind == pb.NOTICE_KIND_DRAINING
            assert arrived - signalled < 5  # right away, not when the 30 s grace ends
            assert grace - 6 < notice.seconds_left <= grace
            assert abs(notice.deadline.ToNanoseconds() / 1e9 - (wall + grace)) < 6
            assert "server is draining" in notice.message
            answer = await busy.answer(stepping)
            assert echoed(answer.result) == "sleep:1"
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


def test_drain_with_a_hung_env_call_exits_within_grace(start_server) -> None:
    grace = 3.0
    server = start_server("support.envs:FaultyEnv", "--grace", str(grace))

    async def main() -> float:
        async with grpc.aio.insecure_channel(server.target) as channel:
            hung = await open_stream(channel)
            others = [await open_stream(channel) for _ in range(2)]
            for env in (hung, *others):
                await env.result(reset())
            await hung.send(step("sleep:120"))  # blocks a pool thread for good
            await asyncio.sleep(0.3)
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
    assert server.proc.wait(grace + 5) == 0
    assert time.monotonic() - signalled < grace + 5
    # Every env that could be closed was; the one stuck in its call could not.
    assert server.created() == 3
    assert server.closed_envs() == 2
    assert "openenv-grpc: drained, 1 environment(s) stuck in env code left unclosed\n" in (
        server.stdout_lines
    )


# -- step timeouts measure the env, not the queue --------------------------------------


def test_a_saturated_pool_never_costs_an_uninvolved_session_its_episode(start_server) -> None:
    timeout = 2.0
    server = start_server(
        "support.envs:FaultyEnv",
        "--env-threads", "2", "--step-timeout", str(timeout), "--metrics-port", "0",
    )  # fmt: skip

    async def blocked(env: Stream) -> tuple[float, pb.Error]:
        started = time.monotonic()
        error = await env.error(step("sleep:6"))
        return time.monotonic() - started, error

    async def main() -> None:
        async with grpc.aio.insecure_channel(server.target) as channel:
            first, second, uninvolved = [await open_stream(channel) for _ in range(3)]
            for env in (first, second, uninvolved):
                await env.result(reset())
            assert (await uninvolved.result(step("n1"))).step_count == 1
            hung = [asyncio.create_task(blocked(env)) for env in (first, second)]
            await asyncio.sleep(0.5)  # both pool threads are in their 6 s steps now
            queued = time.monotonic()
            error = await uninvolved.error(step("n2"))
            assert error.code == RESOURCE_EXHAUSTED
            assert error.message == (
                "env thread pool saturated: 2 of 2 threads busy; the episode is unchanged, retry"
            )
            assert time.monotonic() - queued >= timeout - 0.1  # waited out its timeout
            # The blocked sessions' timeouts fired at their timeout (from the start of the
            # call), and their fresh envs did not wait behind the blocked threads.
            for elapsed, hung_error in await asyncio.gather(*hung):
                assert hung_error.code == DEADLINE_EXCEEDED
                assert timeout - 0.1 <= elapsed < timeout + 2, elapsed
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
    server = start_server(
        "support.envs:SlowFactoryEnv",
        "--max-concurrent-envs", "1",
        extra_env={"OPENENV_TEST_FACTORY_SECONDS": "2"},
    )  # fmt: skip

    async def main() -> None:
        async with grpc.aio.insecure_channel(server.target) as channel:
            call = pb_grpc.EnvServiceStub(channel).Session()
            await until(server, lambda: server.active() == 1, what="open admitted")
            call.cancel()  # gone while its factory runs
            await asyncio.sleep(0.3)
            # The factory still runs: its env will exist, so the slot stays taken.
            assert server.created() == 0
            assert server.active() == 1
            await assert_full(channel)
            # Once built, the orphan is closed and only then is its slot free.
            await until(server, lambda: server.closed_envs() == 1, 10, "orphan closed")
            await until(server, lambda: server.active() == 0, 5, "slot freed")
            env = await open_stream(channel)
            await env.result(reset())
            await env.close()

    asyncio.run(main())
    assert server.created() == server.closed_envs() == 2


def test_an_env_abandoned_in_a_hung_call_holds_its_slot_until_closed(start_server) -> None:
    server = start_server(
        "support.envs:FaultyEnv", "--max-concurrent-envs", "2", "--step-timeout", "0.5"
    )

    async def main() -> None:
        async with grpc.aio.insecure_channel(server.target) as channel:
            env = await open_stream(channel)
            await env.result(reset())
            error = await env.error(step("sleep:3"))
            assert error.code == DEADLINE_EXCEEDED
            # The hung instance and its replacement are both alive: two slots.
            assert server.active() == 2
            await assert_full(channel)
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


def test_no_replacement_beyond_the_cap_ends_the_session(start_server) -> None:
    server = start_server(
        "support.envs:FaultyEnv", "--max-concurrent-envs", "1", "--step-timeout", "0.5"
    )

    async def main() -> None:
        async with grpc.aio.insecure_channel(server.target) as channel:
            env = await open_stream(channel)
            await env.result(reset())
            error = await env.error(step("sleep:2"))
            assert error.code == RESOURCE_EXHAUSTED
            assert error.message == (
                "step did not finish within 0.5s and no fresh environment can be made: "
                "server at capacity 1/1 sessions (an env stuck in a call holds its slot); "
                "the session ends"
            )
            assert await env.call.read() is grpc.aio.EOF
            assert await env.call.code() is grpc.StatusCode.OK

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
                server.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(1.0)  # the notice is on the wire by now
                sync_env.step(EchoAction(message="a"))
                await async_env.step(EchoAction(message="b"))
                for env in (sync_env, async_env):
                    notice = env.draining
                    assert isinstance(notice, Draining)
                    assert "server is draining" in notice.message
                    assert grace - 6 < notice.remaining() <= grace
                    assert abs(notice.deadline - (time.time() + notice.remaining())) < 6
                # Still usable during the grace period.
                assert sync_env.step(EchoAction(message="c")).step_count == 2
                assert (await async_env.step(EchoAction(message="d"))).step_count == 2

    asyncio.run(main())
    assert server.proc.wait(15) == 0
