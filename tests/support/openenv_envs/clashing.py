"""An OpenEnv env whose models have fields named like protobuf message methods and
attributes: the described Python client must still work (issue 19)."""

from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class ClashAction(Action):
    SerializeToString: str = ""
    ListFields: int = 0
    plain: str = ""


class ClashObservation(Observation):
    CopyFrom: str = ""
    DESCRIPTOR: int = 0


class ClashEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs: Any) -> ClashObservation:
        return ClashObservation(CopyFrom="ready")

    def step(self, action: ClashAction) -> ClashObservation:  # type: ignore[override]
        return ClashObservation(
            CopyFrom=action.SerializeToString + action.plain, DESCRIPTOR=action.ListFields * 2
        )

    @property
    def state(self) -> State:
        return self._state
