"""The wordle environment: find a hidden five-letter word in six guesses.

Rules, reward and text formats are described in this package's README; the pure
functions here (:func:`score_guess`, :func:`extract_guess`, :func:`render_board`) are the
game's rules and are usable without a server.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from importlib import resources

from google.protobuf import json_format

from openenv_grpc import Environment, InvalidAction, Transition
from openenv_grpc_envs import snapshot_body
from openenv_grpc_envs.wordle.v1.wordle_pb2 import (
    GuessResult,
    LetterScore,
    WordleAction,
    WordleObservation,
    WordleResetOptions,
    WordleState,
)

__all__ = [
    "ALLOWED",
    "ANSWERS",
    "DEFAULT_MAX_TURNS",
    "GRAY",
    "GREEN",
    "YELLOW",
    "WordleEnvironment",
    "extract_guess",
    "render_board",
    "score_guess",
]

GREEN = LetterScore.LETTER_SCORE_GREEN
YELLOW = LetterScore.LETTER_SCORE_YELLOW
GRAY = LetterScore.LETTER_SCORE_GRAY

#: Letters in a word.
WORD_LENGTH = 5
#: Turn limit when the reset options give none.
DEFAULT_MAX_TURNS = 6
#: Largest turn limit the reset options may ask for.
MAX_TURNS_LIMIT = 100
#: Longest action text accepted; an LLM's whole reply fits, a hostile client's blob does not.
MAX_GUESS_CHARS = 64 * 1024
#: The layout of this env's snapshots (see :meth:`WordleEnvironment.snapshot`).
SNAPSHOT_LAYOUT = "wordle/1"

# Rewards are counted in integer units of 1/20 and divided once, so that sums are exact.
_UNITS_PER_REWARD = 20
#: Shaping units: one per target letter found (with multiplicity), one per green position.
_WIN_UNITS = 20  # 1.0 for the winning guess
_UNUSED_TURN_UNITS = 2  # + 0.1 per turn left after it

_MARKS = {GREEN: "G", YELLOW: "Y", GRAY: "X"}
_SQUARES = {GREEN: "\N{LARGE GREEN SQUARE}", YELLOW: "\N{LARGE YELLOW SQUARE}", GRAY: "\u2b1c"}
_BRACKETED = re.compile(r"\[([^\[\]]*)\]")


def _load(name: str) -> tuple[str, ...]:
    text = resources.files(__package__).joinpath(name).read_text(encoding="ascii")
    return tuple(text.split())


#: Words a target is drawn from: common English words (SCOWL size 35), sorted.
ANSWERS: tuple[str, ...] = _load("answers.txt")
#: Words accepted as guesses (SCOWL size 70, inflections included); contains ANSWERS.
ALLOWED: frozenset[str] = frozenset(_load("allowed.txt"))


def score_guess(guess: str, target: str) -> list[LetterScore.ValueType]:
    """Score ``guess`` against ``target`` (both lowercase, same length) as Wordle does.

    Greens are marked first. Then, left to right, a letter is yellow while the target
    still has a copy of it not matched by a green or an earlier yellow, and gray after:
    ``speed`` against ``abide`` scores X X Y X Y (one ``e`` in the target, one yellow).
    """
    scores = [GRAY] * len(guess)
    unmatched: Counter[str] = Counter()
    for i, (g, t) in enumerate(zip(guess, target, strict=True)):
        if g == t:
            scores[i] = GREEN
        else:
            unmatched[t] += 1
    for i, g in enumerate(guess):
        if scores[i] != GREEN and unmatched[g] > 0:
            scores[i] = YELLOW
            unmatched[g] -= 1
    return scores


def _quote(text: str, limit: int = 24) -> str:
    """``text`` quoted for an error message, shortened when long."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def extract_guess(text: str) -> str:
    """The lowercase five-letter guess in an action's text.

    The text is either the word itself (any case, surrounding whitespace ignored) or free
    text whose guess is the *last* ``[word]`` in square brackets, so an LLM may think
    aloud about candidates before committing to one.

    Raises:
        InvalidAction: No guess could be found, or it is not five letters a-z.
    """
    if len(text) > MAX_GUESS_CHARS:
        raise InvalidAction(
            f"the guess text has {len(text)} characters; the limit is {MAX_GUESS_CHARS}"
        )
    stripped = text.strip()
    if not stripped:
        raise InvalidAction("empty guess: send a 5-letter word, e.g. crane or [crane]")
    bracketed: list[str] = _BRACKETED.findall(stripped)
    if bracketed:
        candidate = bracketed[-1].strip()
    elif not any(c.isspace() for c in stripped):
        candidate = stripped
    else:
        raise InvalidAction(
            f"no guess found in {_quote(stripped)}: wrap the guess in square brackets, e.g. [crane]"
        )
    if not candidate:
        raise InvalidAction("empty brackets: write the guess inside them, e.g. [crane]")
    if not (candidate.isascii() and candidate.isalpha()):
        raise InvalidAction(f"guess {_quote(candidate)} must contain only the letters a-z")
    if len(candidate) != WORD_LENGTH:
        raise InvalidAction(
            f"guess {_quote(candidate)} has {len(candidate)} letters; it must have {WORD_LENGTH}"
        )
    return candidate.lower()


