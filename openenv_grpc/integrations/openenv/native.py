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
from openenv.core.env_server.types import (
    WSErrorCode,
    WSErrorResponse,
    WSObservationResponse,
    WSStepMessage,
)
from pydantic import BaseModel, ValidationError

from openenv_grpc.integrations.openenv.json_checks import WARNINGS_KEY, Warnings, safe_jsonable
from openenv_grpc.integrations.openenv.published import action_model

__all__ = ["MAX_ECHOED_BYTES", "MAX_ERRORS", "NativeLane", "native_lane"]


#: Validation errors listed in a refusal, at most (a frame of 600,000 unknown fields has
#: as many: listing each would build an answer 14 times the frame's size).
MAX_ERRORS = 16
#: Errors past which none is listed at all (listing them costs ~5 µs each on the loop).
_MANY_ERRORS = 1000
#: A refusal lists what each error refused (its ``input``, as OpenEnv does) while the
#: frame times the errors stays under this (a frame's characters counted as 4 bytes each:
#: UTF-8's most); else the inputs are left out.
MAX_ECHOED_BYTES = 64 * 1024


class NativeLane:
    """OpenEnv's own conversions for one bridged env (its action model as OpenEnv's server
    holds it)."""

    def __init__(self, action: type[BaseModel]) -> None:
        self._action = action

    def action(self, data: Any) -> BaseModel:
        """The env's action for a step frame's data, as OpenEnv's server makes it (the
        frame's ``data`` must be an object, then the model validates it).

        Raises:
            ValidationError: the frame or the model refuses it (answer :meth:`invalid`).
        """
        if not isinstance(data, dict):
            WSStepMessage.model_validate({"type": "step", "data": data})  # raises
        action: BaseModel = deserialize_action(data, self._action)
        return action

    @staticmethod
    def frame(observation: BaseModel) -> str:
        """The observation frame OpenEnv writes for ``observation``. The env has moved:
        what pydantic cannot write (a lone surrogate, a serializer that raises) is
        written field by field, as null where JSON cannot hold it (named in the
        metadata's ``bridge_warnings``), never an error."""
        try:
            text: str = WSObservationResponse(
                data=serialize_observation(observation)
            ).model_dump_json()
            return text
        except Exception:
            return json.dumps({"type": "observation", "data": _written(observation)})

    @staticmethod
    def invalid(exc: ValidationError, frame_chars: int) -> str:
        """OpenEnv's answer to an action refused in a frame of ``frame_chars`` characters:
        its ``VALIDATION_ERROR`` with pydantic's errors, bounded (:data:`MAX_ERRORS`,
        :data:`MAX_ECHOED_BYTES`)."""
        count = exc.error_count()
        data: dict[str, Any] = {"message": "Invalid message", "code": WSErrorCode.VALIDATION_ERROR}
        if count > _MANY_ERRORS:
            data["errors"] = [{"type": "too_many_errors", "loc": [], "msg": (
                f"{count} validation errors for {exc.title}: none listed")}]  # fmt: skip
        else:
            echoed = count * frame_chars * 4 <= MAX_ECHOED_BYTES
            data["errors"] = exc.errors(include_input=echoed)[:MAX_ERRORS]
            if count > MAX_ERRORS:
                data["errors"].append({"type": "too_many_errors", "loc": [], "msg": (
                    f"{count} validation errors for {exc.title}: the first "
                    f"{MAX_ERRORS} listed")})  # fmt: skip
        try:
            text: str = WSErrorResponse(data=data).model_dump_json()
        except Exception:  # an error's context pydantic cannot write
            errors = exc.errors(include_url=False, include_context=False, include_input=False)
            text = WSErrorResponse(data={**data, "errors": errors[:MAX_ERRORS]}).model_dump_json()
        return text


def _written(observation: BaseModel) -> dict[str, Any]:
    """``serialize_observation``'s answer, field by field (no serializer of the model's
    runs), what JSON cannot hold as null."""
    warnings = Warnings()
    fields = {
        name: getattr(observation, name)
        for name in type(observation).model_fields
        if name not in ("reward", "done")
    }
    written = safe_jsonable(fields, "observation", warnings)
    data = {
        "observation": written,
        "reward": safe_jsonable(getattr(observation, "reward", None), "reward", warnings),
        "done": bool(getattr(observation, "done", False)),
    }
    metadata = dict(written.get("metadata") or {})
    if warnings:
        metadata[WARNINGS_KEY] = list(dict.fromkeys(warnings))
    if metadata:
        data["metadata"] = metadata
    return data


def native_lane(env_name: str) -> NativeLane | None:
    """The lane of the bridged env ``env_name`` served in this process (None: no such env)."""
    model = action_model(env_name)
    return None if model is None else NativeLane(model)
