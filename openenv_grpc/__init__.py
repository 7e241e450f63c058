"""openenv-grpc: reinforcement-learning environments served over gRPC.

Environment builders subclass :class:`Environment` (or :class:`AsyncEnvironment`) and
serve it with :func:`serve`; trainers open a :class:`Session` (or :class:`AsyncSession`).
"""

from openenv_grpc._version import __version__
from openenv_grpc.client import (
    AsyncSession,
    CapacityError,
    EnvError,
    OpenEnvError,
    OpenRetry,
    ProtocolError,
    Session,
    SessionLost,
    SessionRefused,
    StepResult,
    fetch_info,
)
from openenv_grpc.environment import (
    AsyncEnvironment,
    Environment,
    InvalidAction,
    Transition,
)
from openenv_grpc.server import EnvServer, ServerConfig, serve

__all__ = [
    "AsyncEnvironment",
    "AsyncSession",
    "CapacityError",
    "EnvError",
    "EnvServer",
    "Environment",
    "InvalidAction",
    "OpenEnvError",
    "OpenRetry",
    "ProtocolError",
    "ServerConfig",
    "Session",
    "SessionLost",
    "SessionRefused",
    "StepResult",
    "Transition",
    "__version__",
    "fetch_info",
    "serve",
]
