"""Envs whose factory or ``close()`` hangs until a test lets them go (issue 19, breaks 4
and 8): each waits at a gate, a file the test creates when it chooses, so the tests
assert on events (who got in while a close hung) rather than on a clock.

``gate-close:PATH`` (a step) makes that env's ``close()`` leave ``PATH.<id>.entered`` and
block until ``PATH`` exists (at most 120 s). :class:`GatedFactoryEnv`'s factory does the
same with ``<ledger>.factory-gate`` while ``<ledger>.hold-factory`` exists.
"""

from __future__ import annotations

import os
import time
import uuid

from support.envs import FaultyEnv

__all__ = ["GatedCloseEnv", "GatedFactoryEnv", "wait_at_gate"]


def wait_at_gate(path: str, seconds: float = 120.0) -> None:
    """Leave ``path.<id>.entered``, then block until ``path`` exists."""
    with open(f"{path}.{uuid.uuid4().hex[:8]}.entered", "w"):
        pass
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gate {path} never opened")
        time.sleep(0.005)


class GatedCloseEnv(FaultyEnv):
    """FaultyEnv (pooled) whose ``close()`` waits at a gate after a ``gate-close:PATH`` step."""

    def __init__(self) -> None:
        super().__init__()
        self._close_gate: str | None = None

    def step(self, action):  # type: ignore[no-untyped-def]
        if action.message.startswith("gate-close:"):
            self._close_gate = action.message.split(":", 1)[1]
        return super().step(action)

    def close(self) -> None:
        if self._close_gate is not None:
            wait_at_gate(self._close_gate)
        super().close()


class GatedFactoryEnv(FaultyEnv):
    """FaultyEnv whose factory waits at ``<ledger>.factory-gate`` while
    ``<ledger>.hold-factory`` exists (the env is recorded in the ledger once made)."""

    def __init__(self) -> None:
        root = os.environ.get("OPENENV_TEST_LEDGER", "")
        if os.path.exists(f"{root}.hold-factory"):
            wait_at_gate(f"{root}.factory-gate")
        super().__init__()
