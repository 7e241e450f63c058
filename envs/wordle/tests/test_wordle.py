"""Wordle's rules through a real server and the typed client: turns, feedback, rewards,
options, and every refusal with its gRPC code and message."""

from __future__ import annotations

import random
from collections.abc import Iterator

import grpc
import pytest

from openenv_grpc import Session
from openenv_grpc.client.errors import EnvError
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.wordle import (
    ANSWERS,
    LetterScore,
    WordleAction,
    WordleEnv,
    WordleObservation,
    WordleResetOptions,
    WordleState,
)
from openenv_grpc_envs.wordle.environment import MAX_GUESS_CHARS, marks

G, Y, X = (
    LetterScore.LETTER_SCORE_GREEN,
    LetterScore.LETTER_SCORE_YELLOW,
    LetterScore.LETTER_SCORE_GRAY,
)


# What ``with WordleEnv(...) as env`` binds (Session.__enter__ is not typed as Self).
Wordle = Session[WordleAction, WordleObservation, WordleState, WordleResetOptions]


@pytest.fixture(scope="module")
def wordle() -> Iterator[ServerProcess]:
    """One wordle server for the module; each test opens its own sessions."""
    server = ServerProcess("wordle", ["--max-concurrent-envs", "0"])
    yield server
    server.stop()


@pytest.fixture
def env(wordle: ServerProcess) -> Iterator[Wordle]:
    with WordleEnv(wordle.target) as session:
        yield session


def guess(env: Wordle, word: str) -> tuple[str, float, bool]:
    """Step one guess; its marks, reward and terminated flag."""
    result = env.step(WordleAction(guess=word))
    assert not result.truncated  # wordle never truncates
    return marks(result.observation.guesses[-1].scores), result.reward, result.terminated


def refused(env: Wordle, text: str) -> EnvError:
    with pytest.raises(EnvError) as failed:
        env.step(WordleAction(guess=text))
    return failed.value


# -- reset ----------------------------------------------------------------------------


def test_state_before_the_first_reset(env: Wordle) -> None:
    state = env.state()
    assert state.target == "" and state.turn == 0 and not state.game_over
    assert state.max_turns == 6


def test_reset_observation_has_the_prompt_and_an_empty_board(env: Wordle) -> None:
    result = env.reset(seed=3)
    obs = result.observation
    assert result.reward == 0 and not result.done and result.step_count == 0
    assert obs.prompt.startswith("You are playing Wordle.")
    assert "[crane]" in obs.prompt and "Hard mode" not in obs.prompt
    assert obs.message == "Guess the secret 5-letter word. You have 6 guesses."
    assert obs.board == "(no guesses yet)"
    assert (obs.turn, obs.turns_left, obs.max_turns) == (0, 6, 6)
    assert not obs.won and obs.answer == "" and not obs.guesses
    # The target is hidden from observations, revealed by the state.
    target = env.state().target
    assert target in ANSWERS and target not in obs.SerializeToString().decode("utf-8", "replace")


def test_same_seed_same_target_and_unseeded_resets_continue_the_sequence(
    wordle: ServerProcess,
) -> None:
    rng = random.Random(5)
    expected = [rng.choice(ANSWERS) for _ in range(3)]
    with WordleEnv(wordle.target) as first, WordleEnv(wordle.target) as second:
        first.reset(seed=5)
        second.reset(seed=5)
        assert first.state().target == second.state().target == expected[0]
        assert first.state().seed == 5
        first.reset()
        assert first.state().target == expected[1]
        assert first.state().seed == 0
        first.reset()
        assert first.state().target == expected[2]
        first.reset(seed=5)
        assert first.state().target == expected[0]
        targets = set()
        for seed in range(20):
            first.reset(seed=seed)
            targets.add(first.state().target)
        assert len(targets) > 10


def test_fixed_target_option(env: Wordle) -> None:
    env.reset(seed=1, options=WordleResetOptions(target=" ABIDE ".strip()))
    assert env.state().target == "abide"
    assert guess(env, "abide") == ("GGGGG", 2.0, True)
    # A target outside the lists is allowed and may be guessed without allow_any_word.
    env.reset(options=WordleResetOptions(target="qwxyz"))
    assert guess(env, "crane") == ("XXXXX", 0.0, False)
    assert guess(env, "QWXYZ") == ("GGGGG", 1.9, True)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (WordleResetOptions(target="ab"), "reset option target 'ab' must be 5 letters a-z"),
        (WordleResetOptions(target="cr4ne"), "reset option target 'cr4ne' must be 5 letters a-z"),
        (WordleResetOptions(target="crêpe"), "reset option target 'crêpe' must be 5 letters a-z"),
        (WordleResetOptions(max_turns=101),
         "reset option max_turns is 101; it must be 1 to 100 (0 means 6)"),
    ],
)  # fmt: skip
def test_bad_reset_options_are_refused_and_the_episode_stands(
    env: Wordle, options: WordleResetOptions, message: str
) -> None:
    first = env.reset(options=WordleResetOptions(target="abide"))
    guess(env, "crane")
    with pytest.raises(EnvError) as failed:
        env.reset(seed=9, options=options)
    assert failed.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert failed.value.message == message
    state = env.state()
    assert (state.target, state.turn, state.seed) == ("abide", 1, 0)
    result = env.step(WordleAction(guess="abide"))
    assert result.episode_id == first.episode_id and result.step_count == 2 and result.terminated


