"""Typed clients for the wordle environment: ``step`` takes a WordleAction, and so on."""

from openenv_grpc import AsyncSession, Session
from openenv_grpc.providers.launch import AsyncFromDockerImage, FromDockerImage
from openenv_grpc_envs.wordle.v1.wordle_pb2 import (
    WordleAction,
    WordleObservation,
    WordleResetOptions,
    WordleState,
)

__all__ = ["AsyncWordleEnv", "WordleEnv"]


class WordleEnv(
    FromDockerImage, Session[WordleAction, WordleObservation, WordleState, WordleResetOptions]
):
    """A blocking wordle session: ``with WordleEnv("localhost:50051") as env: ...``."""


class AsyncWordleEnv(
    AsyncFromDockerImage,
    AsyncSession[WordleAction, WordleObservation, WordleState, WordleResetOptions],
):
    """An asyncio wordle session: ``async with AsyncWordleEnv("localhost:50051") as env: ...``."""
