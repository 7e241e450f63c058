"""The openspiel environment passes the conformance suite."""

from __future__ import annotations

import random

from openenv_grpc.testing import EnvConformance
from openenv_grpc_envs.openspiel import (
    OpenSpielAction,
    OpenSpielObservation,
    OpenSpielResetOptions,
)


class TestOpenSpielConformance(EnvConformance):
    env = "openspiel"
    snapshots = True  # the suite fails if Info ever stops claiming them

    def make_action(
        self, observation: OpenSpielObservation, step: int, rng: random.Random
    ) -> OpenSpielAction:
        if not observation.legal_actions:  # the game is over: any well-typed action
            return OpenSpielAction(id=0)
        return OpenSpielAction(id=rng.choice(observation.legal_actions).id)

    def reset_options(self) -> OpenSpielResetOptions:
        # Chance nodes and a random opponent: both must replay from the seed.
        return OpenSpielResetOptions(game="leduc_poker")

    def ending_reset_options(self) -> OpenSpielResetOptions:
        return OpenSpielResetOptions(game="catch")