# -- playing --------------------------------------------------------------------------


def test_win_in_one(env: Wordle) -> None:
    env.reset(options=WordleResetOptions(target="crane"))
    result = env.step(WordleAction(guess="crane"))
    obs = result.observation
    # Shaping 0.5 (5 letters + 5 greens) + win 1.0 + 0.1 for each of the 5 turns left.
    assert result.reward == 2.0 and result.terminated and not result.truncated
    assert obs.won and obs.answer == "crane" and (obs.turn, obs.turns_left) == (1, 5)
    assert list(obs.guesses[0].scores) == [G] * 5
    assert obs.guesses[0].squares == "🟩🟩🟩🟩🟩"
    assert obs.message == (
        "You guessed [crane].\nC R A N E\nG G G G G\nCorrect! You found the word in 1 guess."
    )
    assert obs.prompt == ""  # the prompt comes with the reset only
    state = env.state()
    assert state.won and state.game_over and state.episode_reward == 2.0
    with pytest.raises(EnvError) as failed:
        env.step(WordleAction(guess="slate"))
    assert failed.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert failed.value.message == "the episode has terminated: call reset to start a new one"


def test_win_later_with_shaped_rewards(env: Wordle) -> None:
    env.reset(options=WordleResetOptions(target="abide"))
    # e and d found (yellow): 2 units of 0.05.
    assert guess(env, "speed") == ("XXYXY", 0.1, False)
    # b found, i found green, d and e turn green: 2 + 3 units.
    assert guess(env, "bride") == ("YXGGG", 0.25, False)
    result = env.step(WordleAction(guess="abide"))
    # a found green, b turns green (0.15) + win 1.0 + 3 turns left x 0.1.
    assert result.reward == 1.45 and result.terminated and result.step_count == 3
    obs = result.observation
    assert obs.board == ("S P E E D\nX X Y X Y\nB R I D E\nY X G G G\nA B I D E\nG G G G G")
    assert [g.word for g in obs.guesses] == ["speed", "bride", "abide"]
    assert list(obs.guesses[0].scores) == [X, X, Y, X, Y]
    assert obs.message.endswith("Correct! You found the word in 3 guesses.")
    state = env.state()
    assert state.episode_reward == 1.8 and state.turn == 3 and state.won


def test_loss_after_six_turns_terminates(env: Wordle) -> None:
    env.reset(options=WordleResetOptions(target="abide"))
    expected = [
        ("crane", "XXYXG", 0.15),  # a, e found; e green
        ("slate", "XXYXG", 0.0),  # nothing new
        ("moist", "XXGXX", 0.1),  # i found green
        ("pouch", "XXXXX", 0.0),
        ("fight", "XYXXX", 0.0),  # i already known
    ]
    for turn, (word, feedback, reward) in enumerate(expected, start=1):
        result = env.step(WordleAction(guess=word))
        obs = result.observation
        assert (marks(obs.guesses[-1].scores), result.reward) == (feedback, reward)
        assert not result.done and obs.answer == "" and obs.turns_left == 6 - turn
        left = 6 - turn
        assert obs.message.endswith(f"You have {left} guess{'es' if left > 1 else ''} left.")
    result = env.step(WordleAction(guess="lymph"))
    obs = result.observation
    assert result.terminated and not result.truncated and result.reward == 0.0
    assert not obs.won and obs.answer == "abide" and obs.turns_left == 0
    assert obs.message == (
        "You guessed [lymph].\nL Y M P H\nX X X X X\nOut of guesses: the word was [abide]."
    )
    state = env.state()
    assert state.game_over and not state.won and state.turn == 6
    assert state.episode_reward == 0.25
    with pytest.raises(EnvError) as failed:
        env.step(WordleAction(guess="abide"))
    assert failed.value.code is grpc.StatusCode.FAILED_PRECONDITION


def test_max_turns_option(env: Wordle) -> None:
    first = env.reset(options=WordleResetOptions(target="abide", max_turns=2))
    assert first.observation.max_turns == 2 and "you have 2 guesses" in first.observation.prompt
    assert guess(env, "crane")[2] is False
    assert guess(env, "slate")[2] is True
    assert env.state().max_turns == 2
    env.reset(options=WordleResetOptions(target="abide", max_turns=1))
    assert guess(env, "abide") == ("GGGGG", 1.5, True)  # no turn left: no speed bonus


def test_repeated_letter_feedback_through_the_server(env: Wordle) -> None:
    env.reset(options=WordleResetOptions(target="there", allow_any_word=True))
    assert guess(env, "eerie")[0] == "YXYXG"
    assert guess(env, "geese")[0] == "XXGXG"  # both target e's are green: gray first e
    env.reset(options=WordleResetOptions(target="crepe"))
    assert guess(env, "speed")[0] == "XYGYX"


