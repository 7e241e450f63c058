"""A close command whose env's ``close()`` hangs past ``--lifecycle-timeout`` (in process)
is answered DEADLINE_EXCEEDED and ends the stream, as with ``--isolated`` (there past the
step timeout): the client learns its env was given up on, not that it closed. The env
keeps its slot until its close returns; then everything is freed once."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from openenv_grpc import EnvError, VectorSession
from openenv_grpc_envs.echo import EchoAction, EchoEnv

pytestmark = pytest.mark.timeout(60)

ABANDONED = (
    "close did not finish within 1s (--lifecycle-timeout); the environment was abandoned "
    "and its slot is freed when its close returns"
)


def _gate_entered(gate: Path) -> int:
    return len(list(gate.parent.glob(f"{gate.name}.*.entered")))


def test_a_sessions_hung_close_is_deadline_exceeded(start_server, tmp_path: Path) -> None:
    server = start_server(
        "support.lifecycle_envs:GatedCloseEnv", "--lifecycle-timeout", "1",
        "--max-concurrent-envs", "1",
    )  # fmt: skip
    gate = tmp_path / "gate"
    env = EchoEnv(server.target)
    env.open()
    env.reset()
    env.step(EchoAction(message=f"gate-close:{gate}"))
    with pytest.raises(EnvError) as failed:
        env.close()
    assert failed.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert failed.value.message == ABANDONED
    assert _gate_entered(gate) == 1
    # The hung env still holds its slot; once its close returns, the slot is free.
    assert server.active() == 1
    gate.touch()
    server.wait_until(lambda: server.active() == 0 and server.closed_envs() == 1, 30)
    with EchoEnv(server.target) as again:
        again.reset()
    server.wait_until(lambda: server.active() == 0 and server.closed_envs() == 2, 30)


def test_a_vectors_hung_close_is_deadline_exceeded(start_server, tmp_path: Path) -> None:
    server = start_server("support.lifecycle_envs:GatedCloseEnv", "--lifecycle-timeout", "1")
    gate = tmp_path / "gate"
    envs = VectorSession(server.target, 3)
    envs.open()
    envs.reset()
    envs.step([EchoAction(message=f"gate-close:{gate}"), EchoAction(), EchoAction()])
    with pytest.raises(EnvError) as failed:
        envs.close()
    assert failed.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert failed.value.message == ABANDONED
    assert server.active() == 3
    gate.touch()
    server.wait_until(lambda: server.active() == 0 and server.closed_envs() == 3, 30)


def test_a_client_that_ends_with_a_hung_close_is_not_told(start_server, tmp_path: Path) -> None:
    """A cancelled stream has no one to answer: its hung close is only abandoned."""
    server = start_server("support.lifecycle_envs:GatedCloseEnv", "--lifecycle-timeout", "1")
    gate = tmp_path / "gate"
    env = EchoEnv(server.target)
    env.open()
    env.reset()
    env.step(EchoAction(message=f"gate-close:{gate}"))
    env.abort()
    server.wait_until(lambda: "close() did not return within 1s: abandoned" in server.stderr(), 30)
    assert "environment close() raised" not in server.stderr()
    gate.touch()
    server.wait_until(lambda: server.active() == 0 and server.closed_envs() == 1, 30)


def test_an_async_envs_hung_close_is_cancelled_and_deadline_exceeded(start_server) -> None:
    server = start_server(
        "support.exiting_envs:HangingCloseAsyncEnv", "--lifecycle-timeout", "1",
        "--max-concurrent-envs", "1",
    )  # fmt: skip
    env = EchoEnv(server.target)
    env.open()
    env.reset()
    env.step(EchoAction(message="hang-close"))
    with pytest.raises(EnvError) as failed:
        env.close()
    assert failed.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert failed.value.message == (
        "close did not finish within 1s (--lifecycle-timeout); it was cancelled"
    )
    # Cancelled, not left running: nothing holds the slot.
    server.wait_until(lambda: Path(f"{server.ledger}.cancelled").exists(), 10, "the cancel")
    server.wait_until(lambda: server.active() == 0, 10, "the slot freed")
    with EchoEnv(server.target) as again:
        again.reset()


def test_an_abandoned_async_envs_hung_close_is_cancelled_and_frees_its_slot(start_server) -> None:
    """A step past its timeout abandons the env; its close, in the background, is
    cancelled at the lifecycle timeout like an awaited one (it held the slot for ever)."""
    server = start_server(
        "support.exiting_envs:HangingCloseAsyncEnv", "--lifecycle-timeout", "1",
        "--step-timeout", "0.5",
    )  # fmt: skip
    env = EchoEnv(server.target)
    env.open()
    env.reset()
    with pytest.raises(EnvError) as failed:
        env.step(EchoAction(message="hang-step"))
    assert failed.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    env.close()
    server.wait_until(lambda: Path(f"{server.ledger}.cancelled").exists(), 10, "the cancel")
    server.wait_until(lambda: server.active() == 0, 10, "the slot freed")
    log = server.stderr()
    assert "an environment's async close() did not return within 1s: cancelled" in log
    assert "closing an abandoned environment raised" not in log  # it raised nothing


def test_a_vector_of_async_envs_whose_close_hangs_is_deadline_exceeded(start_server) -> None:
    server = start_server("support.exiting_envs:HangingCloseAsyncEnv", "--lifecycle-timeout", "1")
    envs = VectorSession(server.target, 2)
    envs.open()
    envs.reset()
    envs.step([EchoAction(message="hang-close"), EchoAction(message="x")])
    with pytest.raises(EnvError) as failed:
        envs.close()
    assert failed.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    server.wait_until(lambda: server.active() == 0, 10, "the slots freed")
    # The envs close at once: the hung one held back no other (it was cancelled).
    assert server.closed_envs() == 1 and Path(f"{server.ledger}.cancelled").exists()


def test_hung_closes_are_a_metric_until_they_return(start_server, tmp_path: Path) -> None:
    """``openenv_env_closes_hung`` counts the closes given up on that still hold their
    threads and slots: 1 while the close hangs, 0 once it has returned."""
    from support.metrics import samples

    def hung() -> float:
        return next(s.value for s in samples(server) if s.name == "openenv_env_closes_hung")

    server = start_server(
        "support.lifecycle_envs:GatedCloseEnv", "--lifecycle-timeout", "1", "--metrics-port", "0"
    )
    gate = tmp_path / "gate"
    assert hung() == 0
    env = EchoEnv(server.target)
    env.open()
    env.reset()
    env.step(EchoAction(message=f"gate-close:{gate}"))
    with pytest.raises(EnvError):
        env.close()
    assert hung() == 1
    gate.touch()
    server.wait_until(lambda: hung() == 0 and server.active() == 0, 30)
