"""The coding environment passes the conformance suite."""

from __future__ import annotations

import os
import random
from pathlib import Path

from openenv_grpc.testing import EnvConformance, ServerProcess
from openenv_grpc_envs.coding import (
    CodingAction,
    CodingLimits,
    CodingObservation,
    CodingResetOptions,
)


class TestCodingConformance(EnvConformance):
    env = "coding"
    snapshots = True  # the suite fails if Info ever stops claiming them
    # Observations carry wall and CPU seconds, which differ run to run: the seeded and
    # isolation checks compare the rest (see comparable).
    deterministic = False

    def comparable(self, observation: CodingObservation) -> CodingObservation:  # type: ignore[override]
        kept = CodingObservation()
        kept.CopyFrom(observation)
        kept.ClearField("wall_seconds")
        kept.ClearField("cpu_seconds")
        return kept

    def make_action(
        self, observation: CodingObservation, step: int, rng: random.Random
    ) -> CodingAction:
        return CodingAction(code=f"print({rng.randrange(1000)} * 2)")

    def reset_options(self) -> CodingResetOptions:
        return CodingResetOptions(limits=CodingLimits(wall_ms=5000))

    def ending_reset_options(self) -> CodingResetOptions:
        return CodingResetOptions(max_steps=3)

    def check_released(self, server: ServerProcess) -> None:
        # Every sandbox's directory tree is gone, and so is every process it ran.
        pid = server.proc.pid
        server.wait_until(
            lambda: not list(Path("/tmp").glob(f"openenv-coding-{pid}-*")),
            what="sandbox directories removed",
        )
        server.wait_until(lambda: not _children(pid), what="sandbox processes gone")


def _children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z" and int(fields[1]) == pid:
            found.append(int(name))
    return found
