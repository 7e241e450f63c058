"""The Info RPC's activity counters: steps, sessions opened and refused, uptime — in the
plain, Prometheus-enabled and isolated modes alike (the console reads them for its live
steps/s)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from openenv_grpc import CapacityError, EnvError, fetch_info
from openenv_grpc_envs.echo import EchoAction, EchoEnv

TESTS = Path(__file__).resolve().parent

MODES = {
    "plain": (),
    "with-prometheus": ("--metrics-port", "0"),
    "isolated": ("--isolated", "1"),
}


@pytest.mark.parametrize("mode", MODES)
def test_info_counts_steps_and_sessions(start_server, mode: str) -> None:
    server = start_server("echo", "--max-concurrent-envs", "2", *MODES[mode])
    before = fetch_info(server.target).activity
    assert (before.steps, before.sessions_opened, before.sessions_refused) == (0, 0, 0)
    with EchoEnv(server.target) as first, EchoEnv(server.target) as second:
        with pytest.raises(CapacityError):
            EchoEnv(server.target).open()
        with pytest.raises(EnvError):  # a step refused before any reset is not counted
            first.step(EchoAction(message="too early"))
        for env in (first, second):
            env.reset()
            for i in range(3):
                env.step(EchoAction(message=str(i)))
        during = fetch_info(server.target).activity
        assert during.sessions_opened == 2  # open sessions count as opened
    server.wait_until(lambda: server.active() == 0, what="sessions released")
    after = fetch_info(server.target).activity
    assert after.steps == 6
    assert after.sessions_opened == 2
    assert after.sessions_refused == 1
    assert after.uptime_seconds > during.uptime_seconds > before.uptime_seconds > 0


HOLDER = """
import sys
sys.path.insert(0, sys.argv[2])
from support.raw_vector import RawVector
from openenv_grpc_envs.echo import EchoAction

stream = RawVector(sys.argv[1], 32)
stream.reset()
print("ready", flush=True)
# Env 0 blocks at the gate (the test opens it after the kill); the others echo.
stream.step([EchoAction(message="gate:" + sys.argv[3])] + [EchoAction(message="x")] * 31)
"""


def test_sessions_opened_never_goes_down_when_a_vector_client_is_killed_mid_step(
    start_server, tmp_path
) -> None:
    """A client holding a 32-env VectorSession stream is SIGKILLed while env 0's step
    hangs: the session ends at once, but its 32 slots stay held until that call returns.
    sessions_opened stays 32 at every reading (it read 64, then 32, when it was counted
    as ended + active)."""
    server = start_server("support.envs:FaultyEnv", "--log-level", "DEBUG")
    gate = tmp_path / "gate"
    client = subprocess.Popen(
        [sys.executable, "-c", HOLDER, server.target, str(TESTS), str(gate)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    readings: list[tuple[int, int]] = []

    def read() -> tuple[int, int]:
        info = server.info()
        readings.append((info.activity.sessions_opened, info.capacity.active_sessions))
        return readings[-1]

    try:
        assert client.stdout is not None
        assert client.stdout.readline().strip() == "ready", client.communicate()[1]
        server.wait_until(lambda: Path(f"{gate}.entered").exists(), what="env 0 at the gate")
        assert read() == (32, 32)
        client.send_signal(signal.SIGKILL)
        assert client.wait(10) == -signal.SIGKILL
        # The session ends (its client is gone) while env 0 still holds the batch's slots.
        server.wait_until(
            lambda: "session ended (cancelled)" in server.stderr(), 10, "the session's end"
        )
        for _ in range(10):
            assert read() == (32, 32)
    finally:
        gate.touch()
        if client.poll() is None:
            client.kill()
            client.wait()
    server.wait_until(lambda: read()[1] == 0, 15, "the batch closed and its slots freed")
    assert server.closed_envs() == 32
    assert {opened for opened, _ in readings} == {32}, readings
    # Counting goes on from there: one more session is one more.
    with EchoEnv(server.target) as env:
        env.reset()
    assert server.info().activity.sessions_opened == 33
