"""The Fleet's cleanup paths over real servers on loopback: asyncio channels whose event
loop has ended, and asyncio channels retired by ``refresh``. Each must end closed (its
state SHUTDOWN) with no connection of this process left open to its nodes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from openenv_grpc.client.fleet import Fleet
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.echo import AsyncEchoEnv, EchoAction

pytestmark = pytest.mark.timeout(120)

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    """Two echo servers (a step "pid" answers the server's pid); stopped at the end."""
    started = [
        ServerProcess("support.envs:DeterministicEchoEnv", pythonpath=[TESTS]) for _ in range(2)
    ]
    yield started
    for server in started:
        server.stop()


class Targets:
    """A provider whose targets the test changes (as a restarted Ray actor's do)."""

    def __init__(self, targets: list[str]) -> None:
        self.targets = targets


def connections_to(server: ServerProcess) -> int:
    """This process's open TCP connections to ``server``."""
    return sum(
        1
        for conn in psutil.Process().net_connections(kind="tcp")
        if conn.raddr and conn.raddr.port == server.port and conn.status == "ESTABLISHED"
    )


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def shut(channel: grpc.aio.Channel) -> bool:
    return channel.get_state() is grpc.ChannelConnectivity.SHUTDOWN


async def pid_of(env: AsyncEchoEnv) -> int:
    """The server process the session is on (the echo env echoes its pid)."""
    return int((await env.step(EchoAction(message="pid"))).observation.echoed_message)


async def one_session(fleet: Fleet) -> grpc.aio.Channel:
    """Run a session on the fleet from the running loop; returns the loop's channel."""
    await fleet.wait_ready_async()
    async with fleet.session(AsyncEchoEnv) as env:
        await env.reset(seed=1)
    return fleet.aio_channel()


def test_stop_closes_the_channel_of_a_loop_that_is_closed(servers: list[ServerProcess]) -> None:
    """``asyncio.run`` closes its loop; the channel the fleet made on it still holds a
    connection until the fleet closes it."""
    node = servers[0]
    fleet = Fleet([node.target])
    channel = asyncio.run(one_session(fleet))
    assert connections_to(node) >= 1  # the channel outlived its loop, connected
    fleet.stop()
    assert shut(channel)
    wait_for(lambda: connections_to(node) == 0, "the connection to close")
    fleet.stop()  # twice is safe


def test_a_second_loop_closes_the_channel_of_a_loop_that_finished(
    servers: list[ServerProcess],
) -> None:
    """A loop that ran and stopped (not closed) owns a channel; ``aclose`` on another
    loop closes it without running the first (which would raise), and leaves no task."""
    node = servers[0]
    fleet = Fleet([node.target])
    first = asyncio.new_event_loop()
    try:
        channel = first.run_until_complete(one_session(fleet))
        asyncio.run(fleet.aclose())
        assert shut(channel)
        assert not asyncio.all_tasks(first)
        wait_for(lambda: connections_to(node) == 0, "the connection to close")
    finally:
        first.close()


def test_a_new_channel_closes_the_one_of_a_closed_loop(servers: list[ServerProcess]) -> None:
    """Each ``asyncio.run`` gets a channel of its own: the one of the loop before, closed
    with it, is closed then, not kept until the fleet stops."""
    node = servers[0]
    with Fleet([node.target]) as fleet:
        first = asyncio.run(one_session(fleet))
        second = asyncio.run(one_session(fleet))
        assert second is not first
        assert shut(first) and not shut(second)
        wait_for(lambda: connections_to(node) == 1, "only the second loop's connection")


def test_refresh_retires_the_channel_of_nodes_that_left(servers: list[ServerProcess]) -> None:
    """After ``refresh`` new sessions go to the provider's current node on a new channel;
    a session on the node that left goes on until it ends; closing the fleet closes the
    retired channel as well as the current one."""
    gone, current = servers
    provider = Targets([gone.target])
    fleet = Fleet(provider)

    async def run() -> tuple[grpc.aio.Channel, grpc.aio.Channel]:
        await fleet.wait_ready_async()
        old = fleet.session(AsyncEchoEnv)
        await old.open()
        await old.reset(seed=1)
        retired = fleet.aio_channel()
        provider.targets = [current.target]
        fleet.refresh()
        assert fleet.nodes == (current.target,)
        new = fleet.session(AsyncEchoEnv)
        await new.open()
        await new.reset(seed=1)
        assert await pid_of(new) == current.proc.pid
        assert await pid_of(old) == gone.proc.pid  # not cut off by the refresh
        live = fleet.aio_channel()
        assert live is not retired and not shut(retired)
        await old.close()
        await new.close()
        await fleet.aclose()
        return retired, live

    retired, live = asyncio.run(run())
    assert shut(retired) and shut(live)
    wait_for(lambda: connections_to(gone) + connections_to(current) == 0, "no connection")
