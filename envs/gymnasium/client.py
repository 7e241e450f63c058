"""Typed clients for the gymnasium environment: ``step`` takes a GymnasiumAction, and so on.

Build actions and read observations with :mod:`openenv_grpc_envs.gymnasium.convert`::

    from openenv_grpc_envs.gymnasium import GymnasiumEnv, GymnasiumResetOptions, convert

    with GymnasiumEnv("127.0.0.1:50051") as env:
        first = env.reset(seed=0, options=GymnasiumResetOptions(env_id="CartPole-v1"))
        action_space = convert.build_space(first.observation.env.action_space)
        result = env.step(GymnasiumAction(value=convert.encode(0, action_space)))
        cart = convert.decode(result.observation.value)  # a float32 ndarray
"""

from openenv_grpc import AsyncSession, AsyncVectorSession, Session, VectorSession
from openenv_grpc.providers.launch import AsyncFromDockerImage, FromDockerImage
from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import (
    GymnasiumAction,
    GymnasiumObservation,
    GymnasiumResetOptions,
    GymnasiumState,
)

__all__ = ["AsyncGymnasiumEnv", "AsyncGymnasiumVectorEnv", "GymnasiumEnv", "GymnasiumVectorEnv"]


class GymnasiumEnv(
    FromDockerImage,
    Session[GymnasiumAction, GymnasiumObservation, GymnasiumState, GymnasiumResetOptions],
):
    """A blocking gymnasium session: ``with GymnasiumEnv("localhost:50051") as env: ...``."""


class AsyncGymnasiumEnv(
    AsyncFromDockerImage,
    AsyncSession[GymnasiumAction, GymnasiumObservation, GymnasiumState, GymnasiumResetOptions],
):
    """An asyncio gymnasium session: ``async with AsyncGymnasiumEnv(channel) as env: ...``."""


class GymnasiumVectorEnv(
    VectorSession[GymnasiumAction, GymnasiumObservation, GymnasiumState, GymnasiumResetOptions]
):
    """N gymnasium envs on one vector stream (``step_batch`` takes the batch form, see
    :mod:`openenv_grpc_envs.gymnasium.batch_convert`); as a ``gymnasium.vector.VectorEnv``:
    :class:`~openenv_grpc_envs.gymnasium.adapters.RemoteGymnasiumVectorEnv`."""


class AsyncGymnasiumVectorEnv(
    AsyncVectorSession[GymnasiumAction, GymnasiumObservation, GymnasiumState, GymnasiumResetOptions]
):
    """N gymnasium envs on one vector stream, for asyncio."""
