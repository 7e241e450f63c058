"""What ``serve --openenv`` needs besides the adapter: find the env, size the server.

``--openenv`` takes what uvicorn takes for the env, or the env class itself:

- ``pkg.server.app:app``, the env's own ``create_app(...)`` module: the env class (or
  factory) and its Action / Observation / State are the ones that call was given. They
  are read by recording every ``HTTPEnvServer`` made while the module imports
  (``create_app``, ``create_fastapi_app`` and the web interface all make exactly one,
  whichever module they are imported from), and, for a module imported before, by
  finding the ``HTTPEnvServer`` its routes were registered by in their closures. Either
  way the types are the ones OpenEnv's own server validates with, not guesses from
  annotations (coding_env's ``step`` is annotated with the base classes).
- ``pkg.module:EnvClass`` (or a factory function): the types come from the class (see
  :mod:`.environment`).

As with uvicorn, the current directory is importable (``serve --openenv
server.my_environment:MyEnvironment`` from the env's folder).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from openenv.core.env_server.http_server import HTTPEnvServer
from openenv.core.env_server.types import State
from pydantic import BaseModel

from openenv_grpc.server.config import ServerConfig

__all__ = ["OpenEnvTarget", "load_openenv_class", "load_openenv_target", "serve_config"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class OpenEnvTarget:
    """What ``--openenv REF`` names: the env class or factory, and the models its app was
    created with (None: read them from the class)."""

    env: Any
    action: type[BaseModel] | None = None
    observation: type[BaseModel] | None = None
    state: type[BaseModel] | None = None
    name: str | None = None


def load_openenv_class(ref: str) -> Any:
    """Import ``"package.module:attribute"`` (the current directory importable).

    Raises:
        LookupError: the reference is malformed, the module does not import, or it has
            no such attribute.
    """
    return _import(ref, [])


def load_openenv_target(ref: str) -> OpenEnvTarget:
    """What ``ref`` names: an env's app made by ``create_app`` (its env and models), or
    an env class or factory (the models to be read from it).

    Raises:
        LookupError: the reference does not resolve, or names an app no OpenEnv
            ``create_app`` made.
    """
    made: list[HTTPEnvServer] = []
    target = _import(ref, made)
    if isinstance(target, HTTPEnvServer):
        return _target_of(target)
    if _is_asgi_app(target):
        server = _server_of(target, made)
        if server is None:
            raise LookupError(
                f"{ref!r} is an app, but no OpenEnv create_app made it: pass the env class "
                "(--openenv pkg.server.my_environment:MyEnvironment)"
            )
        return _target_of(server)
    return OpenEnvTarget(target)


def _import(ref: str, made: list[HTTPEnvServer]) -> Any:
    module_name, colon, attribute = ref.partition(":")
    if not colon or not module_name or not attribute:
        raise LookupError(
            f"--openenv takes package.module:EnvClass or package.server.app:app, got {ref!r}"
        )
    try:
        with _cwd_importable(), _recording(made):
            target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise LookupError(f"cannot import {module_name!r}: {exc}") from exc
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise LookupError(f"{module_name!r} has no attribute {attribute!r}") from None
    return target


@contextlib.contextmanager
def _cwd_importable() -> Iterator[None]:
    """The current directory first on sys.path while importing, as ``python -m`` and
    uvicorn have it (a console script's sys.path starts with its own bin directory)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)  # left in place: the env's modules may import lazily later
    yield


@contextlib.contextmanager
def _recording(made: list[HTTPEnvServer]) -> Iterator[None]:
    """Every HTTPEnvServer made meanwhile goes into ``made``."""
    original = HTTPEnvServer.__init__

    def recording_init(self: HTTPEnvServer, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        made.append(self)

    HTTPEnvServer.__init__ = recording_init
    try:
        yield
    finally:
        HTTPEnvServer.__init__ = original


def _is_asgi_app(target: Any) -> bool:
    return hasattr(target, "routes") and hasattr(target, "router") and callable(target)


def _server_of(app: Any, made: list[HTTPEnvServer]) -> HTTPEnvServer | None:
    """The HTTPEnvServer whose routes ``app`` holds (their endpoints close over it)."""
    found: list[HTTPEnvServer] = []
    for route in getattr(app, "routes", ()):
        endpoint = getattr(route, "endpoint", None)
        for cell in getattr(endpoint, "__closure__", None) or ():
            with contextlib.suppress(ValueError):  # an empty cell
                if isinstance(cell.cell_contents, HTTPEnvServer):
                    found.append(cell.cell_contents)
    for server in found:
        if any(server is m for m in made):
            return server
    if found:
        return found[0]
    return made[0] if len(made) == 1 else None


def _target_of(server: HTTPEnvServer) -> OpenEnvTarget:
    state = server.state_cls
    return OpenEnvTarget(
        env=server._env_factory,
        action=server.action_cls,
        observation=server.observation_cls,
        # create_app's default is the base State: the class may say better.
        state=None if state is State else state,
        name=server.env_name or None,
    )


def resolve_model(ref: str, role: str) -> type[BaseModel]:
    """``--action`` / ``--observation`` / ``--state``'s ``module:Model``.

    Raises:
        LookupError: it does not resolve. TypeError: it is no pydantic model.
    """
    model = load_openenv_class(ref)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise TypeError(f"--{role} {ref}: {model!r} is not a pydantic model")
    return model


def serve_config(adapter: type[Any], config: ServerConfig | None = None) -> ServerConfig:
    """``config`` (default: from the environment) for serving ``adapter``: an env that does
    not declare ``SUPPORTS_CONCURRENT_SESSIONS = True`` gets capacity 1, as OpenEnv
    requires, and the log says so. (The server holds such an env to one session however
    it is served: the adapter's ``max_sessions`` is 1.)

    Raises:
        ValueError: such an env with several workers (each would hold one more session).
    """
    config = config or ServerConfig.from_env()
    if getattr(adapter, "openenv_concurrent", True):
        return config
    if config.workers > 1:
        raise ValueError(
            f"{adapter.name} does not declare SUPPORTS_CONCURRENT_SESSIONS: serve it with "
            "one worker (each worker would hold a session of its own)"
        )
    ignored = f" (MAX_CONCURRENT_ENVS {config.max_concurrent_envs} ignored)"
    log.warning(
        "%s does not declare SUPPORTS_CONCURRENT_SESSIONS = True: capacity 1 session%s",
        adapter.name,
        ignored if config.max_concurrent_envs != 1 else "",
    )
    return dataclasses.replace(config, max_concurrent_envs=1)


def adapter_for(
    ref: str,
    action: str | None = None,
    observation: str | None = None,
    state: str | None = None,
) -> type[Any]:
    """The adapter class ``serve --openenv REF [--action ...]`` serves.

    Raises:
        LookupError, TypeError: see :func:`load_openenv_target` and
            :func:`~openenv_grpc.integrations.openenv.openenv_environment`.
    """
    from openenv_grpc.integrations.openenv.environment import openenv_environment

    target = load_openenv_target(ref)
    named: dict[str, Callable[[], Any] | type[BaseModel] | None] = {
        "action": resolve_model(action, "action") if action else target.action,
        "observation": (
            resolve_model(observation, "observation") if observation else target.observation
        ),
        "state": resolve_model(state, "state") if state else target.state,
    }
    return openenv_environment(target.env, name=target.name, **named)  # type: ignore[arg-type]
