"""The coding environment: runs Python code in a sandboxed process and scores it on tests."""

from openenv_grpc_envs.coding.client import AsyncCodingEnv, CodingEnv
from openenv_grpc_envs.coding.environment import CodingEnvironment
from openenv_grpc_envs.coding.limits import CodingSettings
from openenv_grpc_envs.coding.v1.coding_pb2 import (
    CodingAction,
    CodingIoCase,
    CodingLimits,
    CodingObservation,
    CodingResetOptions,
    CodingState,
    CodingTestCase,
    CodingTestResult,
    Limit,
)

__all__ = [
    "AsyncCodingEnv",
    "CodingAction",
    "CodingEnv",
    "CodingEnvironment",
    "CodingIoCase",
    "CodingLimits",
    "CodingObservation",
    "CodingResetOptions",
    "CodingSettings",
    "CodingState",
    "CodingTestCase",
    "CodingTestResult",
    "Limit",
]
