"""The trainer's side: sessions, typed results, errors."""

from openenv_grpc.client.async_session import AsyncSession
from openenv_grpc.client.channel import aio_channel, sync_channel
from openenv_grpc.client.errors import (
    CapacityError,
    EnvError,
    OpenEnvError,
    ProtocolError,
    SessionLost,
    SessionRefused,
)
from openenv_grpc.client.info import fetch_info
from openenv_grpc.client.protocol import StepResult
from openenv_grpc.client.retry import OpenRetry
from openenv_grpc.client.sync_session import Session

__all__ = [
    "AsyncSession",
    "CapacityError",
    "EnvError",
    "OpenEnvError",
    "OpenRetry",
    "ProtocolError",
    "Session",
    "SessionLost",
    "SessionRefused",
    "StepResult",
    "aio_channel",
    "fetch_info",
    "sync_channel",
]