def test_sparse_reward_option(env: Wordle) -> None:
    env.reset(options=WordleResetOptions(target="abide", sparse_reward=True))
    assert guess(env, "bride") == ("YXGGG", 0.0, False)
    assert guess(env, "abide") == ("GGGGG", 1.0, True)
    assert env.state().episode_reward == 1.0


def test_llm_text_guesses(env: Wordle) -> None:
    env.reset(options=WordleResetOptions(target="abide"))
    result = env.step(WordleAction(guess="Maybe [slate]... no: my guess is [Crane]."))
    assert result.observation.guesses[-1].word == "crane"
    assert result.observation.message.startswith("You guessed [crane].")


def test_allow_any_word_option(env: Wordle) -> None:
    env.reset(options=WordleResetOptions(target="abide"))
    assert refused(env, "qwert").message == "'qwert' is not in the word list"
    first = env.reset(options=WordleResetOptions(target="abide", allow_any_word=True))
    assert "Any 5 letters a-z" in first.observation.prompt
    assert guess(env, "qwert") == ("XXYXX", 0.05, False)
    assert env.state().allow_any_word


def test_hard_mode(env: Wordle) -> None:
    first = env.reset(options=WordleResetOptions(target="abide", hard_mode=True))
    assert "Hard mode" in first.observation.prompt
    guess(env, "bride")
    error = refused(env, "crane")
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert error.message == "hard mode: letter 3 must be I (revealed green)"
    assert refused(env, "aside").message == (
        "hard mode: the guess must contain B once (revealed in the word)"
    )
    assert env.state().turn == 1 and env.state().hard_mode
    assert guess(env, "abide")[2] is True
    env.reset(options=WordleResetOptions(target="speed", hard_mode=True))
    assert guess(env, "eerie")[0] == "YYXXX"
    assert refused(env, "spend").message == (
        "hard mode: the guess must contain E 2 times (revealed in the word)"
    )
    assert guess(env, "speed")[2] is True


# -- refusals -------------------------------------------------------------------------

TOO_LONG = "x" * (MAX_GUESS_CHARS + 1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty guess: send a 5-letter word, e.g. crane or [crane]"),
        ("   ", "empty guess: send a 5-letter word, e.g. crane or [crane]"),
        ("I think it is crane",
         "no guess found in 'I think it is crane': wrap the guess in square brackets, "
         "e.g. [crane]"),
        ("my guess: []", "empty brackets: write the guess inside them, e.g. [crane]"),
        ("cr4ne", "guess 'cr4ne' must contain only the letters a-z"),
        ("crêpe", "guess 'crêpe' must contain only the letters a-z"),
        ("ab", "guess 'ab' has 2 letters; it must have 5"),
        ("[abides]", "guess 'abides' has 6 letters; it must have 5"),
        ("xyzzy", "'xyzzy' is not in the word list"),
        ("crane", "'crane' was already guessed on turn 1"),
        ("[CRANE]", "'crane' was already guessed on turn 1"),
        (TOO_LONG, f"the guess text has {MAX_GUESS_CHARS + 1} characters; the limit is "
         f"{MAX_GUESS_CHARS}"),
    ],
    ids=lambda v: v[:20] if isinstance(v, str) else None,
)  # fmt: skip
def test_invalid_guess_is_refused_and_uses_no_turn(env: Wordle, text: str, message: str) -> None:
    env.reset(options=WordleResetOptions(target="abide"))
    guess(env, "crane")
    error = refused(env, text)
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert error.message == message
    assert error.exception_type.endswith("InvalidAction")
    state = env.state()
    assert state.turn == 1 and [g.word for g in state.guesses] == ["crane"]
    result = env.step(WordleAction(guess="slate"))
    assert result.step_count == 2 and result.observation.turns_left == 4


def test_refusals_leave_a_neighbouring_session_alone(wordle: ServerProcess) -> None:
    with WordleEnv(wordle.target) as noisy, WordleEnv(wordle.target) as quiet:
        noisy.reset(options=WordleResetOptions(target="abide", hard_mode=True))
        quiet.reset(seed=11, options=WordleResetOptions(target="crane"))
        assert guess(quiet, "slate") == ("XXGXG", 0.2, False)
        noisy.step(WordleAction(guess="bride"))
        for text in ("", "xyzzy", "cr4ne", "bride", "crane", TOO_LONG):
            refused(noisy, text)
        with pytest.raises(EnvError):
            noisy.reset(options=WordleResetOptions(max_turns=1000))
        state = quiet.state()
        assert (state.target, state.turn, state.seed) == ("crane", 1, 11)
        assert [g.word for g in state.guesses] == ["slate"]
        assert guess(quiet, "crane") == ("GGGGG", 1.7, True)
        assert noisy.state().turn == 1
        assert guess(noisy, "abide")[2] is True
