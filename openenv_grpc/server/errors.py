"""The errors a request is answered with, for both kinds of stream.

A request fails as a whole (:class:`RequestError`: nothing was done, or the one env of a
Session failed) or per env (:class:`RowError`: one index of a vector stream; its
neighbours answer). What an env raised becomes a row error in one place
(:func:`row_error`), so a Session and a vector stream word the same failure the same way.
A stream whose envs are gone for good ends (:class:`SessionLostError`); an env factory
that raised in an env process is said as an :class:`EnvFactoryError`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import NamedTuple, TypeVar

import grpc

from openenv_grpc.environment import InvalidAction

__all__ = [
    "CODE_NAMES",
    "BadTransition",
    "EnvExit",
    "EnvFactoryError",
    "RequestError",
    "RowError",
    "SessionLostError",
    "contained",
    "describe",
    "qualname",
    "row_error",
]

log = logging.getLogger(__name__)

#: gRPC code number -> its name (``"INVALID_ARGUMENT"``), as metrics label errors.
CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}

_INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_INTERNAL = grpc.StatusCode.INTERNAL.value[0]
_UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED.value[0]
#: The methods every env implements: a NotImplementedError there is a bug (INTERNAL).
_REQUIRED = frozenset({"reset", "step", "state", "close"})


class RequestError(Exception):
    """A request refused or failed as a whole; carried to the one place in each view that
    turns it into an in-band ``Error``."""

    def __init__(self, code: int, message: str, exception_type: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.exception_type = exception_type


class SessionLostError(Exception):
    """The stream lost its envs for good (their env process died, or none could replace
    them): the session cannot go on."""


class EnvFactoryError(Exception):
    """The env factory raised where it ran (an env process); the message says what."""


class RowError(NamedTuple):
    """Why one env of a call has no row: a gRPC code (int), a message, and the exception
    type raised inside the env, if any."""

    code: int
    message: str
    exception_type: str = ""


class BadTransition(Exception):
    """An env returned something else than its declared types (reported as INTERNAL)."""


class EnvExit(Exception):
    """Env code raised a ``BaseException`` that is no ``Exception`` (``SystemExit``,
    ``KeyboardInterrupt``, ``GeneratorExit``, a class of its own). Left alone it would end
    the server's event loop; raised by env code it is the env's failure, so the runner
    carries it as this (INTERNAL), named as the env raised it (:func:`describe`)."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(f"{type(original).__name__}: {original}")
        self.original = original


_T = TypeVar("_T")


async def contained(call: Awaitable[_T]) -> _T:
    """Await env code inside the task that runs it: asyncio re-raises a ``SystemExit`` or
    ``KeyboardInterrupt`` that leaves a task out of the event loop, so env code's is
    turned into an :class:`EnvExit` here, before it can. Cancellation passes."""
    try:
        return await call
    except (Exception, asyncio.CancelledError):
        raise
    except BaseException as exc:
        raise EnvExit(exc) from exc


def row_error(exc: BaseException, what: str) -> RowError:
    """The error of one env whose ``what`` (reset, step, state, or a method an env may
    leave out: snapshot, restore, ...) raised ``exc``; logged unless it is an
    :class:`InvalidAction` (a refusal, not a failure) or an optional method the env
    cannot do (``NotImplementedError``: UNIMPLEMENTED)."""
    if isinstance(exc, InvalidAction):
        return RowError(_INVALID_ARGUMENT, str(exc), qualname(exc))
    if isinstance(exc, NotImplementedError) and what not in _REQUIRED:
        # An env that snapshots some configurations only says which it cannot do.
        why = str(exc) or "this environment cannot do it now"
        return RowError(_UNIMPLEMENTED, f"{what} is not supported: {why}; the episode goes on")
    if isinstance(exc, BadTransition):  # what the env returned is named in the message
        return RowError(_INTERNAL, str(exc))
    log.error("environment %s() raised", what, exc_info=exc)
    return RowError(_INTERNAL, f"{what} failed: {describe(exc)}", qualname(exc))


def describe(exc: BaseException) -> str:
    """``"ValueError: bad seed"`` (an :class:`EnvExit`: what the env raised)."""
    if isinstance(exc, EnvExit):
        exc = exc.original
    return f"{type(exc).__name__}: {exc}"


def qualname(exc: BaseException) -> str:
    """The exception's class with its module, as ``Error.exception_type`` carries it."""
    kind = type(exc.original if isinstance(exc, EnvExit) else exc)
    return f"{kind.__module__}.{kind.__qualname__}"
