"""Hung lifecycle calls (issue 19, breaks 4 and 8), on real server processes.

Before: creates and closes shared one lifecycle pool of ``--env-threads`` threads, with
no timeout. Six closes hanging 20 s made a new open wait 19.5 s (29.5 s with
``--env-threads 2``). Now creates and closes have pools of their own and one timeout
(``--lifecycle-timeout``): a hung close never delays an open; a close past the timeout is
abandoned (its daemon thread replaced), and its env -- which still exists -- keeps its
slot of the capacity until the close returns; a create past it fails that open with
DEADLINE_EXCEEDED and leaks nothing. Every assertion is an event (who got in while the
closes hung), never a duration.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from openenv_grpc import CapacityError, OpenEnvError, SessionRefused
from openenv_grpc_envs.echo import EchoAction, EchoEnv


def _entered(gate: Path) -> int:
    return len(list(gate.parent.glob(f"{gate.name}.*.entered")))


def _session_with_a_hung_close(target: str, gate: Path) -> None:
    """Open, step, arm the close gate, and end the session (client close)."""
    env = EchoEnv(target)
    env.open()
    env.reset()
    env.step(EchoAction(message=f"gate-close:{gate}"))
    # The server answers the close once close() returns (or is given up on): don't wait.
    env.abort()


def test_hung_closes_never_delay_an_open(start_server, tmp_path: Path) -> None:
    """Four closes hang on a server of 2 env threads: a fresh session opens, resets and
    steps while all of them still hang (before: it waited behind them)."""
    server = start_server(
        "support.lifecycle_envs:GatedCloseEnv", "--env-threads", "2",
        "--max-concurrent-envs", "8",
    )  # fmt: skip
    gate = tmp_path / "close-gate"
    for _ in range(4):
        _session_with_a_hung_close(server.target, gate)
    # Both close threads are inside a hung close() (the others queue behind them).
    server.wait_until(lambda: _entered(gate) >= 2, 30, "two closes hung")
    assert server.closed_envs() == 0
    fresh = EchoEnv(server.target)
    fresh.open()
    fresh.reset()
    assert fresh.step(EchoAction(message="still here")).step_count == 1
    fresh.abort()  # its close queues behind the hung ones (a close, not an open)
    assert not gate.exists() and server.closed_envs() == 0  # every hung close still hangs
    # The hung envs still exist: each holds its slot until its close returns.
    assert server.active() >= 4
    gate.touch()
    server.wait_until(lambda: server.closed_envs() == 5, 30, "all five envs closed")
    server.wait_until(lambda: server.active() == 0, 10, "every slot freed")
    assert server.open_envs() == 0
    assert "closed twice" not in server.stderr()


def test_a_close_past_the_timeout_is_abandoned_and_keeps_its_slot(
    start_server, tmp_path: Path
) -> None:
    """``--lifecycle-timeout 1``, one close thread, capacity 2: a close that hangs is
    abandoned (logged) and its thread replaced, so the next close runs; its env keeps
    its slot (the third open is refused at capacity) until its close returns."""
    server = start_server(
        "support.lifecycle_envs:GatedCloseEnv", "--env-threads", "1",
        "--max-concurrent-envs", "2", "--lifecycle-timeout", "1",
    )  # fmt: skip
    gate = tmp_path / "close-gate"
    _session_with_a_hung_close(server.target, gate)
    server.wait_until(lambda: _entered(gate) == 1, 30, "the close hung")
    server.wait_until(
        lambda: "close() did not return within 1s: abandoned" in server.stderr(),
        30,
        "the abandoned close logged",
    )
    # Another env is made and closed on the one-thread pools, the hung close aside.
    with EchoEnv(server.target) as second:
        second.reset()
    server.wait_until(lambda: server.closed_envs() == 1, 30, "the second env closed")
    # The abandoned close's env still counts: one slot of two is taken.
    assert server.active() == 1
    held = EchoEnv(server.target)
    held.open()
    with pytest.raises(SessionRefused) as refused:
        EchoEnv(server.target).open()
    assert isinstance(refused.value, CapacityError)
    assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    gate.touch()  # the hung close returns: its slot comes back
    server.wait_until(lambda: server.closed_envs() == 2, 30, "the hung env closed")
    server.wait_until(lambda: server.active() == 1, 10, "its slot freed")
    with EchoEnv(server.target) as third:
        third.reset()
    held.close()
    server.wait_until(lambda: server.active() == 0 and server.open_envs() == 0, 10, "all freed")
    assert "closed twice" not in server.stderr()


def test_a_create_past_the_timeout_fails_its_open_and_leaks_nothing(
    start_server, tmp_path: Path
) -> None:
    """A factory that hangs past ``--lifecycle-timeout 1``: that open is DEADLINE_EXCEEDED
    naming the setting; other opens are made meanwhile on the create pool's replacement
    thread; once the hung factory returns its env is closed and its slot freed."""
    server = start_server(
        "support.lifecycle_envs:GatedFactoryEnv", "--env-threads", "1",
        "--max-concurrent-envs", "2", "--lifecycle-timeout", "1",
    )  # fmt: skip
    hold = Path(f"{server.ledger}.hold-factory")
    gate = Path(f"{server.ledger}.factory-gate")
    hold.touch()
    with pytest.raises(OpenEnvError) as failed:
        EchoEnv(server.target).open()
    assert failed.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert "not made within 1s (--lifecycle-timeout)" in failed.value.message
    assert _entered(gate) == 1 and server.created() == 0
    # The hung factory holds its slot (its env may still be born); the other is free.
    assert server.active() == 1
    hold.unlink()
    with EchoEnv(server.target) as other:
        other.reset()
    gate.touch()  # the hung factory returns: its env is closed at once, its slot freed
    server.wait_until(lambda: server.created() == 2 and server.closed_envs() == 2, 30, "closed")
    server.wait_until(lambda: server.active() == 0 and server.open_envs() == 0, 10, "freed")
    assert "closed twice" not in server.stderr()


def test_drain_with_a_hung_close_exits_within_grace_plus_three(
    start_server, tmp_path: Path
) -> None:
    """Break 8: ``--grace 3``, three held sessions, one env's close() hangs for good. The
    promise: exit 0 within grace + 3 s, every closable env closed, the hung one abandoned
    and reported (before: 6.03-6.04 s in 3 of 3 runs)."""
    grace = 3.0
    server = start_server("support.lifecycle_envs:GatedCloseEnv", "--grace", str(grace))
    gate = tmp_path / "never-opened"
    envs = [EchoEnv(server.target) for _ in range(3)]
    for env in envs:
        env.open()
        env.reset()
    envs[0].step(EchoAction(message=f"gate-close:{gate}"))
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    # The gate is never opened, so the hung close() could return only after its own 120 s:
    # an exit before that means the drain gave up on it. grace + 10 s is a hang guard.
    try:
        code = server.proc.wait(grace + 10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the drain waited for the hung close: still running {grace + 10:g}s on")
    assert code == 0
    elapsed = time.monotonic() - signalled
    # How long it took is printed, not asserted: speed belongs to benchmarks (the
    # documented bound, grace + 3 s, is measured there and in docs/reliability.md).
    print(f"\ndrain with a hung close, --grace {grace:g}: exit 0 after {elapsed:.2f}s")
    assert _entered(gate) == 1  # the close did hang at its gate
    assert server.created() == 3 and server.closed_envs() == 2
    assert "openenv-grpc: drained, 1 environment(s) stuck in env code left unclosed\n" in (
        server.stdout_lines
    )
    for env in envs:
        env.abort()
