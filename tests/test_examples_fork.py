"""The snapshot examples against real servers: MCTS driven through forks beats a random
player at tic-tac-toe, and a GRPO group forked from one wordle prefix plays G
continuations of that very game."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.openspiel import AsyncOpenSpielEnv
from openenv_grpc_envs.wordle import WordleAction, WordleEnv
from support.examples import load_example

mcts = load_example("mcts_fork")
grpo = load_example("wordle_grpo_fork")

#: Random against random at tic-tac-toe wins 59.0% as the first player and 28.6% as the
#: second (10^5 games played with pyspiel): 43.8% over alternating seats.
RANDOM_WIN_RATE = 0.438


@pytest.fixture(scope="module")
def openspiel() -> Iterator[ServerProcess]:
    server = ServerProcess("openspiel", ["--max-concurrent-envs", "0"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def wordle() -> Iterator[ServerProcess]:
    server = ServerProcess("wordle", ["--max-concurrent-envs", "0"])
    yield server
    server.stop()


@pytest.mark.timeout(150)
def test_mcts_through_forks_beats_a_random_player(
    openspiel: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """6 games, seats alternating, 150 simulations per move over 4 forked sessions (a
    budget in simulations, not seconds, so a loaded machine plays as well, only slower:
    ~1-3 s per game here). 100 simulations won 19 of 20 games and drew 1."""
    calls: dict[str, list[Any]] = {"fork": [], "restore": []}
    fork, restore = AsyncOpenSpielEnv.fork, AsyncOpenSpielEnv.restore

    async def counting_fork(self: AsyncOpenSpielEnv, n: Any = None, **kw: Any) -> Any:
        calls["fork"].append(n)
        return await fork(self, n, **kw)

    async def counting_restore(self: AsyncOpenSpielEnv, data: bytes, **kw: Any) -> Any:
        calls["restore"].append(len(data))
        return await restore(self, data, **kw)

    monkeypatch.setattr(AsyncOpenSpielEnv, "fork", counting_fork)
    monkeypatch.setattr(AsyncOpenSpielEnv, "restore", counting_restore)
    summary = asyncio.run(
        mcts.run_games(openspiel.target, "tic_tac_toe", games=6, simulations=150, workers=4, seed=0)
    )
    assert summary["games"] == 6
    assert summary["wins"] >= 4, summary  # 67%, against random's 43.8%
    assert summary["losses"] <= 1, summary
    assert summary["win_rate"] >= RANDOM_WIN_RATE + 0.2
    # Driven through forks: one fork of 4 sessions per MCTS move, and restores of the
    # tree's snapshots in them (most simulations restore one).
    moves = len(calls["fork"])
    assert moves >= 6 * 2 and set(calls["fork"]) == {4}
    assert len(calls["restore"]) >= moves * 50


def replay(target: str, prompt: int, words: list[str]) -> tuple[float, bool]:
    """The reward of ``words`` after the prefix, and the win, on a fresh session of the
    same game (the server draws its target from the seed)."""
    with WordleEnv(target) as env:
        env.reset(seed=prompt)
        total, won = 0.0, False
        for index, word in enumerate(words):
            result = env.step(WordleAction(guess=word))
            if index >= len(PREFIX):
                total += result.reward
            won = result.observation.won
    return total, won


PREFIX = ["crane", "sloth"]


@pytest.mark.timeout(60)
def test_a_group_forked_from_one_prefix_plays_that_game(wordle: ServerProcess) -> None:
    async def one_group() -> dict[str, Any]:
        async with grpc.aio.insecure_channel(wordle.target) as channel:
            result: dict[str, Any] = await grpo.group(
                channel, prompt=7, prefix=PREFIX, size=8, explore=0.5, seed=0
            )
            return result

    result = asyncio.run(one_group())
    assert result["step_count"] == len(PREFIX)
    assert len(result["returns"]) == len(result["advantages"]) == 8
    # Group-relative: the advantages are centred and scaled within the group.
    assert abs(sum(result["advantages"])) < 1e-3
    assert statistics.pstdev(result["advantages"]) == pytest.approx(1.0, abs=1e-2)
    # G different continuations ...
    assert len({tuple(g) for g in result["guesses"]}) > 1
    # ... of the very game the prefix was played in: replayed after the same prefix on a
    # fresh session of the same seed, each branch's guesses earn what the branch earned.
    for words, earned, won in zip(result["guesses"], result["returns"], result["won"], strict=True):
        again, won_again = replay(wordle.target, 7, PREFIX + words)
        assert again == pytest.approx(earned, abs=1e-4) and won_again == won


def test_advantages_of_an_even_group_are_zero() -> None:
    assert grpo.group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
