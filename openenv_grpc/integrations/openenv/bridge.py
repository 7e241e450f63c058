"""Conversions between one OpenEnv env's calls and openenv-grpc's messages (reset
keyword arguments, actions, observations as transitions, state)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from google.protobuf.message import Message
from pydantic import BaseModel, ValidationError

from openenv_grpc.environment import InvalidAction, Transition
from openenv_grpc.integrations.openenv.convert import to_message, to_python
from openenv_grpc.integrations.openenv.json_checks import WARNINGS_KEY, Warnings, safe_jsonable
from openenv_grpc.integrations.openenv.schema import JSON, ModelPlan, UnionPlan
from openenv_grpc.integrations.openenv.signatures import reset_method

__all__ = ["Bridge"]


class Bridge:
    """Conversions for one env class, shared by its sync and async adapters."""

    def __init__(
        self,
        env_class: type[Any],
        found: Any,
        action: ModelPlan | UnionPlan,
        observation: ModelPlan | UnionPlan,
        state: ModelPlan,
        options: ModelPlan,
        factory: Callable[[], Any] | None = None,
    ) -> None:
        self.env_class = env_class
        #: What makes one env: the class, or the factory the env's app was given.
        self.factory: Callable[[], Any] = factory or env_class
        self.found = found
        self.action = action
        self.observation = observation
        self.state = state
        self.options = options
        parameters = inspect.signature(reset_method(env_class)[0]).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        self.takes_seed = takes_any or "seed" in parameters
        self.takes_episode_id = takes_any or "episode_id" in parameters
        self.kwargs_field = next(
            (
                f.name
                for f in options.fields
                if f.name in ("kwargs", "extra_kwargs") and f.kind == JSON
            ),
            None,
        )

    def reset_kwargs(
        self, seed: int | None, episode_id: str, options: Message | None
    ) -> dict[str, Any]:
        """Raises InvalidAction: a JSON option is not JSON, or ``kwargs`` no object."""
        kwargs: dict[str, Any] = {}
        if options is not None:
            try:
                _, kwargs = to_python(self.options, options)
            except ValueError as exc:
                raise InvalidAction(f"invalid reset options: {exc}") from None
            if self.kwargs_field is not None:  # **kwargs: its JSON object's keys, as they are
                extra = kwargs.pop(self.kwargs_field, None)
                if extra is not None and not isinstance(extra, dict):
                    raise InvalidAction(
                        f"invalid reset options: {self.kwargs_field}: a JSON object of "
                        f"keyword arguments, got {type(extra).__name__}"
                    )
                kwargs.update(extra or {})
        if seed is not None and self.takes_seed:
            kwargs["seed"] = seed
        if self.takes_episode_id:
            kwargs["episode_id"] = episode_id
        return kwargs

    def action_in(self, message: Message | BaseModel) -> BaseModel:
        """The action as the env's model, checked before the env sees it (the door's native
        lane hands over a model OpenEnv's own ``deserialize_action`` made: as it is).

        Raises:
            InvalidAction: the env's model refuses the action, or a JSON field of it is not
                JSON, nested too deep or holds a lone surrogate (the bridge could not
                carry it back: see :mod:`.json_checks`).
        """
        if isinstance(message, BaseModel):
            return message
        try:
            model, data = to_python(self.action, message)
            return model.model_validate(data)
        except (ValidationError, ValueError) as exc:
            raise InvalidAction(_validation_message(exc)) from None

    def transition(self, observation: Any, native: bool = False) -> Transition[Any]:
        """The env's observation as a result. The env has moved: nothing in its answer
        may fail the step. What JSON or protobuf cannot hold is replaced by null (NaN and
        infinities silently, as OpenEnv writes them; the rest named in the info's
        ``bridge_warnings`` and the server's log). ``native`` (a step of the door's native
        lane): the observation is kept as the env returned it, its frame written from it.

        Raises:
            TypeError: the env returned no Observation (an env bug).
        """
        if not isinstance(observation, BaseModel):
            raise TypeError(
                f"{self.env_class.__qualname__} returned {type(observation).__name__}, "
                "not an Observation"
            )
        reward = getattr(observation, "reward", None)
        if native:
            return Transition(
                observation,
                reward=None if reward is None else float(reward),
                terminated=bool(getattr(observation, "done", False)),
            )
        metadata = getattr(observation, "metadata", None)
        warnings = Warnings()
        message = to_message(self.observation, observation, warnings)
        info = safe_jsonable(metadata, "metadata", warnings) if metadata else None
        if warnings:
            info = {**(info or {}), WARNINGS_KEY: list(dict.fromkeys(warnings))}
        return Transition(
            message,
            reward=None if reward is None else float(reward),  # None: no reward, as given
            terminated=bool(getattr(observation, "done", False)),
            info=info,
        )

    def state_out(self, env: Any) -> Message:
        """The env's state as its message; what cannot be held is left out (logged)."""
        state = env.state
        if callable(state):  # an env that made state a method instead of a property
            state = state()
        if isinstance(state, BaseModel) and not isinstance(state, self.state.python):
            state = self.state.python.model_validate(state.model_dump())
        return to_message(self.state, state, Warnings(), "state")


def _validation_message(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        parts = [
            f"{'.'.join(str(p) for p in error['loc']) or 'action'}: {error['msg']}"
            for error in exc.errors()
        ]
        return f"invalid {exc.title}: " + "; ".join(parts)
    return str(exc)
