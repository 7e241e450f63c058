"""A runnable tour of wordle: ``python -m openenv_grpc_envs.wordle.example HOST:PORT``.

Plays a game with a fixed target (guesses as plain words and as LLM-style text, one
refused guess), then a seeded game solved by a tiny solver that keeps only the answers
consistent with the feedback so far.
"""

from __future__ import annotations

import sys

from openenv_grpc.client.errors import EnvError
from openenv_grpc_envs.wordle import (
    ANSWERS,
    GuessResult,
    WordleAction,
    WordleEnv,
    WordleResetOptions,
    score_guess,
)


def consistent(candidates: list[str], results: list[GuessResult]) -> list[str]:
    """The candidates that would have produced every scored guess in ``results``."""
    return [
        word
        for word in candidates
        if all(score_guess(r.word, word) == list(r.scores) for r in results)
    ]


def main(target: str) -> None:
    with WordleEnv(target) as env:
        # Game 1: a fixed target, as used for evaluation and tests.
        result = env.reset(options=WordleResetOptions(target="abide"))
        print(result.observation.message)
        for guess in ["speed", "Maybe [crane]? No, I'll go with [xyzzy]", "[bride]", "abide"]:
            try:
                result = env.step(WordleAction(guess=guess))
            except EnvError as error:
                print(f"refused: {error.code.name}: {error.message}")
                continue
            row = result.observation.guesses[-1]
            print(f"{row.word} {row.squares} reward={result.reward:.2f}")
        print(result.observation.message.splitlines()[-1])
        print(result.observation.board)

        # Game 2: a seeded target and a solver that guesses the first consistent answer.
        result = env.reset(seed=7)
        candidates = list(ANSWERS)
        while not result.done:
            guess = consistent(candidates, list(result.observation.guesses))[0]
            result = env.step(WordleAction(guess=f"[{guess}]"))
            row = result.observation.guesses[-1]
            print(f"turn {result.observation.turn}: {row.squares} reward={result.reward:.2f}")
        print(f"won={result.observation.won} answer={result.observation.answer}")
        print(f"state: episode_reward={env.state().episode_reward:.2f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051")