def marks(scores: Iterable[LetterScore.ValueType]) -> str:
    """Scores as the board's letter marks: G (green), Y (yellow), X (gray)."""
    return "".join(_MARKS[s] for s in scores)


def squares(scores: Iterable[LetterScore.ValueType]) -> str:
    """Scores as Wordle's share squares (🟩 🟨 ⬜)."""
    return "".join(_SQUARES[s] for s in scores)


def _row(result: GuessResult) -> str:
    return " ".join(result.word.upper()) + "\n" + " ".join(marks(result.scores))


def render_board(results: Sequence[GuessResult]) -> str:
    """The board as text: per guess, its spaced capital letters over their marks."""
    if not results:
        return "(no guesses yet)"
    return "\n".join(_row(r) for r in results)


def _checked_options(options: WordleResetOptions) -> str:
    """The options' fixed target (lowercase; "" for none).

    Raises:
        InvalidAction: the target is not five letters or max_turns is over the limit.
    """
    fixed = options.target.lower()
    if options.target and not (len(fixed) == WORD_LENGTH and fixed.isascii() and fixed.isalpha()):
        raise InvalidAction(
            f"reset option target {_quote(options.target)} must be {WORD_LENGTH} letters a-z"
        )
    if options.max_turns > MAX_TURNS_LIMIT:
        raise InvalidAction(
            f"reset option max_turns is {options.max_turns}; it must be 1 to "
            f"{MAX_TURNS_LIMIT} (0 means {DEFAULT_MAX_TURNS})"
        )
    return fixed


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}es"


def prompt(max_turns: int, *, hard_mode: bool, allow_any_word: bool) -> str:
    """The instructions an LLM player gets with the first observation."""
    words = (
        "Any 5 letters a-z are accepted as a guess"
        if allow_any_word
        else "A guess must be an English word of 5 letters"
    )
    lines = [
        "You are playing Wordle. A secret 5-letter English word has been chosen; you have "
        f"{_plural(max_turns, 'guess')} to find it.",
        "Reply with your guess in square brackets, e.g. [crane]; if your reply holds "
        "several, the last one counts.",
        f"{words}, and you may not repeat an earlier guess.",
        "After each guess every letter is marked:",
        "  G (green): the letter is in the word, in this position",
        "  Y (yellow): the letter is in the word, in another position",
        "  X (gray): the letter is not in the word (or not that many times)",
    ]
    if hard_mode:
        lines.append(
            "Hard mode: every revealed hint must be used: keep greens in place and include "
            "every yellow letter in later guesses."
        )
    return "\n".join(lines)


