"""Monte-Carlo tree search on an OpenSpiel game, driven through snapshots and forks.

    python examples/mcts_fork.py                               # starts a local openspiel server
    python examples/mcts_fork.py --target 127.0.0.1:50051 --game connect_four --simulations 400

The game is played on the server in one session (``CONTROL_MODE_ALL_PLAYERS``: the client
plays both seats): MCTS plays one seat, a uniformly random player the other, seats
alternating from game to game. At each of its turns MCTS forks the live session into
``--workers`` sessions (``env.fork(n)``: one snapshot, restored in n new sessions on the
same server) and runs ``--simulations`` UCT simulations through them concurrently: a
simulation walks the tree, *restores* a worker to the leaf's snapshot, steps one untried
move, *snapshots* the new node, and plays random moves to the end; the final returns are
backed up along the path. The tree holds each node's snapshot and observation, never a
copy of the game's rules: the server plays every move.

Every snapshot is the server's signed bytes, opaque here. The search is exact for
deterministic games (tic-tac-toe, connect four, breakthrough, ...); in games with chance
nodes a snapshot carries the chance generator, so a node's children would follow one
sampled future: pass such games only to see the mechanics.

Output: one JSON line per game and a summary line
``{"summary": {"games", "wins", "draws", "losses", "win_rate", "simulations", ...}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import grpc

from openenv_grpc_envs.openspiel import (
    CONTROL_MODE_ALL_PLAYERS,
    AsyncOpenSpielEnv,
    OpenSpielAction,
    OpenSpielObservation,
    OpenSpielResetOptions,
)

#: UCT's exploration constant (returns are in [-1, 1]).
EXPLORATION = 1.4


@dataclass(eq=False)
class Node:
    """One position of the search tree."""

    #: What the server showed here: whose turn, legal moves, the returns once terminal.
    observation: OpenSpielObservation
    #: The server's snapshot of this position (None for terminal positions: never needed).
    snapshot: bytes | None
    #: The seat whose move led here (the root's: -1); visits count for it.
    mover: int
    untried: list[int]
    children: dict[int, Node] = field(default_factory=dict)
    visits: int = 0
    value: float = 0.0

    def best_child(self) -> Node:
        """The child UCT picks (mean return for its mover, plus the exploration bonus)."""
        log_visits = math.log(self.visits)
        return max(
            self.children.values(),
            key=lambda c: c.value / c.visits + EXPLORATION * math.sqrt(log_visits / c.visits),
        )


def node(observation: OpenSpielObservation, snapshot: bytes | None, mover: int) -> Node:
    untried = [] if observation.terminal else [a.id for a in observation.legal_actions]
    return Node(observation, None if observation.terminal else snapshot, mover, untried)


@dataclass(eq=False)
class Worker:
    """A forked session and the node it stands at (a restore moves it)."""

    env: AsyncOpenSpielEnv
    at: Node


async def simulate(worker: Worker, root: Node, rng: random.Random) -> None:
    """One simulation: select, expand one move, roll out at random, back up."""
    path = [root]
    current = root
    while current.untried == [] and current.children and not current.observation.terminal:
        current = current.best_child()
        path.append(current)
    for visited in path:  # a virtual loss: concurrent simulations spread over the tree
        visited.visits += 1
    if current.observation.terminal:
        returns = list(current.observation.returns)
    else:
        if worker.at is not current:
            assert current.snapshot is not None
            await worker.env.restore(current.snapshot)
        observation = current.observation
        if current.untried:
            action = current.untried.pop(rng.randrange(len(current.untried)))
            mover = observation.current_player
            observation = (await worker.env.step(OpenSpielAction(id=action))).observation
            snapshot = None if observation.terminal else await worker.env.snapshot()
            child = node(observation, snapshot, mover)
            current.children[action] = child
            child.visits += 1
            path.append(child)
            worker.at = child
        returns = await rollout(worker, observation, rng)
    for visited in path:
        if visited.mover >= 0:
            visited.value += returns[visited.mover]


async def rollout(
    worker: Worker, observation: OpenSpielObservation, rng: random.Random
) -> list[float]:
    """Random moves from the worker's position to the end; the final returns. The worker
    no longer stands at any node afterwards."""
    while not observation.terminal:
        action = rng.choice(observation.legal_actions).id
        observation = (await worker.env.step(OpenSpielAction(id=action))).observation
        worker.at = _NOWHERE
    return list(observation.returns)


_NOWHERE = Node(OpenSpielObservation(terminal=True), None, -1, [])


async def search(
    env: AsyncOpenSpielEnv,
    observation: OpenSpielObservation,
    simulations: int,
    workers: int,
    rng: random.Random,
) -> int:
    """The move MCTS picks in the session's position: the root's most visited child."""
    root = node(observation, await env.snapshot(), mover=-1)
    async with AsyncExitStack() as stack:
        forks = await env.fork(workers)  # each opens on the same server, at the root
        for fork in forks:
            stack.push_async_callback(fork.close)
        budget = iter(range(simulations))

        async def run(worker: Worker) -> None:
            for _ in budget:  # shared: the workers draw simulations until none are left
                await simulate(worker, root, rng)

        await asyncio.gather(*(run(Worker(fork, root)) for fork in forks))
    return max(root.children.items(), key=lambda item: item[1].visits)[0]


async def play(
    channel: grpc.aio.Channel,
    game: str,
    mcts_seat: int,
    simulations: int,
    workers: int,
    seed: int,
) -> dict[str, Any]:
    """One game, MCTS in ``mcts_seat`` against a random player; its result."""
    rng = random.Random(seed)
    started = time.perf_counter()
    moves = 0
    async with AsyncOpenSpielEnv(channel) as env:
        options = OpenSpielResetOptions(game=game, control=CONTROL_MODE_ALL_PLAYERS)
        observation = (await env.reset(seed=seed, options=options)).observation
        while not observation.terminal:
            if observation.current_player == mcts_seat:
                action = await search(env, observation, simulations, workers, rng)
                moves += 1
            else:
                action = rng.choice(observation.legal_actions).id
            observation = (await env.step(OpenSpielAction(id=action))).observation
    score = observation.returns[mcts_seat]
    return {
        "game": game,
        "mcts_seat": mcts_seat,
        "result": "win" if score > 0 else "loss" if score < 0 else "draw",
        "mcts_moves": moves,
        "wall_s": round(time.perf_counter() - started, 2),
    }


async def run_games(
    target: str, game: str, games: int, simulations: int, workers: int, seed: int
) -> dict[str, Any]:
    """Play ``games`` games (seats alternating); print a line per game; the summary."""
    started = time.perf_counter()
    results = []
    async with grpc.aio.insecure_channel(target) as channel:
        for index in range(games):
            result = await play(channel, game, index % 2, simulations, workers, seed + index)
            print(json.dumps(result), flush=True)
            results.append(result)
    counts = {k: sum(r["result"] == k for r in results) for k in ("win", "draw", "loss")}
    return {
        "games": games,
        "wins": counts["win"],
        "draws": counts["draw"],
        "losses": counts["loss"],
        "win_rate": counts["win"] / games,
        "game": game,
        "simulations": simulations,
        "workers": workers,
        "wall_s": round(time.perf_counter() - started, 2),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="an openspiel server (default: start one)")
    parser.add_argument("--game", default="tic_tac_toe")
    parser.add_argument("--games", type=int, default=6)
    parser.add_argument("--simulations", type=int, default=200, help="per MCTS move")
    parser.add_argument("--workers", type=int, default=4, help="forked sessions per move")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    run = (args.game, args.games, args.simulations, args.workers, args.seed)
    if args.target:
        summary = asyncio.run(run_games(args.target, *run))
    else:
        from openenv_grpc.providers import LocalProcessProvider  # our own server

        server = LocalProcessProvider("openspiel")
        server.start()
        try:
            summary = asyncio.run(run_games(server.target, *run))
        finally:
            server.stop()
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
