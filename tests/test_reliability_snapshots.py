"""Snapshot attacks against a real server (issue 14): forged bytes never reach the env,
and big forgeries do not stall a neighbour. ``python -m bench.attack_snapshots`` measures
the same attacks (docs/reliability.md has its numbers)."""

from __future__ import annotations

import hmac
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from openenv_grpc.client import EnvError
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.echo import EchoAction, EchoEnv, EchoResetOptions

pytestmark = pytest.mark.timeout(90)

TESTS = Path(__file__).resolve().parent
KEYS = {"SNAPSHOT_KEYS": "k1:0123456789abcdef0123456789abcdef"}
REFUSED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    started = ServerProcess("support.envs:SnapshotEchoEnv", [], KEYS, pythonpath=[TESTS])
    yield started
    started.stop()


def forgeries(data: bytes) -> list[bytes]:
    """One-bit flips of every byte, cuts, growths, and the body re-signed under a key of
    the attacker's (named like one the server might hold)."""
    flips = [data[:i] + bytes([data[i] ^ 0x80]) + data[i + 1 :] for i in range(len(data))]
    cuts = [data[:length] for length in range(0, len(data), 3)]
    growths = [data + b"\0" * n for n in (1, 2, 33)]
    key_at, body_at = 6, 6 + data[5]
    signed = data[:5] + b"\x02k2" + data[body_at:-32]
    resigned = signed + hmac.digest(b"a secret of the attacker's own", signed, "sha256")
    assert data[key_at:body_at] == b"k1"
    return [*flips, *cuts, *growths, resigned]


def test_every_forgery_of_a_real_snapshot_is_refused_before_the_env_sees_it(
    server: ServerProcess,
) -> None:
    """The env's restore() would raise on any of these bytes (INTERNAL) and break the
    episode: only refusals made before it -- INVALID_ARGUMENT, FAILED_PRECONDITION --
    leave the episode exactly as it was."""
    with EchoEnv(server.target) as env:
        env.reset(seed=3, options=EchoResetOptions(max_steps=100))
        for message in ("one", "two"):
            env.step(EchoAction(message=message))
        data = env.snapshot()
        state = env.state()
        answers: Counter[grpc.StatusCode] = Counter()
        for forged in forgeries(data):
            with pytest.raises(EnvError) as refused:
                env.restore(forged)
            answers[refused.value.code] += 1
        assert set(answers) <= REFUSED, answers
        assert sum(answers.values()) > len(data)
        assert env.state() == state and env.step_count == 2
        assert env.step(EchoAction(message="three")).step_count == 3


def test_a_neighbour_keeps_stepping_while_big_forgeries_arrive(server: ServerProcess) -> None:
    """A session restoring altered 7.9 MB snapshots back to back (each hashed in full,
    then refused) does not hold up another session: the neighbour's steps are answered
    *while* those restores are being worked on (inside their windows). How long its steps
    take meanwhile is measured in bench.attack_snapshots, not asserted here."""
    with EchoEnv(server.target) as attacker, EchoEnv(server.target) as neighbour:
        attacker.reset(seed=1, options=EchoResetOptions(max_steps=100))
        attacker.step(EchoAction(message="snapshot:big:7900000"))
        altered = bytearray(attacker.snapshot())
        altered[len(altered) // 2] ^= 1
        neighbour.reset(seed=2, options=EchoResetOptions(max_steps=10**6))
        done = threading.Event()
        codes: Counter[grpc.StatusCode] = Counter()
        windows: list[tuple[float, float]] = []

        def attack() -> None:
            for _ in range(8):
                began = time.monotonic()
                try:
                    attacker.restore(bytes(altered))
                except EnvError as error:
                    codes[error.code] += 1
                windows.append((began, time.monotonic()))
            done.set()

        attacking = threading.Thread(target=attack)
        attacking.start()
        answered: list[float] = []
        while not done.is_set():
            neighbour.step(EchoAction(message="hi"))
            answered.append(time.monotonic())
        attacking.join(30)
        assert codes == {grpc.StatusCode.INVALID_ARGUMENT: 8}, codes
        inside = {i for i, (a, b) in enumerate(windows) for t in answered if a < t < b}
        assert len(inside) >= 4, f"neighbour steps inside {len(inside)} of 8 restores"
        assert attacker.step(EchoAction(message="after")).step_count == 2
