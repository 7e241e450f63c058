"""The errors a request is answered with, for both kinds of stream: a whole request fails
(:class:`RequestError`) or one env of it (:class:`RowError`); what an env raised becomes a
row error in one place (:func:`row_error`), so both kinds word a failure the same way.
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

#: gRPC code number -> its name, as metrics label errors.
CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}

_INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_INTERNAL = grpc.StatusCode.INTERNAL.value[0]
_UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED.value[0]
#: The methods every env implements: a NotImplementedError there is a bug (INTERNAL).
_REQUIRED = frozenset({"reset", "step", "state", "close"})


class RequestError(Exception):
    """A request refused or failed as a whole (answered with an in-band ``Error``)."""

    def __init__(self, code: int, message: str, exception_type: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.exception_type = exception_type


class SessionLostError(Exception):
    """The stream lost its envs for good: the session cannot go on."""


class EnvFactoryError(Exception):
    """The env factory raised where it ran (an env process); the message says what."""


class RowError(NamedTuple):
    """Why one env of a call has no row: gRPC code, message, exception type raised (if any)."""

    code: int
    message: str
    exception_type: str = ""


class BadTransition(Exception):
    """An env returned something else than its declared types (reported as INTERNAL)."""


class EnvExit(Exception):
    """Env code raised a ``BaseException`` that is no ``Exception`` (``SystemExit``, ...):
    the env's failure (INTERNAL), carried as this so it cannot end the event loop."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(f"{type(original).__name__}: {original}")
        self.original = original


_T = TypeVar("_T")


async def contained(call: Awaitable[_T]) -> _T:
    """Await env code, turning a ``SystemExit`` or ``KeyboardInterrupt`` into an
    :class:`EnvExit` before asyncio re-raises it out of the loop. Cancellation passes."""
    try:
        return await call
    except (Exception, asyncio.CancelledError):
        raise
    except BaseException as exc:
        raise EnvExit(exc) from exc


def row_error(exc: BaseException, what: str) -> RowError:
    """The error of one env whose ``what`` (reset, step, snapshot, ...) raised ``exc``;
    logged unless a refusal (:class:`InvalidAction`) or an optional method the env
    cannot do (``NotImplementedError``: UNIMPLEMENTED)."""
    if isinstance(exc, InvalidAction):
        return RowError(_INVALID_ARGUMENT, str(exc), qualname(exc))
    if isinstance(exc, NotImplementedError) and what not in _REQUIRED:
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
    """The exception's ``module.Class``, as ``Error.exception_type`` carries it."""
    kind = type(exc.original if isinstance(exc, EnvExit) else exc)
    return f"{kind.__module__}.{kind.__qualname__}"
