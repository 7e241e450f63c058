"""The gymnasium environment: any registered Gymnasium env over gRPC, chosen at reset."""

from openenv_grpc_envs.gymnasium import convert
from openenv_grpc_envs.gymnasium.client import (
    AsyncGymnasiumEnv,
    AsyncGymnasiumVectorEnv,
    GymnasiumEnv,
    GymnasiumVectorEnv,
)
from openenv_grpc_envs.gymnasium.environment import ENV_ID_VARIABLE, GymnasiumEnvironment
from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import (
    EnvDescription,
    GymnasiumAction,
    GymnasiumObservation,
    GymnasiumResetOptions,
    GymnasiumState,
    Space,
    Tensor,
    Value,
)

__all__ = [
    "ENV_ID_VARIABLE",
    "AsyncGymnasiumEnv",
    "AsyncGymnasiumVectorEnv",
    "EnvDescription",
    "GymnasiumAction",
    "GymnasiumEnv",
    "GymnasiumEnvironment",
    "GymnasiumObservation",
    "GymnasiumResetOptions",
    "GymnasiumState",
    "GymnasiumVectorEnv",
    "Space",
    "Tensor",
    "Value",
    "convert",
]
