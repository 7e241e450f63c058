"""What an OpenEnv env class's methods say about themselves: which are overridden, which
reset OpenEnv would call, and its parameters."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

from openenv.core.env_server.interfaces import Environment as OpenEnvEnvironment

__all__ = ["has_mcp", "hints", "overrides", "reset_method", "reset_parameters"]

_SKIPPED_PARAMETERS = frozenset({"self", "seed", "episode_id"})


def hints(function: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(function)
    except Exception:  # unresolvable string annotations: use none of them
        return {}


def overrides(env_class: type[Any], method: str) -> bool:
    return getattr(env_class, method) is not getattr(OpenEnvEnvironment, method)


def has_mcp(env_class: type[Any]) -> bool:
    return callable(getattr(env_class, "mcp_session", None))


def reset_method(env_class: type[Any]) -> tuple[Callable[..., Any], bool]:
    """The reset OpenEnv would call (``reset_async`` if overridden) and whether it is it."""
    if overrides(env_class, "reset_async"):
        return env_class.reset_async, True
    return env_class.reset, False


def reset_parameters(reset: Callable[..., Any]) -> tuple[list[inspect.Parameter], bool]:
    parameters = list(inspect.signature(reset).parameters.values())
    named = [
        p for p in parameters
        if p.name not in _SKIPPED_PARAMETERS
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]  # fmt: skip
    return named, any(p.kind is p.VAR_KEYWORD for p in parameters)
