"""An OpenEnv env whose step's reward is the action's ``score``, None included, and whose
reset gives none (OpenEnv's ``Observation.reward`` default): issue 37's "a reward of
None stays None"."""

from typing import Any
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class ScoreAction(Action):
    """The reward the step is to give (None: no reward)."""

    score: float | None = Field(default=None, description="The step's reward, or none")


class ScoreObservation(Observation):
    """How many steps this episode took."""

    steps: int = Field(default=0, description="Steps taken in this episode")


class ScoreEnvironment(Environment):
    """Rewards what it is told; a reset rewards nothing (reward None)."""

    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self) -> None:
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> ScoreObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return ScoreObservation(steps=0)

    def step(self, action: ScoreAction) -> ScoreObservation:  # type: ignore[override]
        self._state.step_count += 1
        return ScoreObservation(steps=self._state.step_count, reward=action.score)

    @property
    def state(self) -> State:
        return self._state
