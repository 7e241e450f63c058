"""The openspiel environment's rules and errors, through a real server and the typed client."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pyspiel  # type: ignore[import-not-found]
import pytest

from openenv_grpc import EnvError, Session
from openenv_grpc.client.outcome import StepOutcome
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.openspiel import (
    CONTROL_MODE_ALL_PLAYERS,
    OpenSpielAction,
    OpenSpielEnv,
    OpenSpielObservation,
    OpenSpielResetOptions,
    OpenSpielState,
    to_numpy,
)

TIC_TAC_TOE_LEGAL = (
    "0=x(0,0), 1=x(0,1), 2=x(0,2), 3=x(1,0), 4=x(1,1), 5=x(1,2), 6=x(2,0), 7=x(2,1), 8=x(2,2)"
)
Result = StepOutcome[OpenSpielObservation]
#: What ``with OpenSpielEnv(...) as env`` binds (Session.__enter__ is not typed as Self).
Env = Session[OpenSpielAction, OpenSpielObservation, OpenSpielState, OpenSpielResetOptions]


@pytest.fixture(scope="module")
def target() -> Iterator[str]:
    """One server for the module: every test opens its own sessions on it."""
    server = ServerProcess("openspiel")
    yield server.target
    server.stop()


@pytest.fixture
def env(target: str) -> Iterator[Env]:
    with OpenSpielEnv(target) as session:
        yield session


def options(game: str = "", **kwargs: Any) -> OpenSpielResetOptions:
    return OpenSpielResetOptions(game=game, **kwargs)


def act(env: Env, action_id: int) -> Result:
    return env.step(OpenSpielAction(id=action_id))


def refused(call: Callable[[], object]) -> EnvError:
    """The in-band error ``call`` raised."""
    with pytest.raises(EnvError) as failed:
        call()
    return failed.value


def replay(game: str, history: list[int]) -> Any:
    """The pyspiel state reached by ``history`` in a locally loaded ``game``."""
    state = pyspiel.load_game(game).new_initial_state()
    for action in history:
        state.apply_action(action)
    return state


# -- catch: one player, a chance node, parameters --------------------------------------


def test_catch_played_to_completion_with_parameters(env: Env) -> None:
    result = env.reset(seed=11, options=options("catch", params={"rows": "5", "columns": "3"}))
    assert env.state().game == "catch(columns=3,rows=5)"
    rewards = []
    while not result.done:
        board = to_numpy(result.observation.observation_tensor)
        assert board.shape == (5, 3)
        ball, paddle = board[:-1].sum(axis=0).argmax(), board[-1].argmax()
        name = "STAY" if ball == paddle else ("LEFT" if ball < paddle else "RIGHT")
        assert [a.name for a in result.observation.legal_actions] == ["LEFT", "STAY", "RIGHT"]
        result = env.step(OpenSpielAction(name=name))
        rewards.append(result.reward)
    # The ball falls one row per step: rows - 1 steps, rewarded only when caught.
    assert result.terminated and not result.truncated
    assert result.step_count == 4 and rewards == [0.0, 0.0, 0.0, 1.0]
    observation = result.observation
    assert observation.terminal and observation.current_player == -4
    assert list(observation.returns) == [1.0] and list(observation.rewards) == [1.0]
    assert list(observation.legal_actions) == []
    state = env.state()
    assert state.terminal and state.current_player == -4 and list(state.returns) == [1.0]
    assert len(state.history) == 5  # the ball's column (chance), then 4 paddle moves
    assert state.seed == 11


def test_game_string_and_params_map_combine(env: Env) -> None:
    result = env.reset(seed=1, options=options("catch(rows=4,columns=2)", params={"rows": "6"}))
    assert env.state().game == "catch(columns=2,rows=6)"
    assert to_numpy(result.observation.observation_tensor).shape == (6, 2)


def test_parameters_of_every_type_are_parsed(env: Env) -> None:
    env.reset(
        seed=1,
        options=options(
            "connect_four",
            params={"rows": "5", "egocentric_obs_tensor": "true"},
        ),
    )
    assert env.state().game == "connect_four(egocentric_obs_tensor=True,rows=5)"
    goofspiel = {"num_cards": "4", "points_order": "descending"}
    env.reset(seed=1, options=options("goofspiel", params=goofspiel))
    assert "num_cards=4" in env.state().game and "points_order=descending" in env.state().game
    # A nested game parameter takes a game string.
    env.reset(
        seed=1,
        options=options("turn_based_simultaneous_game", params={"game": "matrix_rps()"}),
    )
    assert env.state().game == "turn_based_simultaneous_game(game=matrix_rps())"


@pytest.mark.parametrize(
    ("reset_options", "message"),
    [
        (
            options("catch", params={"rowz": "3"}),
            "unknown parameter 'rowz' for catch; its parameters are: columns (default 5), "
            "rows (default 10)",
        ),
        (
            options("catch", params={"rows": "three"}),
            "parameter 'rows' of catch must be an integer, got 'three'",
        ),
        (
            options("connect_four", params={"egocentric_obs_tensor": "maybe"}),
            "parameter 'egocentric_obs_tensor' of connect_four must be a boolean (true/false), "
            "got 'maybe'",
        ),
        (
            options("catch(rows=5"),
            "cannot parse game string 'catch(rows=5': Missing closing bracket ')'.",
        ),
        (
            options("catch", params={"rows": "0"}),
            "catch(rows=0) is degenerate: its tensor shape [0, 5] has an empty dimension",
        ),
        (
            options("catch", params={"rows": "2000", "columns": "2000"}),
            "catch(columns=2000,rows=2000) is too large: a tensor of shape [2000, 2000] has "
            "more than 1048576 elements",
        ),
        (
            options("turn_based_simultaneous_game"),
            "cannot load game 'turn_based_simultaneous_game' with {}: Missing parameter game",
        ),
        (
            options("mfg_garnet"),
            "mfg_garnet is a mean-field game; only sequential games are supported",
        ),
        (
            options("kuhn_poker", agent_player=2),
            "agent_player 2 is out of range: kuhn_poker() has 2 player(s), 0..1",
        ),
        (
            options("kuhn_poker", control=7),  # an enum value this server does not know
            "unknown control mode 7",
        ),
    ],
)
def test_bad_reset_options_leave_the_episode_standing(
    env: Env, reset_options: OpenSpielResetOptions, message: str
) -> None:
    first = env.reset(seed=2, options=options("tic_tac_toe"))
    act(env, 4)
    history = list(env.state().history)
    error = refused(lambda: env.reset(seed=3, options=reset_options))
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert error.message == message
    assert env.episode_id == first.episode_id
    assert list(env.state().history) == history
    assert act(env, next(a for a in range(9) if a not in history)).step_count == 2


# -- tic-tac-toe: a random opponent, legality ------------------------------------------


def test_default_game_is_tic_tac_toe_against_a_random_player(env: Env) -> None:
    result = env.reset(seed=5)
    observation = result.observation
    assert env.state().game == "tic_tac_toe()"
    assert observation.current_player == 0 and observation.observer == 0
    assert [a.id for a in observation.legal_actions] == list(range(9))
    assert observation.observation_string == "...\n...\n..."
    assert observation.HasField("information_state_string")  # provided, and empty at start
    assert observation.information_state_string == ""
    assert not observation.HasField("information_state_tensor")  # tic_tac_toe has none
    result = act(env, 4)
    # The agent's move and the random reply come back as one step.
    assert len(env.state().history) == 2 and result.observation.current_player == 0
    assert env.state().history[0] == 4


def test_illegal_move_is_refused_and_the_game_goes_on(env: Env) -> None:
    env.reset(seed=5, options=options("tic_tac_toe"))
    result = act(env, 4)
    reply = env.state().history[1]
    error = refused(lambda: act(env, 4))
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    legal = ", ".join(
        f"{a.id}={a.name}" for a in result.observation.legal_actions
    )  # every cell but 4 and the reply
    assert error.message == f"illegal action 4 (x(1,1)) for player 0 now; legal: {legal}"
    assert reply not in {a.id for a in result.observation.legal_actions}
    error = refused(lambda: act(env, reply))
    assert error.message.startswith(f"illegal action {reply} (")
    assert list(env.state().history) == [4, reply]  # nothing moved
    stepped = act(env, result.observation.legal_actions[0].id)
    assert stepped.step_count == 2 and len(env.state().history) == 4


@pytest.mark.parametrize(
    ("action", "message"),
    [
        (
            OpenSpielAction(id=9),
            f"invalid action id 9: tic_tac_toe() has action ids 0..8; legal: {TIC_TAC_TOE_LEGAL}",
        ),
        (
            OpenSpielAction(id=-1),
            f"invalid action id -1: tic_tac_toe() has action ids 0..8; legal: {TIC_TAC_TOE_LEGAL}",
        ),
        (
            OpenSpielAction(name="centre"),
            f"'centre' is not a legal action of player 0 now; legal: {TIC_TAC_TOE_LEGAL}",
        ),
        (
            OpenSpielAction(),
            f"the action sets neither id nor name; legal: {TIC_TAC_TOE_LEGAL}",
        ),
    ],
)
def test_invalid_actions_are_invalid_argument(
    env: Env, action: OpenSpielAction, message: str
) -> None:
    env.reset(seed=1, options=options("tic_tac_toe"))
    error = refused(lambda: env.step(action))
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert error.message == message
    assert act(env, 0).step_count == 1  # the episode went on


def test_long_legal_lists_are_quoted_briefly(env: Env) -> None:
    env.reset(seed=1, options=options("go", params={"board_size": "9"}))
    error = refused(lambda: act(env, 5000))
    assert error.message.startswith("invalid action id 5000: go(board_size=9) has action ids 0..81")
    assert error.message.endswith("11=B c2 (+70 more)")


def test_all_players_mode_hands_every_move_to_the_client(env: Env) -> None:
    reset = options("tic_tac_toe", control=CONTROL_MODE_ALL_PLAYERS, agent_player=1)
    result = env.reset(seed=1, options=reset)
    players = []
    for cell in (0, 3, 1, 4, 2):  # x wins on the top row
        players.append(result.observation.observer)
        assert result.observation.current_player == result.observation.observer
        result = act(env, cell)
    assert players == [0, 1, 0, 1, 0]
    assert list(env.state().history) == [0, 3, 1, 4, 2]
    # The reward is agent_player's (o, player 1), who lost.
    assert result.terminated and result.reward == -1.0
    assert result.observation.observer == 1
    assert list(result.observation.rewards) == [1.0, -1.0]


def test_max_steps_truncates(env: Env) -> None:
    result = env.reset(seed=1, options=options("connect_four", max_steps=2))
    result = act(env, result.observation.legal_actions[0].id)
    assert not result.done
    result = act(env, result.observation.legal_actions[0].id)
    assert result.truncated and not result.terminated and result.step_count == 2
    error = refused(lambda: act(env, 0))
    assert error.code is grpc.StatusCode.FAILED_PRECONDITION


def test_simultaneous_games_are_played_in_turns(env: Env) -> None:
    result = env.reset(seed=4, options=options("matrix_rps"))
    assert "turn_based_simultaneous_game" in env.state().game
    assert [a.name for a in result.observation.legal_actions] == ["Rock", "Paper", "Scissors"]
    result = act(env, 0)
    assert result.terminated and result.reward in (-1.0, 0.0, 1.0)


# -- Kuhn poker: chance nodes, hidden information, seeds -------------------------------


def play_kuhn(target: str, seed: int, agent: int) -> list[tuple[bytes, float]]:
    """A Kuhn poker episode in a fresh session, always betting; what it observed."""
    with OpenSpielEnv(target) as env:
        result = env.reset(seed=seed, options=options("kuhn_poker", agent_player=agent))
        trace = [(result.observation.SerializeToString(deterministic=True), result.reward)]
        while not result.done:
            result = env.step(OpenSpielAction(name="Bet"))
            trace.append((result.observation.SerializeToString(deterministic=True), result.reward))
        return trace


def test_kuhn_poker_repeats_from_its_seed(target: str) -> None:
    first = play_kuhn(target, 42, agent=1)
    assert play_kuhn(target, 42, agent=1) == first
    deals = {play_kuhn(target, seed, agent=0)[0][0] for seed in range(12)}
    assert len(deals) == 3  # the agent's card varies with the seed: J, Q or K


def test_kuhn_poker_hides_the_other_card(env: Env) -> None:
    result = env.reset(seed=9, options=options("kuhn_poker", agent_player=1))
    state = env.state()
    cards = list(state.history[:2])  # two chance deals: player 0's card, then player 1's
    assert len(state.history) == 3  # and player 0's random move, before the agent's turn
    observation = result.observation
    assert observation.observer == 1 and observation.current_player == 1
    # The agent sees its own card and player 0's move, never player 0's card.
    move = "p" if state.history[2] == 0 else "b"
    assert observation.information_state_string == f"{cards[1]}{move}"
    local = replay("kuhn_poker", list(state.history))
    assert state.state_string == str(local)
    tensor = to_numpy(observation.information_state_tensor)
    game = pyspiel.load_game("kuhn_poker")
    assert tensor.shape == tuple(game.information_state_tensor_shape())
    np.testing.assert_array_equal(tensor, np.array(local.information_state_tensor(1), np.float32))
    assert observation.information_state_tensor.dtype == "float32"
    np.testing.assert_array_equal(
        to_numpy(observation.observation_tensor),
        np.array(local.observation_tensor(1), np.float32).reshape(game.observation_tensor_shape()),
    )
    result = env.step(OpenSpielAction(name="Bet"))
    assert result.terminated
    local_returns = replay("kuhn_poker", list(env.state().history)).returns()
    assert list(result.observation.returns) == local_returns
    assert result.reward == local_returns[1]


def test_observation_tensor_decodes_with_frombuffer(env: Env) -> None:
    result = env.reset(seed=3, options=options("connect_four"))
    result = act(env, 3)
    tensor = result.observation.observation_tensor
    decoded = np.frombuffer(tensor.data, dtype=tensor.dtype).reshape(tuple(tensor.shape))
    game = pyspiel.load_game("connect_four")
    assert list(tensor.shape) == game.observation_tensor_shape() == [3, 6, 7]
    local = replay("connect_four", list(env.state().history))
    np.testing.assert_array_equal(decoded.ravel(), np.array(local.observation_tensor(0)))
    assert result.observation.observation_string == local.observation_string(0)


# -- errors elsewhere, neighbours ------------------------------------------------------


def test_unknown_game_is_invalid_argument_naming_it(env: Env) -> None:
    error = refused(lambda: env.reset(seed=1, options=options("tic_tac_to")))
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    count = len(pyspiel.registered_names())
    assert error.message == (
        f"unknown game 'tic_tac_to': not one of the {count} games in "
        "pyspiel.registered_names() (e.g. catch, connect_four, kuhn_poker, leduc_poker, "
        "tic_tac_toe); did you mean tic_tac_toe, ultimate_tic_tac_toe?"
    )
    # Before any episode: still none, and the session works.
    assert env.state().game == ""
    assert env.reset(seed=1, options=options("catch")).step_count == 0


def test_state_before_reset_is_empty(env: Env) -> None:
    state = env.state()
    assert state.game == "" and list(state.history) == [] and state.state_string == ""


def test_errors_spare_a_neighbouring_session(target: str) -> None:
    with OpenSpielEnv(target) as noisy, OpenSpielEnv(target) as quiet:
        quiet_first = quiet.reset(seed=21, options=options("leduc_poker"))
        noisy.reset(seed=21, options=options("tic_tac_toe"))
        for bad in (
            lambda: act(noisy, 99),
            lambda: act(noisy, -5),
            lambda: noisy.step(OpenSpielAction(name="nope")),
            lambda: noisy.reset(options=options("no_such_game")),
            lambda: noisy.reset(options=options("catch", params={"rows": "x"})),
        ):
            assert refused(bad).code is grpc.StatusCode.INVALID_ARGUMENT
        trace = [quiet_first.observation]
        result = quiet_first
        while not result.done:
            result = quiet.step(OpenSpielAction(id=result.observation.legal_actions[-1].id))
            trace.append(result.observation)
        assert act(noisy, 0).step_count == 1  # and the noisy one still plays
    # The quiet session saw exactly what a session alone with the same seed sees.
    with OpenSpielEnv(target) as alone:
        result = alone.reset(seed=21, options=options("leduc_poker"))
        again = [result.observation]
        while not result.done:
            result = alone.step(OpenSpielAction(id=result.observation.legal_actions[-1].id))
            again.append(result.observation)
    assert again == trace


def test_allowlist_refuses_other_games(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("openspiel", extra_env={"OPENSPIEL_GAMES": "catch,kuhn_poker"})
    with OpenSpielEnv(server.target) as env:
        error = refused(lambda: env.reset(seed=1))
        assert error.code is grpc.StatusCode.INVALID_ARGUMENT
        assert error.message == (
            "game 'tic_tac_toe' is not played on this server (OPENSPIEL_GAMES); "
            "allowed: catch, kuhn_poker"
        )
        assert env.reset(seed=1, options=options("kuhn_poker")).step_count == 0
