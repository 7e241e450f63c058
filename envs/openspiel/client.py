"""Typed clients for the openspiel environment, plus a helper to decode its tensors."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from openenv_grpc import AsyncSession, Session
from openenv_grpc.providers.launch import AsyncFromDockerImage, FromDockerImage
from openenv_grpc_envs.openspiel.v1.openspiel_pb2 import (
    OpenSpielAction,
    OpenSpielObservation,
    OpenSpielResetOptions,
    OpenSpielState,
    Tensor,
)

__all__ = ["AsyncOpenSpielEnv", "OpenSpielEnv", "to_numpy"]


class OpenSpielEnv(
    FromDockerImage,
    Session[OpenSpielAction, OpenSpielObservation, OpenSpielState, OpenSpielResetOptions],
):
    """A blocking openspiel session: ``with OpenSpielEnv("localhost:50051") as env: ...``."""


class AsyncOpenSpielEnv(
    AsyncFromDockerImage,
    AsyncSession[OpenSpielAction, OpenSpielObservation, OpenSpielState, OpenSpielResetOptions],
):
    """An asyncio openspiel session: ``async with AsyncOpenSpielEnv(channel) as env: ...``."""


def to_numpy(tensor: Tensor) -> npt.NDArray[np.float32]:
    """A read-only numpy view of ``tensor`` with its shape (no copy of the bytes)."""
    return np.frombuffer(tensor.data, dtype=np.dtype(tensor.dtype).newbyteorder("<")).reshape(
        tuple(tensor.shape)
    )
