"""Opt-in reconnect: after a lost session, the next call opens a fresh one."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from openenv_grpc import AsyncSession, EnvError, Session, SessionLost
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.echo import EchoAction


def test_sync_reconnects_after_an_idle_timeout(start_server) -> None:
    server = start_server("support.envs:CountingEchoEnv", "--idle-timeout", "0.3")
    with Session(server.target, reconnect=True) as env:
        env.reset()
        first_id = env.session_id
        server.wait_until(lambda: server.closed_envs() == 1, what="the idle session reaped")
        with pytest.raises(SessionLost) as lost:
            env.step(EchoAction(message="too late"))
        assert lost.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        # The episode is gone: a step on the fresh session says so, and reset goes on.
        with pytest.raises(EnvError) as failed:
            env.step(EchoAction(message="no episode yet"))
        assert failed.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert env.session_id != first_id
        env.reset()
        assert env.step(EchoAction(message="again")).observation.echoed_message == "again"
    server.wait_until(lambda: server.closed_envs() == 2, what="both envs closed")


def test_without_reconnect_a_lost_session_stays_lost(start_server) -> None:
    server = start_server("support.envs:CountingEchoEnv", "--idle-timeout", "0.3")
    with Session(server.target) as env:
        env.reset()
        server.wait_until(lambda: server.closed_envs() == 1, what="the idle session reaped")
        with pytest.raises(SessionLost):
            env.step(EchoAction(message="too late"))
        with pytest.raises(RuntimeError, match="session is not open"):
            env.reset()
    assert server.created() == 1


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_async_reconnects_to_a_restarted_server() -> None:
    port = _free_port()
    first = ServerProcess("echo", ["--port", str(port)])

    async def main() -> None:
        async with AsyncSession(first.target, reconnect=True) as env:
            await env.reset()
            first.stop()  # the server dies mid-episode
            with pytest.raises(SessionLost):
                await env.step(EchoAction(message="lost"))
            second = ServerProcess("echo", ["--port", str(port)])
            try:
                result = await env.reset()
                assert result.step_count == 0
                stepped = await env.step(EchoAction(message="back"))
                assert stepped.observation.echoed_message == "back"
            finally:
                await env.close()
                second.stop()

    asyncio.run(main())
