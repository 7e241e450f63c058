"""A hung env call: DEADLINE_EXCEEDED in-band, the env replaced, neighbours unaffected."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from openenv_grpc import AsyncSession, EnvError, Session
from openenv_grpc_envs.echo import EchoAction


def hang(env: Session, seconds: float) -> EnvError:  # type: ignore[type-arg]
    with pytest.raises(EnvError) as failed:
        env.step(EchoAction(message=f"sleep:{seconds}"))
    return failed.value


def test_pooled_step_timeout_replaces_the_env(start_server) -> None:
    server = start_server("support.envs:FaultyEnv", "--step-timeout", "0.5")
    with Session(server.target) as env:
        env.reset()
        error = hang(env, 3)
        assert error.code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert error.message == (
            "step did not finish within 0.5s; the environment was replaced with a fresh one: "
            "call reset"
        )
        assert server.created() == 2  # the replacement exists already
        with pytest.raises(EnvError) as failed:
            env.step(EchoAction(message="hello"))
        assert failed.value.code is grpc.StatusCode.FAILED_PRECONDITION
        env.reset()
        assert env.step(EchoAction(message="hello")).observation.echoed_message == "hello"
        # The hung instance is closed once its call returns, not before.
        assert server.closed_envs() == 0
        server.wait_until(lambda: server.closed_envs() == 1, timeout=10, what="hung env closed")
    server.wait_until(lambda: server.closed_envs() == 2, what="replacement closed")
    assert server.active() == 0


def test_a_hung_step_does_not_stall_other_sessions(start_server) -> None:
    server = start_server("support.envs:FaultyEnv", "--step-timeout", "1")
    done = threading.Event()
    steps_while_hung = 0

    def hung_session() -> None:
        with Session(server.target) as env:
            env.reset()
            hang(env, 4)
        done.set()

    with Session(server.target) as neighbour:
        neighbour.reset()
        thread = threading.Thread(target=hung_session)
        thread.start()
        server.wait_until(lambda: server.created() == 2, what="hung session open")
        while not done.is_set():
            result = neighbour.step(EchoAction(message=f"n{steps_while_hung}"))
            assert result.observation.echoed_message == f"n{steps_while_hung}"
            steps_while_hung += 1
        thread.join()
    assert steps_while_hung > 10  # it kept stepping for the whole second the other hung


def test_env_declared_timeout_applies_without_a_flag(start_server) -> None:
    server = start_server("support.envs:DeclaredTimeoutEnv")
    with Session(server.target) as env:
        env.reset()
        error = hang(env, 2)
        assert error.code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "within 0.3s" in error.message


def test_async_env_timeout_cancels_and_replaces(start_server) -> None:
    server = start_server("support.envs:AsyncEchoEnv", "--step-timeout", "0.3")

    async def main() -> None:
        async with AsyncSession(server.target) as env:
            await env.reset()
            with pytest.raises(EnvError) as failed:
                await env.step(EchoAction(message="sleep:30"))
            assert failed.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
            # Cancelled, so the old instance closes right away.
            server.wait_until(lambda: server.closed_envs() == 1, what="cancelled env closed")
            await env.reset()
            assert (await env.step(EchoAction(message="ok"))).observation.echoed_message == "ok"

    asyncio.run(main())
    server.wait_until(lambda: server.closed_envs() == 2, what="replacement closed")


def test_failed_replacement_ends_the_session_cleanly(start_server) -> None:
    server = start_server("support.envs:OneShotFactoryEnv", "--step-timeout", "0.3")
    with Session(server.target) as env:
        env.reset()
        with pytest.raises(EnvError) as failed:
            env.step(EchoAction(message="sleep:1"))
        assert failed.value.code is grpc.StatusCode.INTERNAL
        assert failed.value.message == (
            "the environment hung and a new one could not be created: "
            "RuntimeError: no second instance available"
        )
    server.wait_until(lambda: server.active() == 0, what="slot released")
    server.wait_until(lambda: server.closed_envs() == 1, timeout=10, what="hung env closed")
