"""OpenSpiel's snapshot in-process: restore on a fresh instance continues exactly (chance
and opponents' generators included), and what does not fit is refused."""

from __future__ import annotations

import json
import random
import re

import pytest

from openenv_grpc import InvalidAction, Transition
from openenv_grpc_envs.openspiel import (
    CONTROL_MODE_ALL_PLAYERS,
    OpenSpielAction,
    OpenSpielObservation,
    OpenSpielResetOptions,
)
from openenv_grpc_envs.openspiel import environment as module
from openenv_grpc_envs.openspiel.environment import OpenSpielEnvironment

Trace = list[tuple[bytes, float, bool, bool]]


def play(
    env: OpenSpielEnvironment, observation: OpenSpielObservation, moves: int, seed: int
) -> tuple[Trace, OpenSpielObservation]:
    """Up to ``moves`` steps of legal actions picked by a seeded generator; the trace and
    the last observation."""
    rng, trace = random.Random(seed), []
    for _ in range(moves):
        if observation.terminal:
            break
        result: Transition[OpenSpielObservation] = env.step(
            OpenSpielAction(id=rng.choice(observation.legal_actions).id)
        )
        observation = result.observation
        trace.append(
            (observation.SerializeToString(), result.reward, result.terminated, result.truncated)
        )
    return trace, observation


def started(
    options: OpenSpielResetOptions, moves: int
) -> tuple[OpenSpielEnvironment, OpenSpielObservation]:
    """An env ``moves`` steps into an episode, and the observation the client holds."""
    env = OpenSpielEnvironment()
    first = env.reset(seed=11, episode_id="e", options=options).observation
    return env, play(env, first, moves, seed=1)[1]


@pytest.mark.parametrize(
    "options",
    [
        OpenSpielResetOptions(game="tic_tac_toe"),  # a random opponent
        OpenSpielResetOptions(game="connect_four", max_steps=6),  # truncation after restore
        OpenSpielResetOptions(game="leduc_poker", agent_player=1),  # chance deals + opponent
        OpenSpielResetOptions(game="backgammon", control=CONTROL_MODE_ALL_PLAYERS),  # dice
        OpenSpielResetOptions(game="goofspiel", params={"num_cards": "5"}),  # made turn-based
        OpenSpielResetOptions(game="2048"),  # a chance node after every move
    ],
    ids=lambda o: o.game,
)
def test_restore_on_a_fresh_instance_continues_exactly(options: OpenSpielResetOptions) -> None:
    original, observation = started(options, moves=3)
    snapshot = original.snapshot()
    last = original.state()
    expected = play(original, observation, moves=40, seed=2)

    fresh = OpenSpielEnvironment()  # never reset
    fresh.restore(snapshot)
    assert fresh.state() == last
    assert play(fresh, observation, moves=40, seed=2) == expected
    assert fresh.state() == original.state()


def test_a_game_whose_state_does_not_deserialize_cannot_snapshot() -> None:
    env = OpenSpielEnvironment()
    env.reset(seed=1, episode_id="e", options=OpenSpielResetOptions(game="negotiation"))
    with pytest.raises(
        NotImplementedError, match=r"negotiation\(\) cannot snapshot: its state does not"
    ):
        env.snapshot()


def test_no_episode_no_snapshot() -> None:
    with pytest.raises(InvalidAction, match="no episode to snapshot: call reset first"):
        OpenSpielEnvironment().snapshot()


def test_restore_obeys_this_servers_allowlist(monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = started(OpenSpielResetOptions(game="tic_tac_toe"), moves=1)[0].snapshot()
    monkeypatch.setattr(module, "ALLOWED_GAMES", frozenset({"catch"}))
    with pytest.raises(InvalidAction, match="game 'tic_tac_toe' is not played on this server"):
        OpenSpielEnvironment().restore(snapshot)


def edited(snapshot: bytes, **changes: object) -> bytes:
    """``snapshot``'s JSON body with some fields replaced."""
    return json.dumps({**json.loads(snapshot), **changes}).encode()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"game": "no_such_game"}, "unknown game 'no_such_game'"),
        ({"params": {"rows": 3}}, "cannot load game 'tic_tac_toe'"),
        ({"description": "tic_tac_toe(x=1)"}, "'tic_tac_toe(x=1)' differs from tic_tac_toe()"),
        ({"agent": 2}, "snapshot field agent is 2, outside 0..1"),
        ({"control": 9}, "snapshot field control is 9, not a control mode"),
        ({"state": "4\n4\n"}, "snapshot field state is not a state of tic_tac_toe()"),
        ({"state": "4\n"}, "snapshot field state waits for player 1, not the client"),
        ({"chance_rng": {"version": 2, "words": "", "gauss": None}}, "not a Mersenne Twister"),
    ],
)
def test_a_malformed_snapshot_is_refused_and_the_episode_stands(
    changes: dict[str, object], message: str
) -> None:
    good = started(OpenSpielResetOptions(game="tic_tac_toe"), moves=1)[0].snapshot()
    env = started(OpenSpielResetOptions(game="catch"), moves=2)[0]
    before = env.state()
    with pytest.raises(InvalidAction, match=re.escape(message)):
        env.restore(edited(good, **changes))
    assert env.state() == before
