"""What the server reads off the env class it hosts, once at start-up. A factory is the
class, a ``functools.partial`` of it, or a function annotated with the class it returns."""

from __future__ import annotations

import enum
import functools
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf import descriptor_pb2

from openenv_grpc.codec import file_descriptor_set, type_url
from openenv_grpc.environment import (
    AnyEnvironment,
    AsyncEnvironment,
    Environment,
    EnvironmentTypes,
    message_types,
)
from openenv_grpc.server.model.placement import CallPlacement

__all__ = ["DEFAULT_INLINE_THRESHOLD", "EnvSpec", "ExecutionMode"]

EnvFactory = Callable[[], AnyEnvironment]

#: Seconds: ``--inline-threshold-ms``'s default.
DEFAULT_INLINE_THRESHOLD = 0.001


class ExecutionMode(enum.Enum):
    """Where an environment's methods run."""

    INLINE = "inline"  # sync env declared cheap: called on the event loop
    POOL = "pool"  # sync env declared blocking: called on the shared bounded thread pool
    ASYNC = "async"  # async env: awaited on the event loop
    MEASURED = "measured"  # sync env that declared neither: see placement.py


@dataclass(frozen=True, slots=True)
class EnvSpec:
    """An environment factory and everything derived from its class."""

    factory: EnvFactory
    env_class: type[AnyEnvironment]
    types: EnvironmentTypes
    mode: ExecutionMode
    name: str
    version: str
    description: str
    action_url: str
    observation_url: str
    state_url: str
    reset_options_url: str
    descriptors: descriptor_pb2.FileDescriptorSet
    #: Where a MEASURED env's calls run now (None otherwise).
    placement: CallPlacement | None = None
    #: The env overrides ``snapshot()`` and ``restore()``.
    snapshots: bool = False

    @classmethod
    def from_factory(
        cls, factory: Callable[[], Any], *, inline_threshold: float = DEFAULT_INLINE_THRESHOLD
    ) -> EnvSpec:
        """A sync env with ``runs_inline = None`` is MEASURED against ``inline_threshold``
        seconds (``0``: it runs on the pool).

        Raises:
            TypeError: the environment class cannot be found, declares bad types, or
                overrides only one of ``snapshot()`` and ``restore()``.
        """
        env_class = _env_class_of(factory)
        types = message_types(env_class)
        name = env_class.name or env_class.__name__
        placement: CallPlacement | None = None
        hint = env_class.runs_inline if issubclass(env_class, Environment) else False
        if issubclass(env_class, AsyncEnvironment):
            mode = ExecutionMode.ASYNC
        elif hint is None and inline_threshold > 0:
            mode = ExecutionMode.MEASURED
            placement = CallPlacement(inline_threshold, name)
        elif hint:
            mode = ExecutionMode.INLINE
        else:
            mode = ExecutionMode.POOL
        return cls(
            factory=factory,
            env_class=env_class,
            types=types,
            mode=mode,
            name=name,
            version=env_class.version,
            description=env_class.description or (env_class.__doc__ or "").strip().split("\n")[0],
            action_url=type_url(types.action),
            observation_url=type_url(types.observation),
            state_url=type_url(types.state),
            reset_options_url=type_url(types.reset_options),
            descriptors=file_descriptor_set(
                types.action, types.observation, types.state, types.reset_options
            ),
            placement=placement,
            snapshots=_supports_snapshots(env_class),
        )


def _supports_snapshots(env_class: type[AnyEnvironment]) -> bool:
    """``env_class`` overrides both ``snapshot`` and ``restore``.

    Raises:
        TypeError: it overrides one of them only.
    """
    base = AsyncEnvironment if issubclass(env_class, AsyncEnvironment) else Environment
    snapshot, restore = (
        getattr(env_class, n) is not getattr(base, n) for n in ("snapshot", "restore")
    )
    if snapshot != restore:
        done, missing = ("snapshot", "restore") if snapshot else ("restore", "snapshot")
        raise TypeError(
            f"{env_class.__qualname__} overrides {done}() but not {missing}(): snapshots need both"
        )
    return snapshot


def _env_class_of(factory: Callable[[], Any]) -> type[AnyEnvironment]:
    if isinstance(factory, type):
        return factory
    if isinstance(factory, functools.partial):
        return _env_class_of(factory.func)
    try:
        returned = typing.get_type_hints(factory).get("return")
    except Exception as exc:  # unresolvable annotations: report them, not a traceback
        raise TypeError(f"cannot read the return annotation of {factory!r}: {exc}") from exc
    if isinstance(returned, type):
        return returned
    raise TypeError(
        f"{factory!r} must be an Environment class, a partial of one, or a function "
        "annotated with the Environment class it returns"
    )
