"""What the server knows about the environment it hosts, worked out once at start-up.

A factory is anything called with no arguments that returns a fresh environment: the
environment class itself, a ``functools.partial`` of it, or a function annotated with
the environment class it returns (``def make() -> MyEnv``). The class gives the message
types, so they are checked before the first session, not on the first step.

The class's ``runs_inline`` also says where its calls run (:class:`ExecutionMode`); for a
sync env that leaves it None, the spec carries the :class:`CallPlacement` that measures
them.
"""

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

#: Seconds: a measured env's calls run on the event loop while they take less than this
#: (the server's ``--inline-threshold-ms`` setting; the default when it is not given).
DEFAULT_INLINE_THRESHOLD = 0.001


class ExecutionMode(enum.Enum):
    """Where an environment's methods run."""

    INLINE = "inline"  # sync env declared cheap: called on the event loop
    POOL = "pool"  # sync env declared blocking: called on the shared bounded thread pool
    ASYNC = "async"  # async env: awaited on the event loop
    #: sync env that declared neither: each group of calls runs on the loop while it
    #: measures cheap, on the pool otherwise (``placement.py``)
    MEASURED = "measured"


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
    #: Where a MEASURED env's calls run now, learnt from their timings (None otherwise).
    placement: CallPlacement | None = None

    #: The env overrides ``snapshot()`` and ``restore()``: the snapshot commands work.
    snapshots: bool = False

    @classmethod
    def from_factory(
        cls, factory: Callable[[], Any], *, inline_threshold: float = DEFAULT_INLINE_THRESHOLD
    ) -> EnvSpec:
        """Inspect ``factory`` and the environment class it produces. A sync env with
        ``runs_inline = None`` is MEASURED against ``inline_threshold`` seconds (``0``:
        such envs run on the pool, as if they had said False).

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
    """True when ``env_class`` overrides both ``snapshot`` and ``restore``.

    Raises:
        TypeError: it overrides one of them only (half a feature is a bug: say so at start).
    """
    base = AsyncEnvironment if issubclass(env_class, AsyncEnvironment) else Environment
    overridden = {
        name
        for name in ("snapshot", "restore")
        if getattr(env_class, name) is not getattr(base, name)
    }
    if len(overridden) == 1:
        (done,) = overridden
        missing = ({"snapshot", "restore"} - overridden).pop()
        raise TypeError(
            f"{env_class.__qualname__} overrides {done}() but not {missing}(): snapshots need both"
        )
    return bool(overridden)


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
