"""An OpenEnv env that tells which modules its process has loaded: a step's message names
a module; the observation says ``loaded`` or ``absent`` (and the process id)."""

import os
import sys
from typing import Any
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

from support.openenv_envs.echo import EchoAction, EchoObservation


class LoadedModulesEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self) -> None:
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any):
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return EchoObservation(echoed_message=str(os.getpid()), done=False, reward=0.0)

    def step(self, action: EchoAction) -> EchoObservation:  # type: ignore[override]
        self._state.step_count += 1
        loaded = sys.modules.get(action.message) is not None
        return EchoObservation(echoed_message="loaded" if loaded else "absent", reward=0.0)

    @property
    def state(self) -> State:
        return self._state
