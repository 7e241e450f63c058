"""The environment contract: the base classes environment builders subclass.

An environment is generic over four protobuf message types, declared once in its base
class::

    class EchoEnvironment(Environment[EchoAction, EchoObservation, EchoState, EchoResetOptions]):
        runs_inline = True  # every method returns in microseconds

        def reset(self, *, seed, episode_id, options): ...
        def step(self, action): ...
        def state(self): ...

The server reads those types at start-up (:func:`message_types`), checks them, advertises
them in the Info RPC, and decodes every action into the declared type before calling
``step``. An environment never sees the transport: it gets messages and returns messages.
Use ``google.protobuf.Empty`` for the reset options of an environment that takes none.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from google.protobuf.message import Message

__all__ = [
    "AsyncEnvironment",
    "Environment",
    "EnvironmentTypes",
    "InvalidAction",
    "Transition",
    "message_types",
]

ActionT = TypeVar("ActionT", bound=Message)
ObservationT = TypeVar("ObservationT", bound=Message)
StateT = TypeVar("StateT", bound=Message)
ResetOptionsT = TypeVar("ResetOptionsT", bound=Message)


@dataclass(slots=True)
class Transition(Generic[ObservationT]):
    """What ``reset`` and ``step`` return.

    Attributes:
        observation: The observation, of the environment's observation type.
        reward: The reward for the step that led here (0 after a reset).
        terminated: The episode reached a terminal state of the task.
        truncated: The episode was cut short by a limit outside the task.
        info: Extra diagnostic data; JSON-like values (str, number, bool, None,
            lists, dicts). Sent to the client as-is.
    """

    observation: ObservationT
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: Mapping[str, Any] | None = None


class InvalidAction(Exception):
    """Raise from ``step`` (or ``reset``) when the request is well-typed but not allowed.

    The client gets an in-band ``INVALID_ARGUMENT`` error with this message and the
    episode goes on unchanged, so the environment must raise it before mutating state.
    Any other exception is reported as ``INTERNAL`` and the episode must be reset.
    """


class _EnvironmentBase(Generic[ActionT, ObservationT, StateT, ResetOptionsT]):
    """What sync and async environments share: identity and execution hints."""

    #: Name shown by the Info RPC; defaults to the class name.
    name: ClassVar[str] = ""
    #: Version shown by the Info RPC.
    version: ClassVar[str] = "0.0.0"
    #: One line shown by the Info RPC.
    description: ClassVar[str] = ""
    #: Seconds reset, step or state may take before the session gets DEADLINE_EXCEEDED and
    #: a fresh instance (None: no limit; the server's ``--step-timeout`` overrides it).
    step_timeout: ClassVar[float | None] = None

    @classmethod
    def reclaim_orphans(cls) -> None:
        """Release what instances of this class left behind in processes that died without
        closing them: called by the server once at start (leftovers of a previous run) and
        after an isolated worker process dies. Must be safe to call at any time from the
        server process; must not touch resources of live instances.

        Runs in a thread of its own and may block. Does nothing by default; what it raises
        is logged and otherwise ignored.
        """


class Environment(_EnvironmentBase[ActionT, ObservationT, StateT, ResetOptionsT]):
    """A synchronous environment; one instance serves exactly one session.

    The server creates an instance when a session opens (by calling the factory with no
    arguments) and calls :meth:`close` exactly once when the session ends. Calls on one
    instance never overlap. By default they run on a shared thread pool, so a slow
    ``step`` does not stall other sessions; set :attr:`runs_inline` to skip that hop.
    """

    #: True when every method returns in microseconds and never blocks: calls then run
    #: directly on the server's event loop, which is the fastest path but stalls every
    #: other session for as long as a call takes.
    runs_inline: ClassVar[bool] = False

    def reset(
        self, *, seed: int | None, episode_id: str, options: ResetOptionsT | None
    ) -> Transition[ObservationT]:
        """Start a new episode and return its first observation.

        Args:
            seed: Seed for the environment's random generators, or None if unseeded.
            episode_id: The id of the new episode (the client's, or one the server made).
            options: The client's reset options, or None when it sent none.

        Returns:
            The first transition; its reward is usually 0 and its flags False.

        Raises:
            InvalidAction: The options are not acceptable; the previous episode stands.
        """
        raise NotImplementedError

    def step(self, action: ActionT) -> Transition[ObservationT]:
        """Apply one action to the current episode.

        Only called after a successful ``reset`` and before the episode ends; the server
        answers out-of-order calls itself.

        Returns:
            The resulting transition.

        Raises:
            InvalidAction: The action is not allowed now; the episode is unchanged.
        """
        raise NotImplementedError

    def state(self) -> StateT:
        """Return the environment's current state (also valid before the first reset)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the instance holds. Called exactly once, even after errors."""


class AsyncEnvironment(_EnvironmentBase[ActionT, ObservationT, StateT, ResetOptionsT]):
    """An asyncio environment: the same contract as :class:`Environment`, with coroutines.

    Its methods run on the server's event loop and must not block it; await I/O instead.
    """

    async def reset(
        self, *, seed: int | None, episode_id: str, options: ResetOptionsT | None
    ) -> Transition[ObservationT]:
        """See :meth:`Environment.reset`."""
        raise NotImplementedError

    async def step(self, action: ActionT) -> Transition[ObservationT]:
        """See :meth:`Environment.step`."""
        raise NotImplementedError

    async def state(self) -> StateT:
        """See :meth:`Environment.state`."""
        raise NotImplementedError

    async def close(self) -> None:
        """See :meth:`Environment.close`."""


AnyEnvironment = Environment[Any, Any, Any, Any] | AsyncEnvironment[Any, Any, Any, Any]


@dataclass(frozen=True, slots=True)
class EnvironmentTypes:
    """The four message classes an environment class declared in its generic base."""

    action: type[Message]
    observation: type[Message]
    state: type[Message]
    reset_options: type[Message]


def message_types(env_class: type[Any]) -> EnvironmentTypes:
    """Read the message types ``env_class`` declared as ``Environment[A, O, S, R]``.

    Raises:
        TypeError: ``env_class`` is not an environment, or a declared type is not a
            concrete protobuf message class.
    """
    if not (isinstance(env_class, type) and issubclass(env_class, _EnvironmentBase)):
        raise TypeError(f"{env_class!r} is not a subclass of Environment or AsyncEnvironment")
    for klass in env_class.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            origin = typing.get_origin(base)
            if origin in (Environment, AsyncEnvironment):
                args = typing.get_args(base)
                for role, arg in zip(
                    ("action", "observation", "state", "reset options"), args, strict=True
                ):
                    if not (isinstance(arg, type) and issubclass(arg, Message)):
                        raise TypeError(
                            f"{env_class.__qualname__}: the {role} type must be a protobuf "
                            f"message class, got {arg!r}"
                        )
                return EnvironmentTypes(*args)
    raise TypeError(
        f"{env_class.__qualname__} does not declare its message types: subclass "
        "Environment[Action, Observation, State, ResetOptions]"
    )
