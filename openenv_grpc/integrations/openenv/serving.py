"""What ``serve --openenv`` needs besides the adapter: find the class, size the server."""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Any

from openenv_grpc.server.config import ServerConfig

__all__ = ["load_openenv_class", "serve_config"]

log = logging.getLogger(__name__)


def load_openenv_class(ref: str) -> type[Any]:
    """Import ``"package.module:EnvClass"``.

    Raises:
        LookupError: the reference is malformed, the module does not import, or it has
            no such attribute.
    """
    module_name, colon, attribute = ref.partition(":")
    if not colon or not module_name or not attribute:
        raise LookupError(f"--openenv takes package.module:EnvClass, got {ref!r}")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise LookupError(f"cannot import {module_name!r}: {exc}") from exc
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise LookupError(f"{module_name!r} has no attribute {attribute!r}") from None
    return target  # type: ignore[no-any-return]


def serve_config(adapter: type[Any], config: ServerConfig | None = None) -> ServerConfig:
    """``config`` (default: from the environment) for serving ``adapter``: an env that does
    not declare ``SUPPORTS_CONCURRENT_SESSIONS = True`` gets capacity 1, as OpenEnv
    requires, and the log says so.

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