class WordleEnvironment(
    Environment[WordleAction, WordleObservation, WordleState, WordleResetOptions]
):
    """Wordle: guess the hidden five-letter word; per-letter feedback; shaped reward.

    One step is one guess. The episode terminates when the target is guessed or the
    last turn is used (a loss is the game's end, not a cut-off, so it is never
    truncated). Invalid guesses raise :class:`InvalidAction` and use no turn.
    """

    name = "wordle"
    version = "1.0.0"
    description = "Wordle: find a hidden 5-letter word in 6 guesses from per-letter feedback."
    runs_inline = True  # set and dict bookkeeping: microseconds per call

    def __init__(self) -> None:
        self._rng = random.Random()
        self._options = WordleResetOptions()
        self._seed = 0
        self._target = ""
        self._max_turns = DEFAULT_MAX_TURNS
        self._results: list[GuessResult] = []
        self._won = False
        self._reward_units = 0
        # What the guesses revealed (shaping potential and hard-mode constraints):
        # position -> letter for greens, letter -> copies known to be in the target.
        self._greens: dict[int, str] = {}
        self._known: dict[str, int] = {}

    # -- the contract -----------------------------------------------------------------

    def reset(
        self, *, seed: int | None, episode_id: str, options: WordleResetOptions | None
    ) -> Transition[WordleObservation]:
        options = options if options is not None else WordleResetOptions()
        # Validate everything before touching state: a refused reset leaves the episode.
        fixed = _checked_options(options)
        if seed is not None:
            # A seed restarts the generator; unseeded resets continue its sequence.
            self._rng = random.Random(seed)
        drawn = self._rng.choice(ANSWERS)  # drawn even when fixed: sequences stay aligned
        self._options = options
        self._seed = seed or 0
        self._target = fixed or drawn
        self._max_turns = options.max_turns or DEFAULT_MAX_TURNS
        self._results = []
        self._won = False
        self._reward_units = 0
        self._greens = {}
        self._known = {}
        text = prompt(
            self._max_turns, hard_mode=options.hard_mode, allow_any_word=options.allow_any_word
        )
        message = f"Guess the secret 5-letter word. You have {_plural(self._max_turns, 'guess')}."
        return Transition(self._observation(message, prompt=text))

    def step(self, action: WordleAction) -> Transition[WordleObservation]:
        word = extract_guess(action.guess)
        self._check_allowed(word)
        return self._play(word)

    def _play(self, word: str) -> Transition[WordleObservation]:
        """Play an accepted guess: it uses a turn."""
        scores = score_guess(word, self._target)
        result = GuessResult(word=word, scores=scores, squares=squares(scores))
        self._results.append(result)
        before = self._potential()
        for i, s in enumerate(scores):
            if s == GREEN:
                self._greens[i] = word[i]
        found = Counter(c for c, s in zip(word, scores, strict=True) if s != GRAY)
        for letter, copies in found.items():
            self._known[letter] = max(self._known.get(letter, 0), copies)
        self._won = word == self._target
        turns_left = self._max_turns - len(self._results)
        if self._options.sparse_reward:
            units = _WIN_UNITS if self._won else 0
        else:
            units = self._potential() - before
            if self._won:
                units += _WIN_UNITS + _UNUSED_TURN_UNITS * turns_left
        self._reward_units += units
        over = self._won or turns_left == 0
        return Transition(
            self._observation(self._feedback(result, turns_left)),
            reward=units / _UNITS_PER_REWARD,
            terminated=over,
        )

    def state(self) -> WordleState:
        options = self._options
        return WordleState(
            target=self._target,
            guesses=self._results,
            turn=len(self._results),
            max_turns=self._max_turns,
            won=self._won,
            game_over=self._over(),
            seed=self._seed,
            hard_mode=options.hard_mode,
            allow_any_word=options.allow_any_word,
            episode_reward=self._reward_units / _UNITS_PER_REWARD,
        )

    def snapshot(self) -> bytes:
        """The game as JSON: the generator's state (so later unseeded resets draw the same
        targets), the reset options and seed, the target and the words guessed so far."""
        return snapshot_body.dump(
            SNAPSHOT_LAYOUT,
            {
                "rng": snapshot_body.random_state(self._rng),
                "options": json_format.MessageToDict(self._options),
                "seed": self._seed,
                "target": self._target,
                "guesses": [result.word for result in self._results],
            },
        )

    def restore(self, snapshot: bytes) -> None:
        """Continue from :meth:`snapshot`'s bytes: the guesses are replayed under the
        game's rules, so the board, the revealed letters and the reward so far are
        recomputed, never trusted.

        Raises:
            InvalidAction: a field is malformed, or a guess would not be accepted now (the
                episode is unchanged).
        """
        body = snapshot_body.load(SNAPSHOT_LAYOUT, snapshot)
        game = WordleEnvironment()  # built aside and adopted last: a refusal changes nothing
        game._rng = snapshot_body.random_from(body.child("rng"))
        try:
            options = json_format.ParseDict(body.mapping("options"), WordleResetOptions())
        except json_format.ParseError as exc:
            raise body.invalid("options", f"is not a WordleResetOptions: {exc}") from None
        fixed = _checked_options(options)
        target = body.string("target", max_chars=WORD_LENGTH)
        if target and not (len(target) == WORD_LENGTH and target.isascii() and target.islower()):
            raise body.invalid("target", f"{_quote(target)} is not 5 letters a-z")
        if fixed and target != fixed:
            raise body.invalid("target", f"{_quote(target)} is not the options' {_quote(fixed)}")
        game._options = options
        game._seed = body.integer("seed", low=0, high=snapshot_body.MAX_SEED)
        game._target = target
        game._max_turns = options.max_turns or DEFAULT_MAX_TURNS
        guesses = body.strings("guesses", max_items=game._max_turns if target else 0)
        for turn, word in enumerate(guesses, start=1):
            if game._won:
                raise body.invalid("guesses", f"go on after the game was won on turn {turn - 1}")
            try:
                guess = extract_guess(word)
                game._check_allowed(guess)
            except InvalidAction as exc:
                raise body.invalid("guesses", f"hold turn {turn}'s refused guess: {exc}") from None
            game._play(guess)
        vars(self).update(vars(game))

    # -- rules ------------------------------------------------------------------------

    def _check_allowed(self, word: str) -> None:
        """Raise InvalidAction unless ``word`` may be guessed now."""
        if not (self._options.allow_any_word or word in ALLOWED or word == self._target):
            raise InvalidAction(f"{word!r} is not in the word list")
        for turn, earlier in enumerate(self._results, start=1):
            if earlier.word == word:
                raise InvalidAction(f"{word!r} was already guessed on turn {turn}")
        if self._options.hard_mode:
            for i, letter in sorted(self._greens.items()):
                if word[i] != letter:
                    raise InvalidAction(
                        f"hard mode: letter {i + 1} must be {letter.upper()} (revealed green)"
                    )
            counts = Counter(word)
            for letter, copies in sorted(self._known.items()):
                if counts[letter] < copies:
                    times = "once" if copies == 1 else f"{copies} times"
                    raise InvalidAction(
                        f"hard mode: the guess must contain {letter.upper()} {times} "
                        "(revealed in the word)"
                    )

    def _potential(self) -> int:
        """Shaping units revealed so far: target letters found plus green positions."""
        return sum(self._known.values()) + len(self._greens)

    def _over(self) -> bool:
        return self._won or (bool(self._target) and len(self._results) >= self._max_turns)

    # -- rendering --------------------------------------------------------------------

    def _feedback(self, result: GuessResult, turns_left: int) -> str:
        lines = [f"You guessed [{result.word}].", _row(result)]
        if self._won:
            lines.append(f"Correct! You found the word in {_plural(len(self._results), 'guess')}.")
        elif turns_left == 0:
            lines.append(f"Out of guesses: the word was [{self._target}].")
        else:
            lines.append(f"You have {_plural(turns_left, 'guess')} left.")
        return "\n".join(lines)

    def _observation(self, message: str, *, prompt: str = "") -> WordleObservation:
        turn = len(self._results)
        return WordleObservation(
            prompt=prompt,
            message=message,
            board=render_board(self._results),
            guesses=self._results,
            turn=turn,
            turns_left=self._max_turns - turn,
            max_turns=self._max_turns,
            won=self._won,
            answer=self._target if self._over() else "",
        )
