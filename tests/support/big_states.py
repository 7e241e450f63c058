"""An env whose every state is large, and which counts its ``state()`` calls, for the
vector tests that bound what one small state command makes the server build."""

from __future__ import annotations

import os

from openenv_grpc_envs.echo import EchoState
from support.envs import CountingEchoEnv

#: Characters in each state (one history entry).
STATE_CHARS = 10_000


class BigStateEchoEnv(CountingEchoEnv):
    """The counting echo env whose state is :data:`STATE_CHARS` bytes; each ``state()``
    call appends a line to ``<ledger>.states``."""

    def state(self) -> EchoState:
        root = os.environ.get("OPENENV_TEST_LEDGER")
        if root:
            with open(f"{root}.states", "a") as calls:
                calls.write("state\n")
        return EchoState(total_length=STATE_CHARS, history=["s" * STATE_CHARS])
