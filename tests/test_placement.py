"""Measured placement against real servers: a sync env that leaves ``runs_inline`` unset
runs on the event loop while its calls are cheap and on the thread pool when they are not.

Where a call ran is observed twice: the server's log line (what an operator sees) and the
``thread`` command of ``support.envs:MeasuredEnv``, which answers with the name of the
thread its step ran on (``MainThread`` is the event loop).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from openenv_grpc import EnvError, Session
from openenv_grpc.client.info import fetch_info
from openenv_grpc.server.model.placement import PROBATION, STALL_FACTOR
from openenv_grpc_envs.echo import EchoAction

MEASURED = "support.envs:MeasuredEnv"
ON_LOOP = "env calls faulty.step now run on the event loop"
TO_POOL = "env calls faulty.step move to the thread pool"


def thread_of(env: Session[Any, Any, Any, Any]) -> str:
    """The name of the thread the env's next step runs on."""
    return str(env.step(EchoAction(message="thread")).observation.echoed_message)


def step_until_inline(env: Session[Any, Any, Any, Any], limit: int = 20 * PROBATION) -> int:
    """Step cheaply until a step runs on the event loop; returns the steps it took."""
    for steps in range(1, limit + 1):
        if thread_of(env) == "MainThread":
            return steps
    raise AssertionError(f"still on the thread pool after {limit} cheap steps")


def test_a_cheap_measured_env_moves_to_the_event_loop(start_server) -> None:
    server = start_server(MEASURED)
    with Session(server.target) as env:
        env.reset()
        assert thread_of(env).startswith("openenv-env-")  # it starts on the pool
        assert step_until_inline(env) >= PROBATION - 1
        assert all(thread_of(env) == "MainThread" for _ in range(10))
    line = next(line for line in server.stderr().splitlines() if ON_LOOP in line)
    assert f"{PROBATION} in a row took at most" in line
    assert "(under half of the 1.0 ms threshold)" in line


def test_a_slow_call_moves_it_back_and_the_loop_stays_responsive(
    start_server, tmp_path: Path
) -> None:
    server = start_server(MEASURED)
    with Session(server.target) as env, Session(server.target) as neighbour:
        env.reset()
        neighbour.reset()
        step_until_inline(env)
        # The first slow call runs on the loop and cannot be interrupted: it is what the
        # measurement sees. It blocks the server for its 0.3 s, once.
        env.step(EchoAction(message="sleep:0.3"))
        server.wait_until(lambda: TO_POOL in server.stderr(), what="the move to the pool")
        warning = next(line for line in server.stderr().splitlines() if TO_POOL in line)
        assert " WARNING " in warning
        assert "on the event loop" in warning and "blocking every other session" in warning
        # A stall (0.3 s: over 50 times the threshold) makes the way back 50 times longer.
        assert f"back on the loop after {STALL_FACTOR * PROBATION} calls in a row" in warning
        assert thread_of(env).startswith("openenv-env-")

        # From now on a slow call runs on the pool: while it is blocked in env code, health,
        # Info and the neighbour answer (a blocked loop could not answer any of them).
        gate = tmp_path / "gate"
        slow = threading.Thread(target=env.step, args=(EchoAction(message=f"gate:{gate}"),))
        slow.start()
        server.wait_until(lambda: Path(f"{gate}.entered").exists(), what="the slow step runs")
        with grpc.insecure_channel(server.target) as channel:
            for _ in range(3):
                assert server.health() == health_pb2.HealthCheckResponse.SERVING
                assert fetch_info(channel, timeout=5).env_name == "faulty"
                assert neighbour.step(EchoAction(message="hi")).observation.echoed_message == "hi"
                assert slow.is_alive()  # answered while the slow step was still blocked
        gate.touch()
        slow.join(10)
        assert not slow.is_alive()


def test_a_step_timeout_keeps_measured_calls_on_the_pool(start_server) -> None:
    """Only on the pool can a call past the step timeout be given up on (a guard: moving
    such calls to the loop would break the timeout)."""
    server = start_server(MEASURED, "--step-timeout", "1")
    with Session(server.target) as env:
        env.reset()
        threads = {thread_of(env) for _ in range(3 * PROBATION)}
        assert all(name.startswith("openenv-env-") for name in threads), threads
        with pytest.raises(EnvError) as failed:
            env.step(EchoAction(message="sleep:5"))
        assert failed.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert ON_LOOP not in server.stderr()


def test_each_cost_class_is_placed_apart(start_server, tmp_path: Path) -> None:
    server = start_server(MEASURED)
    with Session(server.target) as fast, Session(server.target) as heavy:
        fast.reset()
        heavy.reset()
        fast.step(EchoAction(message="class:fast"))
        step_until_inline(fast)
        # Another class of the same env starts on the pool; its slow calls stay there and
        # never move the cheap class off the loop.
        heavy.step(EchoAction(message="class:heavy"))
        assert thread_of(heavy).startswith("openenv-env-")
        gate = tmp_path / "gate"
        slow = threading.Thread(target=heavy.step, args=(EchoAction(message=f"gate:{gate}"),))
        slow.start()
        server.wait_until(lambda: Path(f"{gate}.entered").exists(), what="the slow step runs")
        for _ in range(5):  # the cheap class stays on the loop while the heavy one blocks
            assert thread_of(fast) == "MainThread"
            assert slow.is_alive()
        gate.touch()
        slow.join(10)
        assert thread_of(fast) == "MainThread"
    log = server.stderr()
    assert "env calls faulty.step [fast] now run on the event loop" in log
    assert "[heavy] now run" not in log and "move to the thread pool" not in log


def test_threshold_zero_keeps_every_call_on_the_pool(start_server) -> None:
    server = start_server(MEASURED, "--inline-threshold-ms", "0")
    with Session(server.target) as env:
        env.reset()
        threads = {thread_of(env) for _ in range(3 * PROBATION)}
    assert all(name.startswith("openenv-env-") for name in threads), threads
    assert "now run on the event loop" not in server.stderr()


def test_declared_envs_are_not_measured(start_server) -> None:
    """``runs_inline = False`` keeps meaning "never on the loop", however cheap."""
    server = start_server("support.envs:FaultyEnv")
    with Session(server.target) as env:
        env.reset()
        for _ in range(3 * PROBATION):
            env.step(EchoAction(message="hi"))
    assert "now run on the event loop" not in server.stderr()


def test_gymnasium_places_each_env_id_by_measurement(start_server) -> None:
    from openenv_grpc_envs.gymnasium.adapters import RemoteGymnasiumEnv

    server = start_server("gymnasium", extra_env={"GYM_ENV_ID": "CartPole-v1"})
    env = RemoteGymnasiumEnv(server.target, "CartPole-v1")
    try:
        env.reset(seed=0)
        env.action_space.seed(0)
        for _ in range(10 * PROBATION):  # CartPole steps take microseconds
            _, _, terminated, truncated, _ = env.step(env.action_space.sample())
            if terminated or truncated:
                env.reset()
    finally:
        env.close()
    line = "env calls gymnasium.step [CartPole-v1] now run on the event loop"
    assert line in server.stderr()
