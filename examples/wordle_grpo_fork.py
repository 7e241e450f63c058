"""A GRPO-style group on wordle: G branches forked from one game prefix.

    python examples/wordle_grpo_fork.py                            # starts a local wordle server
    python examples/wordle_grpo_fork.py --target 127.0.0.1:50051 --group 8 --prefix crane,sloth

GRPO compares the G completions of one prompt with each other: the advantage of a
completion is its reward against the group's, ``(r - mean) / (std + eps)``. That is fair
only when every completion starts from the same state. Replaying a seed gives the same
*first* state; here the shared state is anywhere in the game: one session plays the
prefix (the opening guesses), then ``env.fork(G)`` branches it into G sessions that hold
the same board, target, step count and episode id, and each branch plays on with its own
sampled guesses. The rewards of the branches are then comparable from the branching turn
on, which is the credit assignment a multi-turn GRPO wants for the turns after the
prefix.

The policy is a stand-in for a model (no network, no torch): each turn it samples a
guess uniformly from the answers consistent with the board, or, with probability
``--explore``, any allowed word not guessed yet. Its randomness makes the branches
differ; swap in generation from a model to use this for real.

Output: one JSON line per group ``{"prompt", "prefix", "board", "step_count", "returns",
"advantages", "turns", "won", "guesses"}`` (``returns``: the reward summed over each
branch's own turns), then ``{"summary": {...}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import grpc

from openenv_grpc_envs.wordle import (
    ALLOWED,
    ANSWERS,
    AsyncWordleEnv,
    GuessResult,
    WordleAction,
    WordleObservation,
    score_guess,
)

#: Added to the group's standard deviation (as in TRL's GRPOTrainer).
EPSILON = 1e-4
_SORTED_ALLOWED = sorted(ALLOWED)


def consistent(word: str, guesses: Sequence[GuessResult]) -> bool:
    """Whether ``word`` could be the target given the scored guesses (the board only)."""
    return all(list(score_guess(g.word, word)) == list(g.scores) for g in guesses)


def sample_guess(observation: WordleObservation, rng: random.Random, explore: float) -> str:
    """The stand-in policy: a consistent answer, or (with probability ``explore``) any
    allowed word not guessed yet."""
    tried = {g.word for g in observation.guesses}
    if rng.random() >= explore:
        candidates = [w for w in ANSWERS if w not in tried and consistent(w, observation.guesses)]
        if candidates:
            return rng.choice(candidates)
    while (word := rng.choice(_SORTED_ALLOWED)) in tried:
        pass
    return word


def group_advantages(returns: Sequence[float]) -> list[float]:
    """GRPO's group-relative advantages: ``(r - mean) / (std + eps)``."""
    mean = statistics.fmean(returns)
    std = statistics.pstdev(returns)
    return [(r - mean) / (std + EPSILON) for r in returns]


@dataclass
class Branch:
    """What one branch played after the fork."""

    guesses: list[str]
    reward: float
    won: bool


async def continue_branch(
    branch: AsyncWordleEnv, observation: WordleObservation, rng: random.Random, explore: float
) -> Branch:
    """Play one branch to the end of its game."""
    guesses: list[str] = []
    reward = 0.0
    while True:
        word = sample_guess(observation, rng, explore)
        result = await branch.step(WordleAction(guess=f"I'll try [{word}]"))
        guesses.append(word)
        reward += result.reward
        observation = result.observation
        if result.terminated:
            return Branch(guesses, reward, observation.won)


async def group(
    channel: grpc.aio.Channel,
    prompt: int,
    prefix: Sequence[str],
    size: int,
    explore: float,
    seed: int,
) -> dict[str, Any]:
    """One prompt: a game (the server draws its target from ``prompt``), its prefix
    played in one session, then ``size`` forked branches played to the end."""
    async with AsyncWordleEnv(channel) as env:
        observation = (await env.reset(seed=prompt)).observation
        step_count = 0
        for word in prefix:
            result = await env.step(WordleAction(guess=word))
            observation, step_count = result.observation, result.step_count
            if result.terminated:
                raise SystemExit(f"prompt {prompt}: the prefix ended the game at {word!r}")
        async with AsyncExitStack() as stack:
            branches = await env.fork(size)  # G sessions, each at this very board
            for branch in branches:
                stack.push_async_callback(branch.close)
            rngs = [random.Random(f"{seed}/{prompt}/{i}") for i in range(size)]
            played = await asyncio.gather(
                *(
                    continue_branch(branch, observation, rng, explore)
                    for branch, rng in zip(branches, rngs, strict=True)
                )
            )
    returns = [b.reward for b in played]
    return {
        "prompt": prompt,
        "prefix": list(prefix),
        "board": observation.board,
        "step_count": step_count,
        "returns": [round(r, 4) for r in returns],
        "advantages": [round(a, 4) for a in group_advantages(returns)],
        "turns": [len(b.guesses) for b in played],
        "won": [b.won for b in played],
        "guesses": [b.guesses for b in played],
    }


async def run(
    target: str, prompts: int, prefix: Sequence[str], size: int, explore: float, seed: int
) -> dict[str, Any]:
    """Every group, printed as it finishes; the summary."""
    started = time.perf_counter()
    async with grpc.aio.insecure_channel(target) as channel:
        groups = await asyncio.gather(
            *(group(channel, seed + p, prefix, size, explore, seed) for p in range(prompts))
        )
    for result in groups:
        print(json.dumps(result), flush=True)
    returns = [r for g in groups for r in g["returns"]]
    return {
        "groups": prompts,
        "group_size": size,
        "prefix": list(prefix),
        "branches": len(returns),
        "mean_return": round(statistics.fmean(returns), 4),
        "win_rate": round(statistics.fmean(w for g in groups for w in g["won"]), 4),
        "wall_s": round(time.perf_counter() - started, 2),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="a wordle server (default: start one)")
    parser.add_argument("--prompts", type=int, default=4, help="groups (one game each)")
    parser.add_argument("--group", type=int, default=8, help="G: branches per group")
    parser.add_argument("--prefix", default="crane", help="comma-separated opening guesses")
    parser.add_argument("--explore", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    prefix = [w.strip() for w in args.prefix.split(",") if w.strip()]
    plan = (args.prompts, prefix, args.group, args.explore, args.seed)
    if args.target:
        summary = asyncio.run(run(args.target, *plan))
    else:
        from openenv_grpc.providers import LocalProcessProvider  # our own server

        server = LocalProcessProvider("wordle")
        server.start()
        try:
            summary = asyncio.run(run(server.target, *plan))
        finally:
            server.stop()
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
