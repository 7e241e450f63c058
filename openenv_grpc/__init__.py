"""openenv-grpc: reinforcement-learning environments served over gRPC.

Environment builders subclass :class:`Environment` (or :class:`AsyncEnvironment`) and
serve it with :func:`serve`; trainers open a :class:`Session` (or :class:`AsyncSession`),
or a :class:`VectorSession` (:class:`AsyncVectorSession`) of N envs on one stream.
"""

from typing import Any

from openenv_grpc._version import __version__
from openenv_grpc.client import (
    AsyncSession,
    AsyncVectorSession,
    CapacityError,
    EnvError,
    OpenEnvError,
    OpenRetry,
    PayloadTypeError,
    ProtocolError,
    Session,
    SessionLost,
    SessionRefused,
    SessionStateError,
    SessionTimeout,
    StepOutcome,
    VectorEnvError,
    VectorOutcome,
    VectorSession,
    fetch_info,
)
from openenv_grpc.codec import frame_array
from openenv_grpc.environment import (
    AsyncEnvironment,
    AutoresetMode,
    BatchEnvironment,
    BatchTransition,
    Environment,
    InvalidAction,
    Transition,
)
from openenv_grpc.server import EnvServer, ServerConfig, serve

__all__ = [
    "AsyncEnvironment",
    "AsyncSession",
    "AsyncVectorSession",
    "AutoresetMode",
    "BatchEnvironment",
    "BatchTransition",
    "CapacityError",
    "EnvError",
    "EnvServer",
    "Environment",
    "InvalidAction",
    "OpenEnvError",
    "OpenRetry",
    "PayloadTypeError",
    "ProtocolError",
    "ServerConfig",
    "Session",
    "SessionLost",
    "SessionRefused",
    "SessionStateError",
    "SessionTimeout",
    "StepOutcome",
    "Transition",
    "VectorEnvError",
    "VectorOutcome",
    "VectorSession",
    "__version__",
    "fetch_info",
    "frame_array",
    "serve",
]


def __getattr__(name: str) -> Any:
    """``StepResult``, the deprecated name of :class:`StepOutcome`."""
    if name == "StepResult":
        from openenv_grpc import client

        return client.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
