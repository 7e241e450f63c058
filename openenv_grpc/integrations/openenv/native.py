"""The door's native lane: a ``/ws`` step of a bridged env served in this process goes to
the env as OpenEnv's own server would send it, with no protobuf on the way.

The frame's action becomes the env's model by OpenEnv's ``deserialize_action`` (MCP
actions recognised by their ``type``; a ``ValidationError`` answered with OpenEnv's
``VALIDATION_ERROR`` frame and its ``errors``), the bridge hands it to the env unchanged
and keeps the observation the env returned (the session's batch is built with
``objects``), and the answer is OpenEnv's ``WSObservationResponse`` of
``serialize_observation``. The session core around it is the same as for any other frame:
admission, the stream loop, the byte budget, deadlines, metrics.

Everything else (resets, state, tools, HTTP routes, an ``--isolated`` server, native
envs) takes the typed path through the env's protobuf messages.
"""

from __future__ import annotations

import json
from typing import Any

from openenv.core.env_server.serialization import deserialize_action, serialize_observation
from openenv.core.env_server.types import WSErrorCode, WSErrorResponse, WSObservationResponse
from pydantic import BaseModel, ValidationError

from openenv_grpc.integrations.openenv.json_checks import Warnings, safe_jsonable
from openenv_grpc.integrations.openenv.published import action_model

__all__ = ["NativeLane", "native_lane"]


class NativeLane:
    """OpenEnv's own conversions for one bridged env (its action model as OpenEnv's server
    holds it)."""

    def __init__(self, action: type[BaseModel]) -> None:
        self._action = action

    def action(self, data: Any) -> BaseModel:
        """The env's action for a step frame's data.

        Raises:
            ValidationError: the model refuses it (answer :meth:`invalid`).
        """
        action: BaseModel = deserialize_action(data, self._action)
        return action

    @staticmethod
    def frame(observation: BaseModel) -> str:
        """The observation frame OpenEnv writes for ``observation``; what pydantic cannot
        write (a lone surrogate, an odd object) is written as ``null``."""
        data = serialize_observation(observation)
        try:
            text: str = WSObservationResponse(data=data).model_dump_json()
            return text
        except Exception:  # the env has moved: answer what can be written
            clean = safe_jsonable(data, "observation", Warnings())
            return json.dumps({"type": "observation", "data": clean})

    @staticmethod
    def invalid(exc: ValidationError) -> str:
        """OpenEnv's answer to an action its model refused."""
        data = {"message": "Invalid message", "code": WSErrorCode.VALIDATION_ERROR}
        try:
            text: str = WSErrorResponse(data={**data, "errors": exc.errors()}).model_dump_json()
        except Exception:  # an error's context pydantic cannot write
            errors = exc.errors(include_url=False, include_context=False, include_input=False)
            text = WSErrorResponse(data={**data, "errors": errors}).model_dump_json()
        return text


def native_lane(env_name: str) -> NativeLane | None:
    """The lane of the bridged env ``env_name`` served in this process (None: no such env)."""
    model = action_model(env_name)
    return None if model is None else NativeLane(model)
