"""Recovery on a channel the session was given waits for that channel to reconnect: its
server killed, the port held by a listener that refuses every connect (as a down
server does, but counted), then a new server on the same port. gRPC's reconnect backoff
grew while the server was down (1, 1.6, 2.6, 4.1, 6.6, 10.5 s by default): the channel
must still reach the new server within the recovery's window."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from openenv_grpc.client import Recovery, SessionLost
from openenv_grpc.client.channel import AioChannelPool, sync_channel
from openenv_grpc.client.recovery import RecoveringCalls
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.echo import AsyncEchoEnv, EchoAction, EchoEnv, EchoResetOptions

pytestmark = pytest.mark.timeout(240)

TESTS = Path(__file__).resolve().parent
SNAP = "support.envs:SnapshotEchoEnv"
KEYS = {"SNAPSHOT_KEYS": "k1:0123456789abcdef0123456789abcdef"}
MESSAGES = ["alpha", "be", "gamma-ray", "d", "epsilon"]
SEED = 11
#: Failed connects the channel makes before the new server starts: with gRPC's default
#: backoff the next one would be 10.5 s (+-20 %) after the last, far past the window.
CONNECTS = 6
#: The recovery's window: a channel that reconnects within a second or so of its
#: server's return makes it; one that waits out a backoff of many seconds does not.
WITHIN = 3.0
#: Seconds to wait for those connects: six take about 16 s, but a connect made between
#: the kill and the listener's bind is refused unseen, and each one missed moves the
#: sixth seen out by another backoff (26 s, then 43 s; +-20 %, more on a loaded machine).
CONNECT_WAIT = 140.0

Trajectory = list[tuple[float, int, bool]]


def serve(*args: str) -> ServerProcess:
    return ServerProcess(SNAP, args, KEYS, pythonpath=[TESTS])


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    """Servers a test starts; each is stopped at the end."""
    started: list[ServerProcess] = []
    yield started
    for server in started:
        server.stop()


class RefusingListener:
    """Holds a port while its server is down: accepts each connect and closes it at
    once (a failed connect to gRPC), counting them."""

    def __init__(self, port: int) -> None:
        self._socket = socket.create_server(("127.0.0.1", port))
        self._socket.settimeout(0.05)
        self.connects = 0
        self.opened = time.monotonic()
        self.times: list[float] = []  # seconds after opening, one per connect
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._socket.accept()
            except TimeoutError:
                continue
            conn.close()
            self.times.append(round(time.monotonic() - self.opened, 2))
            self.connects += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()


def wait_for(condition: Callable[[], bool], what: Callable[[], str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what()}"
        time.sleep(0.01)


def entry(env: EchoEnv, message: str) -> tuple[float, int, bool]:
    result = env.step(EchoAction(message=message))
    return result.reward, result.step_count, result.done


def undisturbed(target: str) -> Trajectory:
    with EchoEnv(target) as env:
        env.reset(seed=SEED, options=EchoResetOptions(max_steps=50))
        return [entry(env, message) for message in MESSAGES]


@pytest.mark.fresh_server  # a server of its own, killed and replaced: make test
def test_a_session_on_a_given_channel_recovers_once_its_server_is_back(
    servers: list[ServerProcess],
) -> None:
    first = serve()
    servers.append(first)
    port = first.port
    channel = sync_channel(first.target)
    recovery = Recovery(every=2, within=WITHIN)
    with channel, EchoEnv(channel, recovery=recovery) as env:
        start = env.reset(seed=SEED, options=EchoResetOptions(max_steps=50))
        trajectory = [entry(env, MESSAGES[0])]
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        listener = RefusingListener(port)
        # The channel keeps trying to connect, as it does while a session waits on it.
        trying = grpc.channel_ready_future(channel)
        try:
            wait_for(
                lambda: listener.connects >= CONNECTS,
                lambda: f"{CONNECTS} failed connects (seen at {listener.times} s)",
                CONNECT_WAIT,
            )
        finally:
            listener.close()
        servers.append(serve("--port", str(port)))
        trying.cancel()
        # The next call finds its stream lost and recovers on the given channel.
        trajectory += [entry(env, message) for message in MESSAGES[1:]]
        assert env.episode_id == start.episode_id
        assert (env.recoveries, recovery.recovered) == (1, 1)
    assert trajectory == undisturbed(servers[-1].target)


@pytest.mark.fresh_server  # a server of its own, killed and replaced: make test
def test_an_async_session_on_a_pool_channel_recovers_once_its_server_is_back(
    servers: list[ServerProcess],
) -> None:
    first = serve()
    servers.append(first)
    port = first.port
    recovery = Recovery(every=2, within=WITHIN)

    async def run() -> tuple[Trajectory, str, str]:
        async with AioChannelPool(first.target, size=1) as pool:
            channel = pool.next()
            async with AsyncEchoEnv(channel, recovery=recovery) as env:
                start = await env.reset(seed=SEED, options=EchoResetOptions(max_steps=50))
                result = await env.step(EchoAction(message=MESSAGES[0]))
                trajectory = [(result.reward, result.step_count, result.done)]
                first.proc.send_signal(signal.SIGKILL)
                await asyncio.to_thread(first.proc.wait, 10)
                listener = RefusingListener(port)
                trying = asyncio.ensure_future(channel.channel_ready())  # keeps it trying
                try:
                    await asyncio.to_thread(
                        wait_for,
                        lambda: listener.connects >= CONNECTS,
                        lambda: f"{CONNECTS} failed connects (seen at {listener.times} s)",
                        CONNECT_WAIT,
                    )
                finally:
                    listener.close()
                servers.append(await asyncio.to_thread(serve, "--port", str(port)))
                trying.cancel()
                for message in MESSAGES[1:]:
                    result = await env.step(EchoAction(message=message))
                    trajectory.append((result.reward, result.step_count, result.done))
                assert env.recoveries == 1
                return trajectory, start.episode_id, env.episode_id

    trajectory, started, now = asyncio.run(run())
    assert now == started
    assert recovery.recovered == 1
    assert trajectory == undisturbed(servers[-1].target)


class DownEverywhere:
    """A session's io whose every reopen is refused (no server anywhere): it notes when
    each attempt was made, on which target."""

    def __init__(self) -> None:
        self.attempts: list[tuple[float, str | None]] = []

    async def _io_roundtrip(self, request: object, timeout: float | None) -> object:
        raise grpc.RpcError  # never reached: no reopen succeeds

    async def _io_reopen(self, target: str | None) -> None:
        self.attempts.append((time.monotonic(), target))
        raise SessionLost(grpc.StatusCode.UNAVAILABLE, "nothing is listening")

    async def _io_pause(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def test_a_recovery_keeps_trying_until_its_window_ends() -> None:
    # Pauses grow 0.05, 0.1, 0.2, 0.4, 0.8 s: the one that would pass the deadline is cut
    # to it, and the targets are tried once more there; the loss is raised only then.
    # (It once gave up at the first pause that would pass: half of a 1.5 s window unused.)
    io = DownEverywhere()
    recovery = Recovery(targets=["other:1"], within=1.2)
    calls = RecoveringCalls(recovery, None, io)  # type: ignore[arg-type]  # a failed reopen reads none
    lost = SessionLost(grpc.StatusCode.UNAVAILABLE, "server killed")
    deadline = time.monotonic() + 1.2
    with pytest.raises(SessionLost, match=r"no server took the episode within 1\.2s \(12 attempt"):
        asyncio.run(calls._recover(lost, None, replay=False, deadline=deadline))
    assert [target for _, target in io.attempts] == [None, "other:1"] * 6
    last_round = io.attempts[-2][0]
    assert deadline - 0.05 <= last_round <= deadline + 0.25


def test_a_replay_that_gives_no_reward_where_there_was_0_is_not_the_same() -> None:
    """What a replayed step is checked against: a reward of None (``no_reward``) and a
    real 0 differ, so a replay that turns one into the other is warned about."""
    from openenv_grpc.client.outcome import StepOutcome
    from openenv_grpc.client.recovery import _trace

    zero = StepOutcome(None, 0.0, False, False, "e", 1)
    none = StepOutcome(None, 0.0, False, False, "e", 1, no_reward=True)
    assert _trace(zero) != _trace(none)
    assert _trace(none) == _trace(StepOutcome(None, 0.0, False, False, "e", 1, no_reward=True))
