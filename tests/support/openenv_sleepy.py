"""A sync OpenEnv env whose ``step`` sleeps the seconds its action asks for (issue 19:
the step timeout under ``--isolated`` must hold for bridged envs too, however long the
killed worker's replacement takes to start)."""

import os
import time
from typing import Any
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class SleepAction(Action):
    seconds: float = 0.0


class SleepObservation(Observation):
    slept: float = 0.0


class SleepyEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        # While ``$SLEEPY_GATE.hold`` exists, a new env waits until ``$SLEEPY_GATE`` does:
        # a test holds the replacement of a killed worker's env this way.
        gate = os.environ.get("SLEEPY_GATE")
        if gate and os.path.exists(f"{gate}.hold"):
            with open(f"{gate}.entered", "w"):
                pass
            deadline = time.monotonic() + 120
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.01)
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs: Any) -> SleepObservation:  # type: ignore[no-untyped-def]
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return SleepObservation()

    def step(self, action: SleepAction) -> SleepObservation:  # type: ignore[override]
        time.sleep(action.seconds)
        self._state.step_count += 1
        return SleepObservation(slept=action.seconds)

    @property
    def state(self) -> State:
        return self._state
