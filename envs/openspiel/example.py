"""A runnable tour of the openspiel environment.

``python -m openenv_grpc_envs.openspiel.example HOST:PORT`` plays, on one session:
catch on a 5x3 board (reading the observation tensor to follow the ball), tic-tac-toe
against a seeded random player (with one illegal move, refused), and one hand of Kuhn
poker (a chance node deals the cards; the agent sees only its own).
"""

from __future__ import annotations

import sys

import grpc

from openenv_grpc import EnvError
from openenv_grpc_envs.openspiel import (
    OpenSpielAction,
    OpenSpielEnv,
    OpenSpielResetOptions,
    to_numpy,
)


def main(target: str) -> None:
    with OpenSpielEnv(target) as env:
        # Catch: one player, the ball falls one row per step; move the paddle under it.
        options = OpenSpielResetOptions(game="catch", params={"rows": "5", "columns": "3"})
        result = env.reset(seed=7, options=options)
        board = to_numpy(result.observation.observation_tensor)
        print(f"catch: tensor {board.dtype} {board.shape}, ball in column {board[0].argmax()}")
        while not result.done:
            board = to_numpy(result.observation.observation_tensor)
            ball, paddle = board[:-1].sum(axis=0).argmax(), board[-1].argmax()
            move = "STAY" if ball == paddle else ("LEFT" if ball < paddle else "RIGHT")
            result = env.step(OpenSpielAction(name=move))
        print(f"catch: caught after {result.step_count} steps, reward={result.reward:+.0f}")

        # Tic-tac-toe: the agent is x (player 0); o plays uniformly at random.
        result = env.reset(seed=3, options=OpenSpielResetOptions(game="tic_tac_toe"))
        result = env.step(OpenSpielAction(id=4))  # the centre
        try:
            env.step(OpenSpielAction(id=4))  # taken: refused, and the game goes on
        except EnvError as exc:
            assert exc.code is grpc.StatusCode.INVALID_ARGUMENT
            print(f"tic_tac_toe: {exc.message.split(';')[0]}")
        while not result.done:
            result = env.step(OpenSpielAction(id=result.observation.legal_actions[0].id))
        print(result.observation.observation_string)
        print(f"tic_tac_toe: returns={list(result.observation.returns)}")
        print(f"tic_tac_toe: history={list(env.state().history)}")

        # Kuhn poker: chance deals one card each; the agent sees its own card only.
        result = env.reset(seed=5, options=OpenSpielResetOptions(game="kuhn_poker"))
        observation = result.observation
        print(f"kuhn_poker: info state {observation.information_state_string!r}")
        print(f"kuhn_poker: legal {[a.name for a in observation.legal_actions]}")
        result = env.step(OpenSpielAction(name="Bet"))
        print(f"kuhn_poker: {env.state().state_string!r} reward={result.reward:+.0f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051")
