"""The wordle environment passes the conformance suite."""

from __future__ import annotations

import random

from openenv_grpc.testing import EnvConformance
from openenv_grpc_envs.wordle import ALLOWED, WordleAction, WordleObservation

# Guesses come from the allowed list, not the answers: the suite seeds its action rng
# with the env's seed, and random.Random(seed).choice(ANSWERS) *is* the target.
GUESSES = sorted(ALLOWED)


class TestWordleConformance(EnvConformance):
    env = "wordle"
    snapshots = True  # the suite fails if Info ever stops claiming them

    def make_action(
        self, observation: WordleObservation, step: int, rng: random.Random
    ) -> WordleAction:
        # A random word not guessed yet (repeats are refused); the default 6-turn limit
        # ends every episode.
        guessed = {g.word for g in observation.guesses}
        while (word := rng.choice(GUESSES)) in guessed:
            pass
        return WordleAction(guess=word)
