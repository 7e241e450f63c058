"""Typed clients for the echo environment: ``step`` takes an EchoAction, and so on."""

from openenv_grpc import AsyncSession, AsyncVectorSession, Session, VectorSession
from openenv_grpc.providers.launch import AsyncFromDockerImage, FromDockerImage
from openenv_grpc_envs.echo.v1.echo_pb2 import (
    EchoAction,
    EchoObservation,
    EchoResetOptions,
    EchoState,
)

__all__ = ["AsyncEchoEnv", "AsyncEchoVectorEnv", "EchoEnv", "EchoVectorEnv"]


class EchoEnv(FromDockerImage, Session[EchoAction, EchoObservation, EchoState, EchoResetOptions]):
    """A blocking echo session: ``with EchoEnv("localhost:50051") as env: ...``."""


class AsyncEchoEnv(
    AsyncFromDockerImage, AsyncSession[EchoAction, EchoObservation, EchoState, EchoResetOptions]
):
    """An asyncio echo session: ``async with AsyncEchoEnv("localhost:50051") as env: ...``."""


class EchoVectorEnv(VectorSession[EchoAction, EchoObservation, EchoState, EchoResetOptions]):
    """N echo envs on one stream: ``with EchoVectorEnv("localhost:50051", 64) as envs: ...``."""


class AsyncEchoVectorEnv(
    AsyncVectorSession[EchoAction, EchoObservation, EchoState, EchoResetOptions]
):
    """N echo envs on one stream, for asyncio: ``async with AsyncEchoVectorEnv(target, 64)``."""
