"""Environment failures and episode ends, as the typed client sees them.

FaultyEnv (a pooled sync env) misbehaves on command; the echo env ends episodes through
its reset options. Every failure is an :class:`EnvError` on one request, and the session
goes on as the protocol says: INVALID_ARGUMENT leaves the episode running, INTERNAL from
reset/step needs a reset, FAILED_PRECONDITION until the client resets.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from openenv_grpc import EnvError
from openenv_grpc_envs.echo import EchoAction, EchoEnv, EchoObservation, EchoResetOptions

pytestmark = [pytest.mark.timeout(20), pytest.mark.shared_server]

OBSERVATION = "openenv_grpc_envs.echo.v1.EchoObservation"
INVALID_ACTION = "openenv_grpc.environment.InvalidAction"


@pytest.fixture
def faulty(start_server):  # type: ignore[no-untyped-def]
    return start_server("support.envs:FaultyEnv")


def act(message: str) -> EchoAction:
    return EchoAction(message=message)


def failed_step(env: EchoEnv, message: str) -> EnvError:
    with pytest.raises(EnvError) as raised:
        env.step(act(message))
    return raised.value


def assert_all_closed(server) -> None:  # type: ignore[no-untyped-def]
    server.wait_until(lambda: server.active() == 0, what="no active session")
    server.wait_until(lambda: server.created() == server.closed_envs(), what="envs closed")


# -- FaultyEnv ------------------------------------------------------------------------


def test_raising_step_is_internal_then_failed_precondition_until_reset(faulty) -> None:
    with EchoEnv(faulty.target) as env:
        first = env.reset(episode_id="ep-a")
        assert first.observation.echoed_message == "episode ep-a"
        assert env.step(act("fine")).step_count == 1
        error = failed_step(env, "raise")
        assert error.code is grpc.StatusCode.INTERNAL
        assert error.message == "step failed: RuntimeError: boom in step"
        assert error.exception_type == "builtins.RuntimeError"
        for _ in range(2):  # refused until a reset, however often it is asked
            error = failed_step(env, "fine")
            assert error.code is grpc.StatusCode.FAILED_PRECONDITION
            assert error.message == "the environment failed during this episode: call reset"
            assert error.exception_type == ""
        again = env.reset(episode_id="ep-b")
        assert (again.episode_id, again.step_count) == ("ep-b", 0)
        result = env.step(act("resumed"))
        assert result.observation.echoed_message == "resumed"
        assert (result.episode_id, result.step_count) == ("ep-b", 1)
    assert_all_closed(faulty)


def test_invalid_action_is_invalid_argument_and_episode_continues(faulty) -> None:
    with EchoEnv(faulty.target) as env:
        env.reset(episode_id="ep")
        assert env.step(act("one")).step_count == 1
        error = failed_step(env, "invalid")
        assert error.code is grpc.StatusCode.INVALID_ARGUMENT
        assert error.message == "that move is not allowed here"
        assert error.exception_type == INVALID_ACTION
        # No reset needed, and the refused action did not count as a step.
        result = env.step(act("two"))
        assert result.observation.echoed_message == "two"
        assert (result.episode_id, result.step_count) == ("ep", 2)
    assert_all_closed(faulty)


@pytest.mark.parametrize(
    ("command", "message"),
    [
        ("wrong-type", f"environment returned a EchoState observation, declared {OBSERVATION}"),
        ("not-transition", "environment returned a EchoObservation, not a Transition"),
    ],
    ids=["wrong-type", "not-transition"],
)
def test_wrong_return_value_is_internal(faulty, command: str, message: str) -> None:
    with EchoEnv(faulty.target) as env:
        env.reset()
        error = failed_step(env, command)
        assert error.code is grpc.StatusCode.INTERNAL
        assert error.message == message
        # The episode is broken like after a raise: reset, then it works again.
        assert failed_step(env, "x").code is grpc.StatusCode.FAILED_PRECONDITION
        env.reset()
        assert env.step(act("ok")).observation.echoed_message == "ok"
    assert_all_closed(faulty)


def test_raising_state_is_internal_and_session_still_steps(faulty) -> None:
    with EchoEnv(faulty.target) as env:
        env.reset(episode_id="ep")
        env.state()  # fine before it breaks
        assert env.step(act("break-state")).step_count == 1
        with pytest.raises(EnvError) as raised:
            env.state()
        error = raised.value
        assert error.code is grpc.StatusCode.INTERNAL
        assert error.message == "state failed: ValueError: state is unavailable"
        assert error.exception_type == "builtins.ValueError"
        # A failing state() does not break the episode.
        result = env.step(act("still here"))
        assert result.observation.echoed_message == "still here"
        assert (result.episode_id, result.step_count) == ("ep", 2)
    assert_all_closed(faulty)


def test_info_map_arrives_in_result_info(faulty) -> None:
    with EchoEnv(faulty.target) as env:
        assert env.reset().info == {}
        result = env.step(act("info"))
        assert result.observation.echoed_message == "info"
        info = result.info
        assert set(info) == {"lives", "name", "nested", "obj"}
        assert info["lives"] == 3
        assert info["name"] == "x"
        assert info["nested"] == {"a": [1, 2]}  # nested values survive
        # A value JSON cannot hold arrives as a string, not as a failed step.
        assert isinstance(info["obj"], str)
        assert info["obj"].startswith("<object object at ")
        assert env.step(act("plain")).info == {}
    assert_all_closed(faulty)


def test_slow_step_does_not_stall_another_session(faulty) -> None:
    finished: list[str] = []
    slow_result: list[object] = []
    with EchoEnv(faulty.target) as slow, EchoEnv(faulty.target) as fast:
        slow.reset()
        fast.reset()

        def run_slow() -> None:
            slow_result.append(slow.step(act("sleep:2")))
            finished.append("slow")

        thread = threading.Thread(target=run_slow, daemon=True)
        thread.start()
        # Let the slow step reach its env; then the other session does 20 steps.
        thread.join(0.3)
        assert finished == []
        for i in range(1, 21):
            result = fast.step(act(f"fast {i}"))
            assert result.observation.echoed_message == f"fast {i}"
            assert result.step_count == i
        finished.append("fast")
        thread.join(10)
        assert not thread.is_alive()
        # The other session finished all its steps while the slow step was still running.
        assert finished == ["fast", "slow"]
        assert slow_result[0].observation.echoed_message == "sleep:2"  # type: ignore[attr-defined]
        assert slow.step(act("after")).step_count == 2
    assert_all_closed(faulty)


# -- echo env episode ends ------------------------------------------------------------


def test_echo_stop_word_terminates(server) -> None:
    with EchoEnv(server.target) as env:
        env.reset(options=EchoResetOptions(stop_word="stop"))
        result = env.step(act("go"))
        assert (result.terminated, result.truncated, result.done) == (False, False, False)
        result = env.step(act("stop"))
        assert result.observation.echoed_message == "stop"
        assert (result.terminated, result.truncated, result.done) == (True, False, True)
        assert result.step_count == 2


def test_echo_max_steps_truncates(server) -> None:
    with EchoEnv(server.target) as env:
        env.reset(options=EchoResetOptions(max_steps=3))
        for i in (1, 2):
            result = env.step(act(f"m{i}"))
            assert not result.done and result.step_count == i
        result = env.step(act("m3"))
        assert (result.terminated, result.truncated, result.done) == (False, True, True)
        assert result.step_count == 3


@pytest.mark.parametrize(
    ("options", "last", "reason"),
    [
        (EchoResetOptions(stop_word="bye"), "bye", "the episode has terminated"),
        (EchoResetOptions(max_steps=1), "any", "the episode was truncated"),
    ],
    ids=["terminated", "truncated"],
)
def test_echo_step_after_episode_end_is_failed_precondition_until_reset(
    server, options: EchoResetOptions, last: str, reason: str
) -> None:
    with EchoEnv(server.target) as env:
        first = env.reset(options=options)
        assert env.step(act(last)).done
        for _ in range(2):
            error = failed_step(env, "more")
            assert error.code is grpc.StatusCode.FAILED_PRECONDITION
            assert error.message == f"{reason}: call reset to start a new one"
        # A reset on the same session starts a fresh episode.
        fresh = env.reset()
        assert fresh.step_count == 0
        assert fresh.episode_id and fresh.episode_id != first.episode_id
        assert (fresh.terminated, fresh.truncated, fresh.reward) == (False, False, 0.0)
        assert fresh.observation.echoed_message == "ready"
        result = env.step(act(last))
        assert (result.step_count, result.done) == (1, False)  # old options are gone
        assert result.episode_id == fresh.episode_id
        assert list(env.state().history) == [last]
    server.wait_until(lambda: server.closed_envs() == 1, what="env closed")


def test_echo_message_over_64k_chars_is_invalid_argument(server) -> None:
    limit = 64 * 1024
    with EchoEnv(server.target) as env:
        env.reset()
        assert env.step(act("a")).step_count == 1
        for too_long in ("x" * (limit + 1), "é" * (limit + 1)):
            error = failed_step(env, too_long)
            assert error.code is grpc.StatusCode.INVALID_ARGUMENT
            assert error.message == f"message has {limit + 1} characters; the limit is {limit}"
            assert error.exception_type == INVALID_ACTION
        # The limit counts characters, not bytes, and is inclusive; the episode went on.
        result = env.step(act("é" * limit))
        assert isinstance(result.observation, EchoObservation)
        assert result.observation.message_length == limit
        assert result.step_count == 2
        assert env.state().total_length == 1 + limit
    server.wait_until(lambda: server.closed_envs() == 1, what="env closed")
