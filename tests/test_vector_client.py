"""The Python vector clients (``VectorSession``, ``AsyncVectorSession`` and the typed echo
ones) against real servers: typed columns, context managers, timeouts, typed errors,
capacity, reconnect and the drain notice, as for one-env sessions."""

from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path

import grpc
import pytest
from google.protobuf.empty_pb2 import Empty

from openenv_grpc import (
    AsyncVectorSession,
    CapacityError,
    EnvError,
    OpenRetry,
    PayloadTypeError,
    SessionLost,
    SessionStateError,
    SessionTimeout,
    VectorSession,
)
from openenv_grpc.client import InvalidRequest, aio_channel
from openenv_grpc_envs.echo import (
    AsyncEchoVectorEnv,
    EchoAction,
    EchoObservation,
    EchoResetOptions,
    EchoState,
    EchoVectorEnv,
)

pytestmark = pytest.mark.shared_server


def _say(*messages: str) -> list[EchoAction]:
    return [EchoAction(message=m) for m in messages]


def test_typed_vector_session_end_to_end(server) -> None:
    with EchoVectorEnv(server.target, 4) as envs:
        assert envs.num_envs == 4 and not envs.native and envs.session_id
        first = envs.reset(seeds=10, options=EchoResetOptions(greeting="hi"))
        assert first.indices == [0, 1, 2, 3]
        assert all(isinstance(o, EchoObservation) for o in first.observations)
        assert [o.echoed_message for o in first.observations] == ["hi"] * 4
        assert envs.episode_ids == first.episode_ids and all(first.episode_ids)
        # An int seed seeds env i with seed + i, as Gymnasium's vector envs do.
        assert [s.seed for s in envs.states()] == [10, 11, 12, 13]
        out = envs.step(_say("a", "bb", "ccc", "dddd"))
        assert out.rewards == pytest.approx([0.1, 0.2, 0.3, 0.4])
        assert out.step_counts == [1, 1, 1, 1] and out.done == [False] * 4
        assert out.autoreset == [False] * 4 and not out.errors
        part = envs.step(_say("x", "y"), indices=[1, 3])
        assert part.indices == [1, 3] and envs.step_counts == [1, 2, 1, 2]
        assert part.row(3) == 1
        state = envs.state(3)
        assert isinstance(state, EchoState) and state.total_length == 5
        # Per-env seeds and ids, some left to the server.
        again = envs.reset(seeds=[1, None], episode_ids=["mine", None], indices=[0, 2])
        assert again.indices == [0, 2] and again.episode_ids[0] == "mine"
        assert envs.state(0).seed == 1
        assert envs.step_counts == [0, 2, 0, 2]
    server.wait_until(lambda: server.closed_envs() == 4 and server.active() == 0)


def test_errors_are_typed_and_the_stream_goes_on(start_server) -> None:
    server = start_server("support.envs:FaultyEnv")
    with VectorSession(server.target, 3) as envs:  # untyped: decodes registered types
        envs.reset()
        with pytest.raises(EnvError) as refused:
            envs.step(_say("a", "b"), indices=[2, 1])
        assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert "strictly increasing" in refused.value.message
        with pytest.raises(EnvError) as wrong_count:
            envs.step(_say("a", "b"))
        assert wrong_count.value.code is grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(InvalidRequest):
            envs.reset(seeds=[1, 2])  # 2 seeds for 3 envs: nothing sent
        with pytest.raises(EnvError) as native_only:
            envs.step_batch(EchoAction(message="x"))
        assert "loop" in native_only.value.message
        out = envs.step(_say("ok", "raise", "invalid"))
        assert out.indices == [0] and out.observations[0].echoed_message == "ok"
        assert out.errors[1].code is grpc.StatusCode.INTERNAL
        assert out.errors[1].exception_type == "builtins.RuntimeError"
        assert out.errors[2].code is grpc.StatusCode.INVALID_ARGUMENT
        envs.step(_say("x", "y", "break-state"), indices=None)
        with pytest.raises(EnvError) as state_failed:
            envs.states()
        assert state_failed.value.code is grpc.StatusCode.INTERNAL
        assert "env 2" in state_failed.value.message
        assert envs.state(0) == EchoState()
    with EchoVectorEnv(server.target, 2) as typed, pytest.raises(PayloadTypeError):
        typed.step([EchoAction(), Empty()])  # type: ignore[list-item]
    with pytest.raises(SessionStateError):
        EchoVectorEnv(server.target, 2).step(_say("a", "b"))
    with pytest.raises(ValueError):
        EchoVectorEnv(server.target, 0)
    with pytest.raises(ValueError):
        EchoVectorEnv(server.target, 2, autoreset="later")


