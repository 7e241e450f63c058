"""Recovery over real gRPC: a session with ``recovery=Recovery(...)`` mid-episode, its
server SIGKILLed (or drained, or its env process killed); a second server with the same
key takes over the address or is given as the fallback target. The episode must finish
with the right step counts and exactly the rewards of an undisturbed run with the same
seed and actions, the loop seeing no exception -- one logged warning and a counter.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from openenv_grpc.client import Recovery, SessionLost
from openenv_grpc.client.channel import channel_options
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.echo import AsyncEchoEnv, EchoAction, EchoEnv, EchoResetOptions

pytestmark = pytest.mark.timeout(90)

TESTS = Path(__file__).resolve().parent
SNAP = "support.envs:SnapshotEchoEnv"
NO_SNAPSHOTS = "support.envs:AsyncEchoEnv"
KEYS = {"SNAPSHOT_KEYS": "k1:0123456789abcdef0123456789abcdef"}
MESSAGES = ["alpha", "be", "gamma-ray", "d", "epsilon", "zeta", "eta", "theta-x", "i", "kappa"]
SEED = 11
KILL_AFTER = 5

Trajectory = list[tuple[float, int, bool]]


def serve(env: str = SNAP, *args: str, keys: bool = True) -> ServerProcess:
    return ServerProcess(env, args, KEYS if keys else {}, pythonpath=[TESTS])


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    """Servers a test starts; each is stopped at the end."""
    started: list[ServerProcess] = []
    yield started
    for server in started:
        server.stop()


def undisturbed(target: str, messages: list[str] = MESSAGES) -> Trajectory:
    with EchoEnv(target) as env:
        env.reset(seed=SEED, options=EchoResetOptions(max_steps=50))
        return [_entry(env, message) for message in messages]


def _entry(env: EchoEnv, message: str) -> tuple[float, int, bool]:
    result = env.step(EchoAction(message=message))
    return result.reward, result.step_count, result.done


def kill(server: ServerProcess) -> None:
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(10)


@pytest.mark.fresh_server  # servers of its own, killed and replaced: make test
def test_a_killed_server_is_replaced_at_its_address_and_the_episode_goes_on(
    servers: list[ServerProcess], caplog: pytest.LogCaptureFixture
) -> None:
    first = serve()
    servers.append(first)
    port = first.port
    recovery = Recovery(every=3)
    with EchoEnv(first.target, recovery=recovery) as env:
        start = env.reset(seed=SEED, options=EchoResetOptions(max_steps=50))
        trajectory = [_entry(env, m) for m in MESSAGES[:KILL_AFTER]]
        kill(first)

        def replace() -> None:  # the new server comes up while the client already retries
            time.sleep(0.5)
            servers.append(serve(SNAP, "--port", str(port)))

        replacing = threading.Thread(target=replace)
        replacing.start()
        with caplog.at_level(logging.WARNING, logger="openenv_grpc.client.recovery"):
            trajectory += [_entry(env, m) for m in MESSAGES[KILL_AFTER:]]
        replacing.join()
        assert env.episode_id == start.episode_id
        assert (env.recoveries, recovery.recovered) == (1, 1)
    assert trajectory == undisturbed(servers[-1].target)
    assert [count for _, count, _ in trajectory] == list(range(1, len(MESSAGES) + 1))
    lines = [r.getMessage() for r in caplog.records if "recovered on" in r.getMessage()]
    assert len(lines) == 1 and f"at step {KILL_AFTER}" in lines[0], lines


@pytest.mark.fresh_server  # servers of its own, killed and replaced: make test
@pytest.mark.parametrize("how", ["sigkill", "drain"])
def test_an_async_session_moves_to_the_fallback_target(
    servers: list[ServerProcess], how: str
) -> None:
    first = serve(SNAP, "--grace", "0.5")
    fallback = serve()
    servers += [first, fallback]
    recovery = Recovery(every=4, targets=[fallback.target])

    async def run() -> tuple[Trajectory, int]:
        async with AsyncEchoEnv(first.target, recovery=recovery) as env:
            await env.reset(seed=SEED, options=EchoResetOptions(max_steps=50))
            trajectory = []
            for index, message in enumerate(MESSAGES):
                if index == KILL_AFTER:
                    if how == "sigkill":
                        kill(first)
                    else:  # the drain ends the session once its grace is over
                        first.proc.send_signal(signal.SIGTERM)
                        await asyncio.sleep(1.5)
                result = await env.step(EchoAction(message=message))
                trajectory.append((result.reward, result.step_count, result.done))
            return trajectory, env.recoveries

    trajectory, recoveries = asyncio.run(run())
    assert recoveries == 1
    assert trajectory == undisturbed(fallback.target)
    fallback.wait_until(lambda: fallback.active() == 0, what="the recovered session closed")


@pytest.mark.fresh_server  # servers of its own, killed and replaced: make test
def test_an_isolated_env_process_that_dies_is_recovered_on_the_same_server(
    servers: list[ServerProcess],
) -> None:
    server = serve(SNAP, "--isolated", "1")
    servers.append(server)
    messages = [*MESSAGES[:3], "pid", *MESSAGES[3:]]
    with EchoEnv(server.target, recovery=Recovery(every=2)) as env:
        env.reset(seed=SEED, options=EchoResetOptions(max_steps=50))
        trajectory = [_entry(env, m) for m in messages[:3]]
        pid = int(env.step(EchoAction(message="pid")).observation.echoed_message)
        trajectory.append((0.0, 4, False))
        os.kill(pid, signal.SIGKILL)
        trajectory += [_entry(env, m) for m in messages[4:]]
        assert env.recoveries == 1
    assert trajectory == undisturbed(server.target, messages)


@pytest.mark.fresh_server  # servers of its own, killed and replaced: make test
def test_an_env_without_snapshots_is_recovered_from_its_seeded_reset(
    servers: list[ServerProcess], caplog: pytest.LogCaptureFixture
) -> None:
    first, fallback = serve(NO_SNAPSHOTS), serve(NO_SNAPSHOTS)
    servers += [first, fallback]
    assert not first.info().snapshots.supported
    with (
        caplog.at_level(logging.WARNING, logger="openenv_grpc.client.recovery"),
        EchoEnv(first.target, recovery=Recovery(targets=[fallback.target])) as env,
    ):
        env.reset(seed=SEED)
        trajectory = [_entry(env, m) for m in MESSAGES[:KILL_AFTER]]
        kill(first)
        trajectory += [_entry(env, m) for m in MESSAGES[KILL_AFTER:]]
        assert env.recoveries == 1
    assert "the env has no snapshots" in caplog.text
    assert f"from a seeded reset, {KILL_AFTER} action(s) replayed" in caplog.text
    with EchoEnv(fallback.target) as reference:
        reference.reset(seed=SEED)
        assert trajectory == [_entry(reference, m) for m in MESSAGES]


@pytest.mark.fresh_server  # servers of its own, killed and replaced: make test
def test_what_cannot_be_recovered_is_raised_as_the_loss(servers: list[ServerProcess]) -> None:
    unseeded = serve(NO_SNAPSHOTS)
    servers.append(unseeded)
    with EchoEnv(unseeded.target, recovery=Recovery(within=2.0)) as env:
        env.reset()  # no seed, no snapshots: nothing can bring this episode back
        env.step(EchoAction(message="one"))
        kill(unseeded)
        with pytest.raises(SessionLost, match="not recovered: the episode was not seeded"):
            env.step(EchoAction(message="two"))
    gone = serve()
    servers.append(gone)
    # The session's own channel, with a short reconnect backoff: after the kill its
    # backoff would otherwise grow past the recovery's 1.5 s (1, 1.6, 2.6 s, ...), and
    # the call after the server is back could fall between two reconnects.
    own = grpc.insecure_channel(
        gone.target,
        options=[*channel_options(), ("grpc.initial_reconnect_backoff_ms", 100),
                 ("grpc.min_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 200)],
    )  # fmt: skip
    with own, EchoEnv(own, recovery=Recovery(within=1.5)) as env:
        env.reset(seed=SEED, options=EchoResetOptions(max_steps=50))
        trajectory = [_entry(env, MESSAGES[0])]
        kill(gone)
        started = time.monotonic()
        with pytest.raises(SessionLost, match=r"no server took the episode within 1\.5s"):
            env.step(EchoAction(message=MESSAGES[1]))
        assert time.monotonic() - started < 1.5 + 5.0
        # The session still holds its base: once a server is back, the next call recovers.
        servers.append(serve(SNAP, "--port", str(gone.port)))
        trajectory += [_entry(env, m) for m in MESSAGES[1:]]
        assert env.recoveries == 1
    assert trajectory == undisturbed(servers[-1].target)


@pytest.mark.fresh_server  # servers of its own, killed and replaced: make test
def test_a_fallback_without_the_key_is_passed_over(servers: list[ServerProcess]) -> None:
    first = serve()
    wrong_key = ServerProcess(
        SNAP, [], {"SNAPSHOT_KEYS": "k9:another-key-another-key-1234"}, pythonpath=[TESTS]
    )
    right_key = serve()
    servers += [first, wrong_key, right_key]
    recovery = Recovery(every=1, targets=[wrong_key.target, right_key.target])
    with EchoEnv(first.target, recovery=recovery) as env:
        env.reset(seed=SEED, options=EchoResetOptions(max_steps=50))
        trajectory = [_entry(env, m) for m in MESSAGES[:KILL_AFTER]]
        kill(first)
        trajectory += [_entry(env, m) for m in MESSAGES[KILL_AFTER:]]
    assert trajectory == undisturbed(right_key.target)
    assert wrong_key.active() == 0  # the refused attempt left nothing open there


@pytest.mark.fresh_server  # servers of its own, killed and replaced: make test
def test_a_failed_snapshot_keeps_the_actions_and_the_episode_still_recovers(
    servers: list[ServerProcess], caplog: pytest.LogCaptureFixture
) -> None:
    first, fallback = serve(), serve()
    servers += [first, fallback]
    messages = [*MESSAGES[:2], "snapshot:raise", *MESSAGES[2:]]  # no snapshot succeeds after
    with (
        caplog.at_level(logging.WARNING, logger="openenv_grpc.client.recovery"),
        EchoEnv(first.target, recovery=Recovery(every=1, targets=[fallback.target])) as env,
    ):
        env.reset(seed=SEED, options=EchoResetOptions(max_steps=50))
        trajectory = [_entry(env, m) for m in messages[:7]]
        kill(first)
        trajectory += [_entry(env, m) for m in messages[7:]]
        assert env.recoveries == 1
    assert "recovery: snapshot failed (INTERNAL: snapshot failed: RuntimeError" in caplog.text
    assert "from a snapshot, 5 action(s) replayed" in caplog.text  # the last good one
    assert trajectory == undisturbed(fallback.target, messages)


@pytest.mark.fresh_server  # servers of its own, killed and replaced: make test
def test_a_replay_that_diverges_is_logged_and_goes_on(
    servers: list[ServerProcess], caplog: pytest.LogCaptureFixture
) -> None:
    first, fallback = serve("support.envs:RandomRewardEnv"), serve("support.envs:RandomRewardEnv")
    servers += [first, fallback]
    with (
        caplog.at_level(logging.WARNING, logger="openenv_grpc.client.recovery"),
        EchoEnv(first.target, recovery=Recovery(targets=[fallback.target])) as env,
    ):
        env.reset(seed=SEED)
        for message in MESSAGES[:3]:
            env.step(EchoAction(message=message))
        kill(first)
        assert env.step(EchoAction(message="after")).step_count == 4
    assert "the env is not deterministic; the episode goes on from the replayed state" in (
        caplog.text
    )


@pytest.mark.fresh_server  # servers of its own, killed and replaced: make test
def test_a_replayed_action_refused_elsewhere_is_raised_as_the_loss(
    servers: list[ServerProcess],
) -> None:
    first, strict = serve(NO_SNAPSHOTS), serve("support.envs:StrictAsyncEchoEnv")
    servers += [first, strict]
    with EchoEnv(first.target, recovery=Recovery(targets=[strict.target], within=3)) as env:
        env.reset(seed=SEED)
        env.step(EchoAction(message="alpha"))
        kill(first)
        with pytest.raises(SessionLost, match="not recovered: replayed action 1 was refused"):
            env.step(EchoAction(message="be"))


def test_recovery_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="every must be >= 1"):
        Recovery(every=0)
    with pytest.raises(ValueError, match="within must be > 0"):
        Recovery(within=0)
