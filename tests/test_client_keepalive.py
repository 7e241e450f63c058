"""A frozen server (SIGSTOPped: its kernel still ACKs, its gRPC answers nothing) is noticed
by every Python client within the client's keepalive time + timeout (15 s + 10 s), not
grpc's 60 s ping timeout, and a fleet's sessions on a frozen node recover within it.
Found by the attack on issue 36 (row 6): a fleet node SIGSTOPped stalled its sessions
60.3 s, because grpc-core sends no keepalive ping while a BDP ping is unanswered and
waited for that one up to its ping timeout (60 s); the clients now set
``grpc.http2.ping_timeout_ms`` to the keepalive timeout."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from openenv_grpc.client import SessionLost
from openenv_grpc.client.channel import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, AioChannelPool
from openenv_grpc.client.fleet import Fleet
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.echo import (
    AsyncEchoEnv,
    AsyncEchoVectorEnv,
    EchoAction,
    EchoEnv,
    EchoResetOptions,
    EchoVectorEnv,
)

pytestmark = [pytest.mark.slow, pytest.mark.fresh_server, pytest.mark.timeout(120)]

#: The promise: a frozen server is noticed within keepalive time + timeout.
PROMISE_S = (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000
#: A large answer makes the client's transport send a BDP ping as it arrives: the case
#: that waited 60 s.
BIG = "x" * 60_000


@pytest.fixture
def frozen_server() -> Iterator[ServerProcess]:
    process = ServerProcess("echo", [])
    yield process
    process.proc.send_signal(signal.SIGCONT)
    process.stop()


def _timed(call: Callable[[], Any], since: float) -> tuple[float, BaseException | None]:
    """Seconds from ``since`` until ``call`` returned or raised, and what it raised."""
    try:
        call()
    except BaseException as exc:
        return time.monotonic() - since, exc
    return time.monotonic() - since, None


def test_every_client_notices_a_frozen_server_within_its_keepalive(
    frozen_server: ServerProcess,
) -> None:
    """A Session, an AsyncSession, a VectorSession, an AsyncVectorSession and an
    AioChannelPool session, each mid-episode with a large answer just received, step as
    the server freezes: each fails with SessionLost within the promise."""
    target = frozen_server.target
    results: dict[str, tuple[float, BaseException | None]] = {}
    ready = threading.Barrier(3)
    frozen = threading.Event()
    frozen_at: list[float] = []  # when the server was stopped: every time counts from it

    def sync_clients() -> None:
        with EchoEnv(target) as env, EchoVectorEnv(target, 2) as envs:
            env.reset(seed=0)
            envs.reset(seeds=0)
            env.step(EchoAction(message=BIG))
            envs.step([EchoAction(message=BIG)] * 2)
            ready.wait()
            frozen.wait()
            since = frozen_at[0]
            results["Session"] = _timed(lambda: env.step(EchoAction(message="a")), since)
            results["VectorSession"] = _timed(
                lambda: envs.step([EchoAction(message="b")] * 2), since
            )

    def async_clients() -> None:
        async def timed(make: Callable[[], Awaitable[Any]]) -> tuple[float, BaseException | None]:
            try:
                await make()
            except BaseException as exc:
                return time.monotonic() - frozen_at[0], exc
            return time.monotonic() - frozen_at[0], None

        async def run() -> None:
            async with AioChannelPool(target, 2) as pool:
                env = AsyncEchoEnv(target)
                envs = AsyncEchoVectorEnv(target, 2)
                pooled = await pool.open_session(AsyncEchoEnv)
                await env.open()
                await envs.open()
                await env.reset(seed=0)
                await envs.reset(seeds=0)
                await pooled.reset(seed=0)
                await env.step(EchoAction(message=BIG))
                await envs.step([EchoAction(message=BIG)] * 2)
                await pooled.step(EchoAction(message=BIG))
                await asyncio.get_running_loop().run_in_executor(None, ready.wait)
                await asyncio.get_running_loop().run_in_executor(None, frozen.wait)
                timings = await asyncio.gather(
                    timed(lambda: env.step(EchoAction(message="a"))),
                    timed(lambda: envs.step([EchoAction(message="b")] * 2)),
                    timed(lambda: pooled.step(EchoAction(message="c"))),
                )
                names = ["AsyncSession", "AsyncVectorSession", "AioChannelPool session"]
                results.update(zip(names, timings, strict=True))
                for session in (env, envs, pooled):
                    await session.close()

        asyncio.run(run())

    threads = [threading.Thread(target=sync_clients), threading.Thread(target=async_clients)]
    for thread in threads:
        thread.start()
    ready.wait(timeout=60)
    frozen_server.proc.send_signal(signal.SIGSTOP)
    frozen_at.append(time.monotonic())
    frozen.set()
    for thread in threads:
        thread.join(timeout=90)
    print(
        "\nKEEPALIVE frozen server noticed after "
        + ", ".join(f"{name} {seconds:.1f}s" for name, (seconds, _) in sorted(results.items())),
        flush=True,
    )
    assert len(results) == 5
    for name, (seconds, error) in results.items():
        assert isinstance(error, SessionLost), (name, error)
        assert seconds <= PROMISE_S + 1, (name, seconds)  # was 60.3 s


def test_an_idle_session_notices_a_frozen_server_within_its_keepalive(
    frozen_server: ServerProcess,
) -> None:
    """No BDP ping outstanding: the session was quiet for almost a keepalive interval, so
    the next keepalive ping is as late as it gets; the step fails within the promise, and
    the idle minute before drew no GOAWAY for too many pings."""
    with EchoEnv(frozen_server.target) as env:
        env.reset(seed=0)
        time.sleep(KEEPALIVE_TIME_MS / 1000 * 2 + 2)  # two pings: the server accepts them
        assert env.step(EchoAction(message="x")).step_count == 1
        time.sleep(KEEPALIVE_TIME_MS / 1000 - 1)
        env.step(EchoAction(message="x"))
        frozen_server.proc.send_signal(signal.SIGSTOP)
        seconds, error = _timed(lambda: env.step(EchoAction(message="y")), time.monotonic())
    print(f"\nKEEPALIVE idle session noticed the frozen server after {seconds:.1f}s", flush=True)
    assert isinstance(error, SessionLost), error
    assert seconds <= PROMISE_S + 1  # was 60 s with a BDP ping out, else 30 s


# -- a fleet's frozen node (the issue's own attack) -------------------------------------

TESTS = Path(__file__).resolve().parent
MESSAGES = ["alpha", "be", "gamma-ray", "d", "epsilon", "zeta", "eta", "theta-x", "i", "kappa"]
Trajectory = list[tuple[float, int, bool]]


@pytest.fixture
def nodes() -> Iterator[list[ServerProcess]]:
    """Three servers of the snapshot echo env with one key; all stopped at the end."""
    keys = {"SNAPSHOT_KEYS": "k1:0123456789abcdef0123456789abcdef"}
    started = [
        ServerProcess("support.envs:SnapshotEchoEnv", [], keys, pythonpath=[TESTS])
        for _ in range(3)
    ]
    yield started
    for server in started:
        server.proc.kill()  # a stopped process dies too
        server.stop()


def _step(env: EchoEnv, message: str) -> tuple[float, int, bool]:
    result = env.step(EchoAction(message=message))
    return result.reward, result.step_count, result.done


def _node_of(env: EchoEnv, servers: list[ServerProcess]) -> ServerProcess:
    """The server process a session is on (the env echoes its pid; no reward drawn)."""
    pid = int(env.step(EchoAction(message="pid")).observation.echoed_message)
    return next(server for server in servers if server.proc.pid == pid)


def test_every_episode_on_a_frozen_fleet_node_resumes_within_the_keepalive_promise(
    nodes: list[ServerProcess],
) -> None:
    """The node SIGSTOPped mid-run (its kernel keeps the TCP connection up, its gRPC
    answers nothing). Its sessions stalled 60.3 s before recovering; now within the
    client's keepalive time + timeout, with exactly the rewards of an undisturbed run."""
    seeds = [21, 22, 23, 24, 25, 26]
    with Fleet([server.target for server in nodes]) as fleet:
        fleet.wait_ready()
        recovery = fleet.recovery(every=3)
        sessions = [fleet.session(EchoEnv, recovery=recovery) for _ in seeds]
        trajectories: list[Trajectory] = []
        for env, seed in zip(sessions, seeds, strict=True):
            env.open()
            env.reset(seed=seed, options=EchoResetOptions(max_steps=50))
            trajectories.append([])
        homes = [_node_of(env, nodes) for env in sessions]  # not a step of the episode
        victim = homes[0]
        on_victim = [index for index, home in enumerate(homes) if home is victim]
        slowest = 0.0
        for index, message in enumerate(MESSAGES):
            if index == 4:
                victim.proc.send_signal(signal.SIGSTOP)
            for env, trajectory in zip(sessions, trajectories, strict=True):
                started = time.monotonic()
                trajectory.append(_step(env, message))
                slowest = max(slowest, time.monotonic() - started)
        print(f"\nKEEPALIVE fleet node frozen: slowest step {slowest:.1f}s", flush=True)
        assert slowest <= PROMISE_S + 3  # was 60.3 s; + the reopen and the restore
        assert [env.recoveries for env in sessions] == [
            1 if index in on_victim else 0 for index in range(len(seeds))
        ]
        assert recovery.recovered == len(on_victim)
        for env in sessions:
            env.close()
    victim.proc.send_signal(signal.SIGCONT)
    survivor = next(server for server in nodes if server is not victim)
    undisturbed: list[Trajectory] = []
    for seed in seeds:
        with EchoEnv(survivor.target) as env:
            env.reset(seed=seed, options=EchoResetOptions(max_steps=50))
            undisturbed.append([_step(env, message) for message in MESSAGES])
    # The pid probe was each session's first step: the episode's counts are one ahead.
    assert trajectories == [
        [(reward, count + 1, done) for reward, count, done in run] for run in undisturbed
    ]
