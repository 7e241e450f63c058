"""Echo envs whose results carry an info map of every JSON type, for the info_json tests
(served by real server processes as ``support.info_envs:TypedInfoEcho``).

Reset and every step return :func:`typed_info` of the step count: an int, ints beyond
2^53 and 2^64, a float that looks whole, a bool, None, a string, and nested lists and maps. A step
whose message is ``"nan"`` adds a NaN, which JSON cannot write.
"""

from __future__ import annotations

import math
from typing import Any

from openenv_grpc import Transition
from openenv_grpc_envs.echo import EchoAction, EchoEnvironment, EchoObservation, EchoResetOptions

#: An int no double holds exactly (2^60 + 1).
BIG = 2**60 + 1
#: An int no int64 holds (2^70 + 1).
HUGE = 2**70 + 1


def typed_info(step: int) -> dict[str, Any]:
    """The info of the result with step count ``step``."""
    return {
        "lives": 3,
        "frame": step,
        "big": BIG,
        "negative_big": -BIG,
        "huge": HUGE,
        "ratio": 0.5,
        "whole_float": 2.0,
        "flag": True,
        "nothing": None,
        "name": "typed",
        "nested": {"counts": [1, 2, BIG], "inner": {"x": 7, "y": 1.25}},
        "rows": [[1, 2.5], {"k": False}],
    }


class TypedInfoEcho(EchoEnvironment):
    """Echo whose every result carries :func:`typed_info` (plus a NaN on message "nan")."""

    def reset(
        self, *, seed: int | None, episode_id: str, options: EchoResetOptions | None
    ) -> Transition[EchoObservation]:
        done = super().reset(seed=seed, episode_id=episode_id, options=options)
        return Transition(done.observation, info=typed_info(0))

    def step(self, action: EchoAction) -> Transition[EchoObservation]:
        done = super().step(action)
        info = typed_info(self._steps)
        if action.message == "nan":
            info["loss"] = math.nan
        return Transition(done.observation, done.reward, done.terminated, done.truncated, info=info)
