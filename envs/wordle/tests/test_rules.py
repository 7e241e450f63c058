"""The game's rules as pure functions: scoring, guess extraction, word lists, rendering."""

from __future__ import annotations

import re

import pytest

from openenv_grpc import InvalidAction
from openenv_grpc_envs.wordle import (
    ALLOWED,
    ANSWERS,
    GuessResult,
    extract_guess,
    render_board,
    score_guess,
)
from openenv_grpc_envs.wordle.environment import MAX_GUESS_CHARS, marks, prompt, squares


@pytest.mark.parametrize(
    ("guess", "target", "expected"),
    [
        ("abide", "abide", "GGGGG"),
        ("crane", "abide", "XXYXG"),
        # One e in the target: only the first unmatched e of the guess is yellow.
        ("speed", "abide", "XXYXY"),
        # Two e's in the target, one green: the other e of the guess takes the other.
        ("speed", "crepe", "XYGYX"),
        # Three e's guessed, two in the target (one green): one yellow, one gray.
        ("eerie", "there", "YXYXG"),
        # A green takes its copy before any earlier yellow could.
        ("geese", "those", "XXXGG"),
        ("eerie", "eerie", "GGGGG"),
        # Three copies guessed, one in the target and misplaced: the first is yellow.
        ("eerie", "ocean", "YXXXX"),
        # Two copies guessed, two in the target, both misplaced: both yellow.
        ("llama", "hello", "YYXXX"),
        # The target's only l is green: the earlier l of the guess is gray.
        ("llama", "plant", "XGGXX"),
        # The target's two l's: one green, one yellow.
        ("hotel", "hello", "GYXYY"),
        ("mamma", "madam", "GGYXY"),
        ("fluff", "affix", "YXXYX"),
        ("zzzzz", "abide", "XXXXX"),
    ],
)
def test_score_guess(guess: str, target: str, expected: str) -> None:
    assert marks(score_guess(guess, target)) == expected


def test_score_guess_never_marks_more_copies_than_the_target_has() -> None:
    for guess in ("speed", "eerie", "geese", "mamma", "fluff", "llama"):
        for target in ANSWERS[::97]:
            scores = score_guess(guess, target)
            for letter in set(guess):
                marked = sum(
                    1
                    for c, s in zip(guess, scores, strict=True)
                    if c == letter and marks([s]) != "X"
                )
                assert marked == min(guess.count(letter), target.count(letter))


@pytest.mark.parametrize(
    ("text", "word"),
    [
        ("crane", "crane"),
        ("  CRANE\n", "crane"),
        ("[crane]", "crane"),
        ("I will guess [Crane].", "crane"),
        ("Candidates: [slate], [crane]. Final answer: [ abide ]", "abide"),
        ("<think>hmm</think> [speed]", "speed"),
    ],
)
def test_extract_guess(text: str, word: str) -> None:
    assert extract_guess(text) == word


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty guess: send a 5-letter word, e.g. crane or [crane]"),
        (" \t", "empty guess: send a 5-letter word, e.g. crane or [crane]"),
        ("my guess is crane", "no guess found in 'my guess is crane': wrap the guess in square "
         "brackets, e.g. [crane]"),
        ("[]", "empty brackets: write the guess inside them, e.g. [crane]"),
        ("cr4ne", "guess 'cr4ne' must contain only the letters a-z"),
        ("[two words]", "guess 'two words' must contain only the letters a-z"),
        ("crêpe", "guess 'crêpe' must contain only the letters a-z"),
        ("ab", "guess 'ab' has 2 letters; it must have 5"),
        ("[toolong]", "guess 'toolong' has 7 letters; it must have 5"),
        ("a" * 30, f"guess {'a' * 24 + '...'!r} has 30 letters; it must have 5"),
        ("x" * (MAX_GUESS_CHARS + 1),
         f"the guess text has {MAX_GUESS_CHARS + 1} characters; the limit is {MAX_GUESS_CHARS}"),
    ],
)  # fmt: skip
def test_extract_guess_refuses(text: str, message: str) -> None:
    with pytest.raises(InvalidAction) as refused:
        extract_guess(text)
    assert str(refused.value) == message


def test_word_lists() -> None:
    five = re.compile(r"[a-z]{5}")
    assert 2000 <= len(ANSWERS) <= 2100
    assert 6500 <= len(ALLOWED) <= 7000
    assert list(ANSWERS) == sorted(set(ANSWERS))
    assert all(five.fullmatch(w) for w in ALLOWED)
    assert set(ANSWERS) <= ALLOWED
    # Common words are answers; inflections, numerals and slang are not (plurals stay
    # allowed as guesses).
    assert {"abide", "crane", "eerie", "speed", "those"} <= set(ANSWERS)
    assert not {"books", "xviii", "gonna", "baked"} & set(ANSWERS)
    assert {"books", "baked"} <= ALLOWED


def test_render_board_and_squares() -> None:
    assert render_board([]) == "(no guesses yet)"
    rows = [GuessResult(word=w, scores=score_guess(w, "abide")) for w in ("speed", "abide")]
    assert render_board(rows) == "S P E E D\nX X Y X Y\nA B I D E\nG G G G G"
    assert squares(score_guess("crane", "abide")) == "⬜⬜🟨⬜🟩"


def test_prompt_mentions_the_options() -> None:
    plain = prompt(6, hard_mode=False, allow_any_word=False)
    assert "you have 6 guesses" in plain and "[crane]" in plain
    assert "Hard mode" not in plain
    assert "English word of 5 letters" in plain
    assert "you have 1 guess to" in prompt(1, hard_mode=False, allow_any_word=False)
    assert "Hard mode" in prompt(6, hard_mode=True, allow_any_word=False)
    assert "Any 5 letters" in prompt(6, hard_mode=False, allow_any_word=True)
