"""The wordle env as a TRL environment: one tool, ``guess``."""

from __future__ import annotations

from typing import Any

from openenv_grpc import StepResult
from openenv_grpc.integrations.trl.environment import SessionEnvironment
from openenv_grpc_envs.wordle.v1.wordle_pb2 import WordleAction, WordleObservation

__all__ = ["Wordle"]


class Wordle(SessionEnvironment):
    """Wordle over a session: the reset text is the env's rules and the empty board."""

    async def guess(self, word: str) -> str:
        """Guess the hidden five-letter word.

        Args:
            word: A five-letter English word, for example "crane".

        Returns:
            The feedback on the guess: the board with one row per guess, its letters
            marked G (right letter, right place), Y (in the word, elsewhere) or X (not
            in the word), and the guesses left; or why the guess was refused.
        """
        return await self._act(WordleAction(guess=word))

    def _reset_text(self, result: StepResult[Any]) -> str | None:
        observation: WordleObservation = result.observation
        # The env's prompt asks for free text; over TRL the model calls the tool instead.
        return f"{observation.prompt}\nUse the guess tool for each guess.\n\n{observation.board}"

    def _step_text(self, result: StepResult[Any]) -> str:
        observation: WordleObservation = result.observation
        text = f"{observation.message}\n{observation.board}"
        if result.done:
            outcome = "You won" if observation.won else f"You lost: it was {observation.answer}"
            text += f"\n{outcome}. The game is over."
        return text
