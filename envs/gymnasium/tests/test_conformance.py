"""The gymnasium environment passes the conformance suite, on small and large observations."""

from __future__ import annotations

import random
from typing import ClassVar

from openenv_grpc.testing import EnvConformance
from openenv_grpc_envs.gymnasium import (
    GymnasiumAction,
    GymnasiumObservation,
    GymnasiumResetOptions,
    Value,
)


class TestCartPoleConformance(EnvConformance):
    """CartPole chosen in the reset options; a step limit ends the ending episode."""

    env = "gymnasium"
    snapshots = True  # the suite fails if Info ever stops claiming them

    def make_action(
        self, observation: GymnasiumObservation, step: int, rng: random.Random
    ) -> GymnasiumAction:
        return GymnasiumAction(value=Value(discrete=rng.randrange(2)))

    def reset_options(self) -> GymnasiumResetOptions:
        return GymnasiumResetOptions(env_id="CartPole-v1")

    def ending_reset_options(self) -> GymnasiumResetOptions:
        return GymnasiumResetOptions(env_id="CartPole-v1", max_episode_steps=5)


class TestPongConformance(EnvConformance):
    """Atari frames (100,800 bytes each), with the env id from the server's GYM_ENV_ID."""

    env = "gymnasium"
    snapshots = True  # the suite fails if Info ever stops claiming them
    server_env: ClassVar[dict[str, str]] = {"GYM_ENV_ID": "ALE/Pong-v5"}
    steps = 4
    concurrent_sessions = 3

    def make_action(
        self, observation: GymnasiumObservation, step: int, rng: random.Random
    ) -> GymnasiumAction:
        return GymnasiumAction(value=Value(discrete=rng.randrange(6)))

    def ending_reset_options(self) -> GymnasiumResetOptions:
        # An empty env_id keeps the default; the step limit ends the episode.
        return GymnasiumResetOptions(max_episode_steps=3)
