"""The wordle environment: find a hidden five-letter word from per-letter feedback."""

from openenv_grpc_envs.wordle.client import AsyncWordleEnv, WordleEnv
from openenv_grpc_envs.wordle.environment import (
    ALLOWED,
    ANSWERS,
    WordleEnvironment,
    extract_guess,
    render_board,
    score_guess,
)
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
    "AsyncWordleEnv",
    "GuessResult",
    "LetterScore",
    "WordleAction",
    "WordleEnv",
    "WordleEnvironment",
    "WordleObservation",
    "WordleResetOptions",
    "WordleState",
    "extract_guess",
    "render_board",
    "score_guess",
]
