"""Typed clients for the openspiel environment, plus a helper to decode its tensors."""

from __future__ import annotations

import math

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

__all__ = ["AsyncOpenSpielEnv", "OpenSpielEnv", "TensorError", "to_numpy"]


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


#: The dtypes a Tensor may name (the server sends float32), and the most dimensions.
_DTYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
     "float16", "float32", "float64"}
)  # fmt: skip
MAX_RANK = 32
#: Most elements an empty tensor's non-zero dimensions may describe (numpy refuses more).
_MAX_EMPTY_ELEMENTS = 2**31


class TensorError(ValueError):
    """A Tensor whose dtype, rank, shape or byte length does not make an array."""


def to_numpy(tensor: Tensor) -> npt.NDArray[np.float32]:
    """A read-only numpy view of ``tensor`` with its shape (no copy of the bytes).

    Raises:
        TensorError: an unknown dtype, more than :data:`MAX_RANK` dimensions, a negative
            or huge dimension, or bytes that do not fill the shape (checked before numpy
            sees the tensor: a hostile shape must not surface as numpy's own error).
    """
    name = tensor.dtype
    if name not in _DTYPES:
        raise TensorError(f"tensor: unknown dtype {name[:64]!r}; one of {sorted(_DTYPES)}")
    rank = len(tensor.shape)
    if rank > MAX_RANK:
        raise TensorError(f"tensor: rank {rank} is over the limit of {MAX_RANK} dimensions")
    shape = tuple(tensor.shape)
    if any(dim < 0 for dim in shape):
        raise TensorError(f"tensor: negative dimension in shape {list(shape)}")
    count = math.prod(shape)
    if count == 0 and math.prod(d for d in shape if d) > _MAX_EMPTY_ELEMENTS:
        raise TensorError(f"tensor: shape {list(shape)} is empty but its dimensions too large")
    dtype = np.dtype(name).newbyteorder("<")
    data = tensor.data
    if len(data) != count * dtype.itemsize:
        raise TensorError(
            f"tensor: {len(data)} bytes of data for shape {list(shape)} {name} "
            f"(expected {count * dtype.itemsize})"
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape)
