"""An OpenEnv env that echoes a JSON field (``Any``: carried as JSON text by the bridge)
back in its observation and its metadata, written as OpenEnv's docs teach. It counts its
own steps (``state.step_count``), so a test can tell whether the env moved. Asked to, it
puts NaN and infinity into its metadata and observation, or a lone surrogate in a plain
string field."""

from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class JsonAction(Action):
    data: Any = None
    text: str = ""
    #: What the env should make: "" (echo), "nan" (non-finite floats), "surrogate"
    #: (a lone surrogate in its plain string field), "deep" (a 300-deep value).
    make: str = ""


class JsonObservation(Observation):
    data: Any = None
    text: str = ""
    steps: int = 0


def _deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


class JsonEchoEnvironment(Environment[JsonAction, JsonObservation, State]):
    """Echo the action's JSON back."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> JsonObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return JsonObservation(reward=0.0, data=kwargs or None)

    def step(self, action: JsonAction) -> JsonObservation:  # type: ignore[override]
        self._state.step_count += 1
        data, text = action.data, action.text
        metadata: dict[str, Any] = {"data": data, "steps": self._state.step_count}
        if action.make == "nan":
            data = {"nan": float("nan"), "inf": [float("inf"), -float("inf")], "one": 1.5}
            metadata["score"] = float("nan")
        elif action.make == "surrogate":
            text = "bad \ud800 text"
            data = {"key": "\udfff"}
        elif action.make == "deep":
            data = _deep(300)
            metadata["data"] = data
        return JsonObservation(
            data=data,
            text=text,
            steps=self._state.step_count,
            reward=1.0,
            metadata=metadata,
        )

    @property
    def state(self) -> State:
        return self._state
