"""Wordle's snapshot in-process: restore on a fresh instance continues exactly (the
generator too), and the guesses are replayed under the rules, never trusted."""

from __future__ import annotations

import json
import re

import pytest

from openenv_grpc import InvalidAction
from openenv_grpc_envs.wordle import WordleAction, WordleEnvironment, WordleResetOptions


def play(env: WordleEnvironment, guesses: list[str]) -> list[tuple[bytes, float, bool]]:
    results = [env.step(WordleAction(guess=g)) for g in guesses]
    return [(r.observation.SerializeToString(), r.reward, r.terminated) for r in results]


def started(target: str = "") -> WordleEnvironment:
    env = WordleEnvironment()
    env.reset(seed=3, episode_id="e", options=WordleResetOptions(target=target, hard_mode=False))
    play(env, ["crane", "sloth"])
    return env


def test_restore_on_a_fresh_instance_continues_exactly() -> None:
    original = started()
    snapshot = original.snapshot()
    target = original.state().target
    later = ["pious", target]
    expected, expected_state = play(original, later), original.state()
    # An unseeded reset continues the generator: the next target comes from its state.
    original.reset(seed=None, episode_id="f", options=None)
    next_target = original.state().target

    fresh = WordleEnvironment()
    fresh.restore(snapshot)
    assert play(fresh, later) == expected
    assert fresh.state() == expected_state
    assert expected[-1][2] and expected_state.won
    fresh.reset(seed=None, episode_id="f", options=None)
    assert fresh.state().target == next_target


def test_hard_mode_constraints_are_replayed() -> None:
    env = WordleEnvironment()
    env.reset(seed=0, episode_id="e", options=WordleResetOptions(target="crane", hard_mode=True))
    env.step(WordleAction(guess="crust"))  # C, R green
    fresh = WordleEnvironment()
    fresh.restore(env.snapshot())
    with pytest.raises(InvalidAction, match="hard mode: letter 1 must be C"):
        fresh.step(WordleAction(guess="sloth"))
    assert fresh.state() == env.state()


def edited(snapshot: bytes, **changes: object) -> bytes:
    """``snapshot``'s JSON body with some fields replaced."""
    return json.dumps({**json.loads(snapshot), **changes}).encode()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"guesses": ["crane", "zzzzz"]}, "turn 2's refused guess: 'zzzzz' is not in the word"),
        ({"guesses": ["crane", "crane"]}, "'crane' was already guessed on turn 1"),
        ({"guesses": ["crane", "abide", "sloth"]}, "go on after the game was won on turn 2"),
        ({"guesses": ["crane"] * 7}, "has 7 items; the limit is 6"),
        ({"target": "ABIDE"}, "'ABIDE' is not 5 letters a-z"),
        ({"target": "sloth"}, "'sloth' is not the options' 'abide'"),
        ({"options": {"maxTurns": 101}}, "max_turns is 101; it must be 1 to 100"),
        ({"rng": {"version": 3, "words": "AAAA", "gauss": None}}, "not a Mersenne Twister state"),
        ({"seed": -1}, "snapshot field seed is -1, outside 0..18446744073709551615"),
    ],
)
def test_a_snapshot_the_rules_refuse_is_refused_and_the_episode_stands(
    changes: dict[str, object], message: str
) -> None:
    good = started("abide").snapshot()
    env = started()
    before = env.state()
    with pytest.raises(InvalidAction, match=re.escape(message)):
        env.restore(edited(good, **changes))
    assert env.state() == before
