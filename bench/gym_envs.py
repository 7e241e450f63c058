"""The gymnasium env with its calls pinned to the event loop, for ``bench.gym_session``
(served as ``bench.gym_envs:InlineGymnasiumEnvironment``): the inline bound a measured
placement is compared with."""

from __future__ import annotations

from openenv_grpc_envs.gymnasium.environment import GymnasiumEnvironment

__all__ = ["InlineGymnasiumEnvironment"]


class InlineGymnasiumEnvironment(GymnasiumEnvironment):
    """Every call on the event loop, whatever it costs."""

    runs_inline = True
