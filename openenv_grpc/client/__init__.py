"""The trainer's side: sessions (one env, or N on one vector stream), typed results, errors."""

from typing import Any

from openenv_grpc.client.async_session import AsyncSession
from openenv_grpc.client.async_vector_session import AsyncVectorSession
from openenv_grpc.client.channel import aio_channel, sync_channel
from openenv_grpc.client.errors import (
    CapacityError,
    EnvError,
    InfoUnavailable,
    InvalidRequest,
    OpenEnvError,
    PayloadTypeError,
    ProtocolError,
    SessionLost,
    SessionRefused,
    SessionStateError,
    SessionTimeout,
    VectorEnvError,
)
from openenv_grpc.client.info import fetch_info
from openenv_grpc.client.notices import Draining
from openenv_grpc.client.outcome import Restored, StepOutcome
from openenv_grpc.client.recovery import Recovery
from openenv_grpc.client.retry import OpenRetry
from openenv_grpc.client.session_core import SessionOptions, SessionSource
from openenv_grpc.client.sync_session import Session
from openenv_grpc.client.sync_vector_session import VectorSession
from openenv_grpc.client.vector_outcome import VectorOutcome

__all__ = [
    "AsyncSession",
    "AsyncVectorSession",
    "CapacityError",
    "Draining",
    "EnvError",
    "InfoUnavailable",
    "InvalidRequest",
    "OpenEnvError",
    "OpenRetry",
    "PayloadTypeError",
    "ProtocolError",
    "Recovery",
    "Restored",
    "Session",
    "SessionLost",
    "SessionOptions",
    "SessionRefused",
    "SessionSource",
    "SessionStateError",
    "SessionTimeout",
    "StepOutcome",
    "VectorEnvError",
    "VectorOutcome",
    "VectorSession",
    "aio_channel",
    "fetch_info",
    "sync_channel",
]


def __getattr__(name: str) -> Any:
    """``StepResult``: the old name of :class:`StepOutcome` (deprecated: the wire message
    ``openenv_grpc.v1.StepResult`` has that name)."""
    if name == "StepResult":
        import warnings

        warnings.warn(
            "StepResult is now StepOutcome (StepResult is the wire message's name)",
            DeprecationWarning,
            stacklevel=2,
        )
        return StepOutcome
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
