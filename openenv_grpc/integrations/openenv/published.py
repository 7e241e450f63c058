"""What the OpenEnv door publishes about a bridged env, as OpenEnv's own server does.

OpenEnv's ``/schema`` is the JSON Schema of the env's own pydantic models
(``model_json_schema()`` of the action, observation and state classes its app was
created with) and its ``/metadata`` the env's own ``get_metadata()``. For an env served
with ``serve --openenv`` those models and the env are in this process (the adapter made
by :func:`~openenv_grpc.integrations.openenv.openenv_environment`, found by the name Info
reports), so the door answers with exactly those, not with schemas read off protobuf
descriptors. Native envs have no such models: both functions return None for them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from pydantic import BaseModel

__all__ = ["action_model", "openenv_metadata", "openenv_schemas"]

log = logging.getLogger(__name__)


def _adapter(env_name: str) -> Any | None:
    """The bridged adapter class serving ``env_name`` in this process, if any."""
    try:
        from openenv_grpc.integrations.openenv.environment import BRIDGED
    except ImportError:  # no openenv extra: no bridged envs
        return None
    return BRIDGED.get(env_name)


def _model(given: Any, found: Any) -> type[BaseModel]:
    """The model OpenEnv's server holds for a role: the one its app was given, else the
    one read off the env class (the first of a union)."""
    if isinstance(given, type) and issubclass(given, BaseModel):
        return given
    return found[0] if isinstance(found, tuple) else found  # type: ignore[no-any-return]


@functools.cache
def openenv_schemas(env_name: str) -> dict[str, Any] | None:
    """``/schema`` as OpenEnv's ``HTTPEnvServer`` answers it for the bridged env
    ``env_name`` (None: it is no bridged env)."""
    adapter = _adapter(env_name)
    if adapter is None:
        return None
    _env, action, observation, state, _name = adapter._recipe
    found = adapter._bridge.found
    observation_model = _model(observation, found.observation)
    return {
        "action": _model(action, found.action).model_json_schema(),
        "observation": observation_model.model_json_schema(),
        "state": _model(state, found.state).model_json_schema(),
        "reset_observation": observation_model.model_json_schema(),
    }


def action_model(env_name: str) -> type[BaseModel] | None:
    """The action model OpenEnv's server holds for the bridged env ``env_name`` (what its
    ``/ws`` steps validate with), None for a native env."""
    adapter = _adapter(env_name)
    if adapter is None:
        return None
    return _model(adapter._recipe[1], adapter._bridge.found.action)


_metadata: dict[str, dict[str, Any] | None] = {}


async def openenv_metadata(env_name: str) -> dict[str, Any] | None:
    """``/metadata`` as OpenEnv answers it for the bridged env ``env_name``: its own
    ``get_metadata()`` (None: no bridged env, or the env could not say). OpenEnv makes an
    env for each call; here one is made (off the event loop) on the first call and closed,
    and its answer kept."""
    if env_name in _metadata:
        return _metadata[env_name]
    adapter = _adapter(env_name)
    answer = None
    if adapter is not None:
        try:
            answer = await asyncio.to_thread(_ask_metadata, adapter._bridge.factory)
        except Exception as exc:  # an env that cannot be made here: the Info answer stands
            log.warning("%s: get_metadata() failed: %s", env_name, exc)
    _metadata[env_name] = answer
    return answer


def _ask_metadata(factory: Any) -> dict[str, Any]:
    env = factory()
    try:
        metadata = env.get_metadata()
        return metadata.model_dump(mode="json") if isinstance(metadata, BaseModel) else metadata
    finally:
        close = getattr(env, "close", None)
        if callable(close):
            close()
