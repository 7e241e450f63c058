"""The echo environment passes the conformance suite."""

from __future__ import annotations

import random

from openenv_grpc.testing import EnvConformance
from openenv_grpc_envs.echo import EchoAction, EchoObservation, EchoResetOptions


class TestEchoConformance(EnvConformance):
    env = "echo"
    snapshots = True  # the suite fails if Info ever stops claiming them

    def make_action(
        self, observation: EchoObservation, step: int, rng: random.Random
    ) -> EchoAction:
        return EchoAction(message=f"{observation.echoed_message[:8]}-{rng.randrange(1000)}")

    def ending_reset_options(self) -> EchoResetOptions:
        return EchoResetOptions(max_steps=5)
