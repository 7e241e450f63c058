"""Echo's snapshot in-process: restore on a fresh instance continues exactly, and a
malformed snapshot is refused with the episode unchanged."""

from __future__ import annotations

import json
import re

import pytest

from openenv_grpc import InvalidAction, Transition
from openenv_grpc_envs.echo import EchoAction, EchoEnvironment, EchoObservation, EchoResetOptions
from openenv_grpc_envs.echo.environment import HISTORY, MAX_MESSAGE_CHARS


def play(env: EchoEnvironment, messages: list[str]) -> list[tuple[bytes, float, bool, bool]]:
    """Each step's observation bytes, reward and flags."""
    results: list[Transition[EchoObservation]] = [env.step(EchoAction(message=m)) for m in messages]
    return [
        (r.observation.SerializeToString(), r.reward, r.terminated, r.truncated) for r in results
    ]


def started() -> EchoEnvironment:
    env = EchoEnvironment()
    env.reset(seed=7, episode_id="e", options=EchoResetOptions(max_steps=6, stop_word="halt"))
    play(env, ["one", "two", "three"])
    return env


def test_restore_on_a_fresh_instance_continues_exactly() -> None:
    original = started()
    snapshot = original.snapshot()
    later = ["four", "halt", "x"]
    expected, expected_state = play(original, later), original.state()

    fresh = EchoEnvironment()  # never reset
    fresh.restore(snapshot)
    assert play(fresh, later) == expected
    assert fresh.state() == expected_state
    assert expected[1][2]  # the stop word still terminates: the options came back


def test_restore_truncates_at_the_recorded_step_limit() -> None:
    original = started()
    fresh = EchoEnvironment()
    fresh.restore(original.snapshot())
    flags = [r[3] for r in play(fresh, ["a", "b", "c"])]
    assert flags == [False, False, True]  # steps 4, 5, 6 of max_steps=6


def test_history_tool_sees_the_restored_history() -> None:
    fresh = EchoEnvironment()
    fresh.restore(started().snapshot())
    assert fresh.history(last=2) == ["two", "three"]


def edited(snapshot: bytes, **changes: object) -> bytes:
    """``snapshot``'s JSON body with some fields replaced."""
    return json.dumps({**json.loads(snapshot), **changes}).encode()


@pytest.mark.parametrize(
    ("snapshot", "message"),
    [
        (b"\x80not json", "not a echo/1 body"),
        (b"[1, 2]", "a JSON object was expected"),
        (b'{"format": "wordle/1"}', "layout is 'wordle/1'; this env reads 'echo/1'"),
        (None, "lacks the field steps"),
        ({"steps": -1}, "snapshot field steps is -1, outside 0..inf"),
        ({"steps": True}, "snapshot field steps must be an integer, got bool"),
        ({"history": ["x"] * (HISTORY + 1)}, f"has {HISTORY + 1} items; the limit is {HISTORY}"),
        ({"history": ["x" * (MAX_MESSAGE_CHARS + 1)]}, f"the limit is {MAX_MESSAGE_CHARS}"),
        ({"options": {"max_steps": "many"}}, "is not an EchoResetOptions"),
    ],
)
def test_a_malformed_snapshot_is_refused_and_the_episode_stands(
    snapshot: bytes | dict[str, object] | None, message: str
) -> None:
    good = started().snapshot()
    if snapshot is None:
        body = json.loads(good)
        del body["steps"]
        snapshot = json.dumps(body).encode()
    elif isinstance(snapshot, dict):
        snapshot = edited(good, **snapshot)
    env = started()
    env.step(EchoAction(message="mine"))
    before = env.state()
    with pytest.raises(InvalidAction, match=re.escape(message)):
        env.restore(snapshot)
    assert env.state() == before
