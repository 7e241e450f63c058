"""An OpenEnv env whose observation pydantic cannot always write: its ``text`` field's
serializer raises for the text "unwritable", and the text "unrepresentable" puts an
object whose ``repr`` raises in ``extra`` (the env has moved all the same). A text
"twice:X" comes back as XX."""

from typing import Any
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import field_serializer


class OddAction(Action):
    text: str


class Unrepresentable:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class OddObservation(Observation):
    text: str = ""
    extra: Any = None

    @field_serializer("text")
    def _text(self, value: str) -> str:
        if value == "unwritable":
            raise ValueError("this text cannot be written")
        return value


class OddEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self) -> None:
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> OddObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return OddObservation(text="ready", reward=0.0)

    def step(self, action: OddAction) -> OddObservation:  # type: ignore[override]
        self._state.step_count += 1
        text = action.text
        if text.startswith("twice:"):
            text = text.removeprefix("twice:") * 2
        extra = Unrepresentable() if text == "unrepresentable" else None
        return OddObservation(text=text, extra=extra, reward=1.0)

    @property
    def state(self) -> State:
        return self._state
