"""An env that counts the steps it completed in a file, so a test can hold the server's
step counters (Info's activity, ``/metrics``) against the env's own word."""

from __future__ import annotations

import os
import time

from openenv_grpc import Transition
from openenv_grpc_envs.echo import EchoAction, EchoObservation
from support.envs import CountingEchoEnv


class SlowCountingEnv(CountingEchoEnv):
    """The counting echo env on the thread pool; ``sleep:S`` makes a step take S seconds.
    Each step appends a line to ``<ledger>.steps`` once it is done (O_APPEND: the lines
    of steps on several threads never mix)."""

    runs_inline = False

    def step(self, action: EchoAction) -> Transition[EchoObservation]:
        if action.message.startswith("sleep:"):
            time.sleep(float(action.message.split(":", 1)[1]))
        transition = super().step(action)
        root = os.environ.get("OPENENV_TEST_LEDGER")
        if root:
            with open(f"{root}.steps", "a") as steps:
                steps.write("step\n")
        return transition
