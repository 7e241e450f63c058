"""Typed clients for the coding environment: ``step`` takes a CodingAction, and so on."""

from openenv_grpc import AsyncSession, Session
from openenv_grpc.providers.launch import AsyncFromDockerImage, FromDockerImage
from openenv_grpc_envs.coding.v1.coding_pb2 import (
    CodingAction,
    CodingObservation,
    CodingResetOptions,
    CodingState,
)

__all__ = ["AsyncCodingEnv", "CodingEnv"]


class CodingEnv(
    FromDockerImage, Session[CodingAction, CodingObservation, CodingState, CodingResetOptions]
):
    """A blocking coding session: ``with CodingEnv("localhost:50051") as env: ...``."""


class AsyncCodingEnv(
    AsyncFromDockerImage,
    AsyncSession[CodingAction, CodingObservation, CodingState, CodingResetOptions],
):
    """An asyncio coding session: ``async with AsyncCodingEnv("localhost:50051") as env: ...``."""
