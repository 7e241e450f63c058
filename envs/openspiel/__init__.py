"""The openspiel environment: any OpenSpiel game by name, served over gRPC."""

from openenv_grpc_envs.openspiel.client import AsyncOpenSpielEnv, OpenSpielEnv, to_numpy
from openenv_grpc_envs.openspiel.environment import OpenSpielEnvironment
from openenv_grpc_envs.openspiel.v1.openspiel_pb2 import (
    CONTROL_MODE_AGENT_VS_RANDOM,
    CONTROL_MODE_ALL_PLAYERS,
    CONTROL_MODE_UNSPECIFIED,
    ControlMode,
    LegalAction,
    OpenSpielAction,
    OpenSpielObservation,
    OpenSpielResetOptions,
    OpenSpielState,
    Tensor,
)

__all__ = [
    "CONTROL_MODE_AGENT_VS_RANDOM",
    "CONTROL_MODE_ALL_PLAYERS",
    "CONTROL_MODE_UNSPECIFIED",
    "AsyncOpenSpielEnv",
    "ControlMode",
    "LegalAction",
    "OpenSpielAction",
    "OpenSpielEnv",
    "OpenSpielEnvironment",
    "OpenSpielObservation",
    "OpenSpielResetOptions",
    "OpenSpielState",
    "Tensor",
    "to_numpy",
]