def test_a_timed_out_call_leaves_the_stream_usable(start_server, tmp_path: Path) -> None:
    server = start_server("support.envs:FaultyEnv")
    gate = tmp_path / "gate"
    with VectorSession(server.target, 2) as envs:
        envs.reset()
        # Env 0 waits at a gate only the test opens: a timeout is the only way back.
        with pytest.raises(SessionTimeout):
            envs.step(_say(f"gate:{gate}", "fast"), timeout=0.2)
        assert Path(f"{gate}.entered").exists() and not gate.exists()
        gate.touch()
        out = envs.step(_say("after", "after"), timeout=10)  # the late answer is dropped
        assert [o.echoed_message for o in out.observations] == ["after", "after"]
        assert out.step_counts == [2, 2]


def test_capacity_error_names_n_and_retry_opens_once_room_is_made(start_server) -> None:
    server = start_server(
        "support.envs:CountingEchoEnv", "--max-concurrent-envs", "4", "--retry-pushback-ms", "100"
    )
    holder = EchoVectorEnv(server.target, 3)
    holder.open()
    with pytest.raises(CapacityError) as full:
        EchoVectorEnv(server.target, 2).open()
    assert "2 envs asked, 1 free" in full.value.message and full.value.retry_after == 0.1
    retry = OpenRetry(attempts=50, initial_backoff=0.05, max_backoff=0.2)
    waiting = EchoVectorEnv(server.target, 2, retry=retry)
    freer = threading.Timer(0.5, holder.close)
    freer.start()
    try:
        waiting.open()  # retried until the holder's three slots were freed
        assert server.active() == 2
        waiting.close()
    finally:
        freer.join()


def test_idle_timeout_is_session_lost_and_reconnect_opens_a_fresh_stream(start_server) -> None:
    server = start_server("support.envs:CountingEchoEnv", "--idle-timeout", "0.4")
    envs = EchoVectorEnv(server.target, 3, reconnect=True)
    envs.open()
    envs.reset()
    server.wait_until(lambda: server.closed_envs() == 3, 10, "the idle stream reaped")
    with pytest.raises(SessionLost) as lost:
        envs.step(_say("a", "b", "c"))
    assert lost.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    fresh = envs.reset()  # reconnect: a fresh stream of 3 fresh envs
    assert fresh.indices == [0, 1, 2] and server.created() == 6
    envs.close()
    server.wait_until(lambda: server.active() == 0)


def test_the_drain_notice_shows_as_draining(start_server) -> None:
    server = start_server("support.envs:CountingEchoEnv", "--grace", "30")
    with EchoVectorEnv(server.target, 2) as envs:
        envs.reset()
        assert envs.draining is None
        server.proc.send_signal(signal.SIGTERM)
        server.wait_until(
            lambda: envs.step(_say("a", "b")) is not None and envs.draining is not None,
            10, "the drain notice",
        )  # fmt: skip
        assert envs.draining is not None and 0 < envs.draining.remaining() <= 30
    assert server.proc.wait(15) == 0


def test_async_vector_sessions_share_a_channel(server) -> None:
    async def rollout(channel: grpc.aio.Channel, k: int) -> list[float]:
        async with AsyncEchoVectorEnv(channel, 3, autoreset="same_step") as envs:
            await envs.reset(options=EchoResetOptions(max_steps=2))
            total = [0.0, 0.0, 0.0]
            for t in range(3):
                out = await envs.step(_say(*(f"{k}{t}{i}" for i in range(3))), timeout=10)
                total = [a + b for a, b in zip(total, out.rewards, strict=True)]
                if t == 1:  # every episode ended and was reset in the same step
                    assert out.autoreset == [True] * 3 and out.step_counts == [0] * 3
                    assert [o.echoed_message for o in out.final_observations.values()] == [
                        f"{k}1{i}" for i in range(3)
                    ]
            assert (await envs.state(1)).total_length == 3
            return total

    async def main() -> list[list[float]]:
        async with aio_channel(server.target) as channel:
            return await asyncio.gather(*(rollout(channel, k) for k in range(4)))

    totals = asyncio.run(main())
    assert totals == [[pytest.approx(0.9)] * 3] * 4
    server.wait_until(lambda: server.closed_envs() == 12 and server.active() == 0)


def test_untyped_async_vector_session_and_abort(server) -> None:
    async def main() -> None:
        envs = AsyncVectorSession(server.target, 2)
        await envs.open()
        await envs.reset()
        out = await envs.step(_say("p", "q"))
        assert isinstance(out.observations[0], EchoObservation)
        await envs.abort()

    asyncio.run(main())
    server.wait_until(lambda: server.closed_envs() == 2 and server.active() == 0)
