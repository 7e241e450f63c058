"""Finds an environment factory by name: a packaged env or a ``module:factory`` path.

Packaged envs register under the ``openenv_grpc.envs`` entry-point group, so the core
never imports an environment by name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

__all__ = ["ENTRY_POINT_GROUP", "available_envs", "load_factory"]

ENTRY_POINT_GROUP = "openenv_grpc.envs"


def available_envs() -> list[str]:
    """Names of the packaged environments installed in this Python."""
    return sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))


def load_factory(ref: str) -> Callable[[], Any]:
    """Resolve ``ref`` ("echo" or "package.module:attribute") to a factory.

    Raises:
        LookupError: no packaged env has that name, or the path does not resolve.
    """
    if ":" in ref:
        module_name, _, attr_path = ref.partition(":")
        try:
            target: Any = importlib.import_module(module_name)
        except ImportError as exc:
            raise LookupError(f"cannot import {module_name!r}: {exc}") from exc
        for attr in attr_path.split("."):
            try:
                target = getattr(target, attr)
            except AttributeError:
                raise LookupError(f"{module_name!r} has no attribute {attr_path!r}") from None
        if not callable(target):
            raise LookupError(f"{ref!r} is not callable")
        return target  # type: ignore[no-any-return]
    for ep in entry_points(group=ENTRY_POINT_GROUP, name=ref):
        return ep.load()  # type: ignore[no-any-return]
    known = ", ".join(available_envs()) or "none installed"
    raise LookupError(f"no environment named {ref!r} (packaged: {known}; or use module:factory)")
