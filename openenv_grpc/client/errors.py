"""Exceptions the client raises. Every one derives from :class:`OpenEnvError`.

A trainer that catches ``OpenEnvError`` catches everything a session call can raise for
reasons of the server, the network or its own use of the session. Where Python has a
conventional base for a case (``TimeoutError``, ``TypeError``, ``RuntimeError``), the
exception derives from that too, so ``except TimeoutError`` keeps working.
"""

from __future__ import annotations

from typing import Any

import grpc

__all__ = [
    "CapacityError",
    "EnvError",
    "InfoUnavailable",
    "InvalidRequest",
    "OpenEnvError",
    "PayloadTypeError",
    "ProtocolError",
    "SessionLost",
    "SessionRefused",
    "SessionStateError",
    "SessionTimeout",
    "VectorEnvError",
]


class OpenEnvError(Exception):
    """Base class: ``code`` is the gRPC status code, ``message`` the server's words (or,
    for errors found by the client itself, the client's)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class SessionRefused(OpenEnvError):
    """The session could not be opened (server unreachable, draining, unauthenticated)."""

    @property
    def unprocessed(self) -> bool:
        """The server refused the stream before doing anything with it (HTTP/2
        REFUSED_STREAM, which gRPC reports as UNAVAILABLE): opening again is safe."""
        return self.code is grpc.StatusCode.UNAVAILABLE and _REFUSED_STREAM in self.message


#: How gRPC words an HTTP/2 RST_STREAM with error code REFUSED_STREAM (0x7).
_REFUSED_STREAM = "RST_STREAM with error code 7"


class CapacityError(SessionRefused):
    """The server is full (RESOURCE_EXHAUSTED); try again after ``retry_after`` seconds."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after: float | None) -> None:
        super().__init__(code, message)
        #: The server's retry hint (grpc-retry-pushback-ms) in seconds, if it sent one.
        self.retry_after = retry_after


class EnvError(OpenEnvError):
    """One request failed in-band; the session is still open and usable.

    ``code`` is INVALID_ARGUMENT (bad action or options), FAILED_PRECONDITION (e.g. step
    before reset or after the episode ended), DEADLINE_EXCEEDED (the env call took longer
    than the server's step timeout; the env was replaced, reset to go on) or INTERNAL (the
    environment raised; ``exception_type`` names the exception; after a failed reset or
    step only a reset may follow, after a failed ``state`` the episode goes on).
    """

    def __init__(self, code: grpc.StatusCode, message: str, exception_type: str = "") -> None:
        super().__init__(code, message)
        self.exception_type = exception_type


class VectorEnvError(EnvError):
    """Some envs of a vector call failed in-band and the others answered (a vector
    snapshot or restore, which returns nothing partial): ``errors`` holds each failed
    env's own :class:`EnvError` by index, ``done`` the indices that succeeded (a restore
    took effect for those). ``code`` and ``exception_type`` are the lowest failed index's;
    the message names every failed index. The stream goes on.
    """

    def __init__(
        self,
        what: str,
        errors: dict[int, EnvError],
        done: list[int],
        results: dict[int, Any] | None = None,
    ) -> None:
        first = errors[min(errors)]
        described = "; ".join(
            f"env {index}: {error.code.name}: {error.message}"
            for index, error in sorted(errors.items())
        )
        super().__init__(
            first.code, f"{what} failed for {len(errors)} env(s): {described}", first.exception_type
        )
        #: Each env that failed, by index: its own code, message and exception type.
        self.errors = errors
        #: The indices that succeeded, increasing.
        self.done = done
        #: What the envs that succeeded answered, by index, where the call reads
        #: something (a render's frames, a snapshot's bytes); else empty.
        self.results: dict[int, Any] = results or {}


class SessionLost(OpenEnvError):
    """The stream ended under the session (server drain, idle timeout, crash, network).

    The environment is gone; open a new session to go on (``reconnect=True`` does it on
    the next call).
    """


class SessionTimeout(OpenEnvError, TimeoutError):
    """A call got no answer within its ``timeout``; the session stays open and the late
    answer is discarded when it comes (by its request id)."""

    def __init__(self, timeout: float) -> None:
        super().__init__(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"no answer within {timeout}s; the session stays open",
        )
        #: The timeout that expired, in seconds.
        self.timeout = timeout


class SessionStateError(OpenEnvError, RuntimeError):
    """The session was used out of order: a call before ``open`` (or after ``close``), or
    ``open`` on a session that is open already. Nothing was sent."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, message)


class PayloadTypeError(OpenEnvError, TypeError):
    """A typed client was given a message of the wrong type (an observation where an
    action belongs, say). Nothing was sent; the session goes on."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)


class InvalidRequest(OpenEnvError, ValueError):
    """A call's arguments do not fit together (e.g. a vector reset given a list of seeds
    that is not one per env named). Nothing was sent; the session goes on."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)


class InfoUnavailable(OpenEnvError):
    """The Info RPC failed: the server was not reached within the timeout (UNAVAILABLE,
    DEADLINE_EXCEEDED) or refused the caller (UNAUTHENTICATED)."""


class ProtocolError(OpenEnvError):
    """The server answered something the protocol does not allow."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.INTERNAL, message)
