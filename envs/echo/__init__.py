"""The echo environment: the reference environment of openenv-grpc."""

from openenv_grpc_envs.echo.client import AsyncEchoEnv, AsyncEchoVectorEnv, EchoEnv, EchoVectorEnv
from openenv_grpc_envs.echo.environment import EchoEnvironment
from openenv_grpc_envs.echo.v1.echo_pb2 import (
    EchoAction,
    EchoObservation,
    EchoResetOptions,
    EchoState,
)

__all__ = [
    "AsyncEchoEnv",
    "AsyncEchoVectorEnv",
    "EchoAction",
    "EchoEnv",
    "EchoEnvironment",
    "EchoObservation",
    "EchoResetOptions",
    "EchoState",
    "EchoVectorEnv",
]
