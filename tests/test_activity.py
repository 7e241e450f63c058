"""The Info RPC's activity counters: steps, sessions opened and refused, uptime — in the
plain, Prometheus-enabled and isolated modes alike (the console reads them for its live
steps/s)."""

from __future__ import annotations

import pytest

from openenv_grpc import CapacityError, EnvError, fetch_info
from openenv_grpc_envs.echo import EchoAction, EchoEnv

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
