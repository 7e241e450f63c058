"""A GRPO-style rollout for the wordle env, with a tiny numpy "model" that learns a little.

    python examples/wordle_grpo_rollout.py                    # starts a local wordle server
    python examples/wordle_grpo_rollout.py --target 127.0.0.1:50051 --updates 8 --prompts 16

The shape is that of a rollout function for TRL's ``GRPOTrainer``: a batch of prompts ->
G completions per prompt from the current policy -> one env episode per completion (on
the server, over gRPC) -> one reward per completion -> group-relative advantages
``(r - mean(group)) / (std(group) + eps)``. Here a *prompt* is one Wordle game: a seed
picks the hidden word on the server, and the G completions of a group all play that same
game (so their rewards are comparable, which is what the group baseline assumes). The
text the model reads is the env's own ``prompt`` and ``board``; what it writes each turn
is free text with the guess in brackets (``"I'll try [crane]"``), which the env parses.

The "model" is deliberately tiny and local (no network, no torch): a log-linear policy
over the 6,734 allowed words. Each candidate word gets a handful of features computed
from the feedback the board shows (does it keep the greens, use the yellows, avoid the
grays, is it a common word, how many new letters does it try); the policy samples a word
with probability ``softmax(features @ theta)``. ``theta`` starts at zero (a uniformly
random guesser) and a few GRPO updates (policy gradient with the group-relative
advantage, no KL term, no clipping: one update per batch) teach it to use the feedback.

Output: JSON lines ``{"update", "mean_reward", "win_rate", "mean_turns", "theta"}``, one
per update (measured on that update's fresh batch of games, before the update).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from openenv_grpc import EnvError
from openenv_grpc_envs.wordle import (
    ALLOWED,
    ANSWERS,
    AsyncWordleEnv,
    GuessResult,
    LetterScore,
    WordleAction,
)

FEATURES = ["keeps_greens", "uses_yellows", "avoids_grays", "moves_yellows", "new_letters",
            "common_word"]  # fmt: skip
GREEN, YELLOW = LetterScore.LETTER_SCORE_GREEN, LetterScore.LETTER_SCORE_YELLOW


# -- the tiny model ---------------------------------------------------------------------


class WordPolicy:
    """``softmax(features(word | board) @ theta)`` over the allowed words."""

    def __init__(self, theta: npt.NDArray[np.float64] | None = None) -> None:
        self.words = sorted(ALLOWED)
        self.index = {w: i for i, w in enumerate(self.words)}
        letters = np.array([[ord(c) - 97 for c in w] for w in self.words], dtype=np.int64)
        self.letters = letters  # (V, 5)
        self.has = np.zeros((len(self.words), 26), dtype=bool)  # (V, 26)
        for pos in range(5):
            self.has[np.arange(len(self.words)), letters[:, pos]] = True
        common = set(ANSWERS)
        self.common = np.array([w in common for w in self.words], dtype=np.float64)
        self.theta = np.zeros(len(FEATURES)) if theta is None else theta

    def features(self, guesses: list[GuessResult]) -> npt.NDArray[np.float64]:
        """(V, F) features of every word given the scored guesses so far (what the
        board shows; the hidden word is never used)."""
        greens: set[tuple[int, int]] = set()
        yellows: set[tuple[int, int]] = set()
        present: set[int] = set()
        tried: set[int] = set()
        for result in guesses:
            for pos, (char, score) in enumerate(zip(result.word, result.scores, strict=True)):
                letter = ord(char) - 97
                tried.add(letter)
                if score == GREEN:
                    greens.add((pos, letter))
                    present.add(letter)
                elif score == YELLOW:
                    yellows.add((pos, letter))
                    present.add(letter)
        absent = tried - present  # gray everywhere it was tried
        V = len(self.words)
        phi = np.zeros((V, len(FEATURES)))
        if greens:
            phi[:, 0] = np.mean([self.letters[:, p] == c for p, c in greens], axis=0)
        if present:
            phi[:, 1] = self.has[:, sorted(present)].mean(axis=1)
        if absent:
            phi[:, 2] = 1.0 - self.has[:, sorted(absent)].sum(axis=1) / 5.0
        else:
            phi[:, 2] = 1.0
        if yellows:
            phi[:, 3] = 1.0 - np.sum([self.letters[:, p] == c for p, c in yellows], axis=0) / 5
        else:
            phi[:, 3] = 1.0
        untried = np.ones(26, dtype=bool)
        untried[sorted(tried)] = False
        phi[:, 4] = (self.has & untried).sum(axis=1) / 5.0
        phi[:, 5] = self.common
        return phi

    def distribution(
        self, guesses: list[GuessResult]
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """``(probs, phi)`` for the next guess; words already guessed get probability 0."""
        phi = self.features(guesses)
        logits = phi @ self.theta
        for result in guesses:
            logits[self.index[result.word]] = -np.inf  # the env refuses a repeated guess
        logits -= logits.max()
        probs = np.exp(logits)
        probs /= probs.sum()
        return probs, phi


# -- the rollout ------------------------------------------------------------------------


@dataclass
class Episode:
    """One completion: the turns the model wrote and what the env answered."""

    seed: int
    prompt: str = ""
    turns: list[str] = field(default_factory=list)
    reward: float = 0.0
    won: bool = False
    logprob: float = 0.0
    #: Per turn: phi(chosen word) - E_pi[phi], the gradient of log pi(turn) w.r.t. theta.
    score_grads: list[npt.NDArray[np.float64]] = field(default_factory=list)
    refused: int = 0

    @property
    def completion(self) -> str:
        return "\n".join(self.turns)


async def play(
    channel: grpc.aio.Channel, policy: WordPolicy, seed: int, rng: np.random.Generator
) -> Episode:
    """One episode on its own session: reset(seed) picks the game; the policy writes a
    bracketed guess per turn until the env says the game is over."""
    episode = Episode(seed)
    async with AsyncWordleEnv(channel) as env:
        result = await env.reset(seed=seed)
        episode.prompt = result.observation.prompt
        while not result.done:
            guesses = list(result.observation.guesses)
            probs, phi = policy.distribution(guesses)
            i = int(rng.choice(len(probs), p=probs))
            text = f"Turn {len(guesses) + 1}: I'll try [{policy.words[i]}]"
            try:
                result = await env.step(WordleAction(guess=text))
            except EnvError:  # a refused guess uses no turn; count it and sample again
                episode.refused += 1
                continue
            episode.turns.append(text)
            episode.reward += result.reward
            episode.logprob += float(np.log(probs[i]))
            episode.score_grads.append(phi[i] - probs @ phi)
        episode.won = result.observation.won
    return episode


def group_advantages(rewards: npt.NDArray[np.float64], eps: float = 1e-4) -> Any:
    """GRPO's advantages: each reward minus its group's mean, over the group's std.
    ``rewards`` is (prompts, G); a group whose completions all scored alike gets 0."""
    mean = rewards.mean(axis=1, keepdims=True)
    std = rewards.std(axis=1, keepdims=True)
    return (rewards - mean) / (std + eps)


def rollout(
    target: str, policy: WordPolicy, seeds: list[int], num_generations: int, rng_seed: int = 0
) -> dict[str, Any]:
    """TRL-style rollout: ``len(seeds)`` prompts x ``num_generations`` completions, every
    completion one episode on the server (all concurrently, one channel).

    Returns:
        ``prompts`` / ``completions`` (lists of P*G strings, grouped by prompt),
        ``env_reward`` and ``advantages`` ((P, G) arrays), ``logprobs`` ((P, G): sum of
        the policy's log-probabilities of its guesses), ``won`` ((P, G) bools) and the
        ``episodes`` themselves (for the update).
    """

    async def run() -> list[Episode]:
        async with grpc.aio.insecure_channel(target) as channel:
            rngs = [np.random.default_rng([rng_seed, k]) for k in range(len(seeds) * G)]
            jobs = [
                play(channel, policy, seed, rngs[p * G + g])
                for p, seed in enumerate(seeds)
                for g in range(G)
            ]
            return list(await asyncio.gather(*jobs))

    G = num_generations
    episodes = asyncio.run(run())
    shape = (len(seeds), G)
    rewards = np.array([e.reward for e in episodes]).reshape(shape)
    return {
        "prompts": [e.prompt for e in episodes],
        "completions": [e.completion for e in episodes],
        "env_reward": rewards,
        "advantages": group_advantages(rewards),
        "logprobs": np.array([e.logprob for e in episodes]).reshape(shape),
        "won": np.array([e.won for e in episodes]).reshape(shape),
        "episodes": episodes,
    }


def grpo_update(policy: WordPolicy, batch: dict[str, Any], lr: float) -> None:
    """One policy-gradient step: theta += lr * mean_i A_i * mean_t grad log pi(turn_t)."""
    grad = np.zeros_like(policy.theta)
    advantages = batch["advantages"].reshape(-1)
    for advantage, episode in zip(advantages, batch["episodes"], strict=True):
        if episode.score_grads:
            grad += advantage * np.mean(episode.score_grads, axis=0)
    policy.theta += lr * grad / len(batch["episodes"])


def train(
    target: str,
    updates: int,
    prompts: int,
    num_generations: int,
    lr: float,
    seed: int,
    out: Any = sys.stdout,
) -> list[dict[str, Any]]:
    """Alternate rollouts (fresh games each time) and GRPO updates; returns the curve."""
    policy = WordPolicy()
    curve = []
    for update in range(updates + 1):  # the last batch only measures
        seeds = [seed * 100_000 + update * prompts + p for p in range(prompts)]
        batch = rollout(target, policy, seeds, num_generations, rng_seed=seed * 1000 + update)
        turns = [len(e.turns) for e in batch["episodes"]]
        point = {
            "update": update,
            "mean_reward": round(float(batch["env_reward"].mean()), 3),
            "win_rate": round(float(batch["won"].mean()), 3),
            "mean_turns": round(float(np.mean(turns)), 2),
            "theta": dict(zip(FEATURES, np.round(policy.theta, 2).tolist(), strict=True)),
        }
        curve.append(point)
        print(json.dumps(point), file=out, flush=True)
        if update < updates:
            grpo_update(policy, batch, lr)
    return curve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="HOST:PORT of a wordle server (default: start one)")
    parser.add_argument("--updates", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=16, help="games per batch")
    parser.add_argument("--generations", type=int, default=8, help="G: completions per game")
    parser.add_argument("--lr", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    run = (args.updates, args.prompts, args.generations, args.lr, args.seed)
    if args.target:
        train(args.target, *run)
        return 0
    from openenv_grpc.providers import LocalProcessProvider  # our own server

    server = LocalProcessProvider("wordle")
    server.start()
    try:
        train(server.target, *run)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
