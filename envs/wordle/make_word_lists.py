"""Regenerate ``answers.txt`` and ``allowed.txt`` from the SCOWL lists Debian ships.

Run at authoring time only (the environment reads the committed .txt files)::

    apt-get install -y wamerican-small wamerican-large
    python -m openenv_grpc_envs.wordle.make_word_lists

Answers (the words a target is drawn from) are the lowercase five-letter words of
``american-english-small`` (SCOWL size 35: common words), without Roman numerals, simple
inflections (plurals, third persons, past tenses of a listed stem) and a short hand-made
list of offensive, slang, archaic and variant spellings. Allowed guesses are every
lowercase five-letter word of ``american-english-large`` (SCOWL size 70), inflections
included, plus the answers. SCOWL's permissive licence is quoted in this package's README.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["EXCLUDED_ANSWERS", "answer_words", "main"]

SMALL = Path("/usr/share/dict/american-english-small")
LARGE = Path("/usr/share/dict/american-english-large")
HERE = Path(__file__).resolve().parent

_FIVE = re.compile(r"[a-z]{5}")
_LOWER = re.compile(r"[a-z]+")
# A valid Roman numeral (SCOWL lists a few, e.g. "xviii").
_ROMAN = re.compile(r"m{0,4}(cm|cd|d?c{0,3})(xc|xl|l?x{0,3})(ix|iv|v?i{0,3})")

# Offensive or sexual words.
_OFFENSIVE = """
bitch booby enema fagot horny kinky lynch moron nappy nuder panty penes penis pussy queer
semen sissy sperm whore
"""
# Slang, contractions and prefixes.
_SLANG = "dunno gimme gonna kinda lemme multi sorta wanna"
# Archaic forms, rare plurals and spelling variants of other answers.
_VARIANTS = """
abaci abler aline altho ameba ameer amuck appal apter aurae blent blest boney brusk celli
chapt clipt cooky coyer croci curst direr drily edger enrol eying feted gayer gayly genii
gnawn haler huger imbed lamer laxer letup maria miaow muter oases pease podia rawer recta
rifer sabre sades sager saree shoon sirup sizer slier slily slyer tempi toffy togae torsi
unman unsay upped uteri vacua vizor weest wrapt wrier wryer zombi
"""
#: Words never drawn as a target (they stay allowed as guesses when the large list has them).
EXCLUDED_ANSWERS = frozenset(f"{_OFFENSIVE} {_SLANG} {_VARIANTS}".split())


def _words(path: Path, pattern: re.Pattern[str]) -> set[str]:
    return {w for w in path.read_text(encoding="utf-8").split() if pattern.fullmatch(w)}


def _inflected(word: str, stems: set[str]) -> bool:
    """True when ``word`` is a regular inflection of a word in ``stems``."""
    if word.endswith(("ies", "ied")) and word[:-3] + "y" in stems:
        return True
    if word.endswith("es") and word[-3] in "sxzh" and word[:-2] in stems:
        return True
    if word.endswith("s") and not word.endswith("ss") and word[:-1] in stems:
        return True
    return word.endswith("ed") and (word[:-1] in stems or word[:-2] in stems)


def answer_words(small: set[str], stems: set[str]) -> list[str]:
    """The target list: common five-letter words that are not inflections or excluded."""
    return sorted(
        w
        for w in small
        if not _ROMAN.fullmatch(w) and not _inflected(w, stems) and w not in EXCLUDED_ANSWERS
    )


def main() -> None:
    """Write answers.txt and allowed.txt next to this file."""
    stems = _words(LARGE, _LOWER)
    answers = answer_words(_words(SMALL, _FIVE), stems)
    allowed = sorted({w for w in _words(LARGE, _FIVE) if not _ROMAN.fullmatch(w)} | set(answers))
    (HERE / "answers.txt").write_text("\n".join(answers) + "\n", encoding="ascii")
    (HERE / "allowed.txt").write_text("\n".join(allowed) + "\n", encoding="ascii")
    print(f"{len(answers)} answers, {len(allowed)} allowed guesses")


if __name__ == "__main__":
    main()
