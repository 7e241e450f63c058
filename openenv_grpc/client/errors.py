"""Exceptions the client raises. All derive from :class:`OpenEnvError`."""

from __future__ import annotations

import grpc

__all__ = [
    "CapacityError",
    "EnvError",
    "OpenEnvError",
    "ProtocolError",
    "SessionLost",
    "SessionRefused",
]


class OpenEnvError(Exception):
    """Base class: ``code`` is the gRPC status code, ``message`` the server's words."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class SessionRefused(OpenEnvError):
    """The session could not be opened (server unreachable, draining, unauthenticated)."""


class CapacityError(SessionRefused):
    """The server is full (RESOURCE_EXHAUSTED); try again after ``retry_after`` seconds."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after: float | None) -> None:
        super().__init__(code, message)
        #: The server's retry hint (grpc-retry-pushback-ms) in seconds, if it sent one.
        self.retry_after = retry_after


class EnvError(OpenEnvError):
    """One request failed in-band; the session is still open and usable.

    ``code`` is INVALID_ARGUMENT (bad action or options), FAILED_PRECONDITION (e.g. step
    before reset or after the episode ended) or INTERNAL (the environment raised;
    ``exception_type`` names the exception and only a reset may follow).
    """

    def __init__(self, code: grpc.StatusCode, message: str, exception_type: str = "") -> None:
        super().__init__(code, message)
        self.exception_type = exception_type


class SessionLost(OpenEnvError):
    """The stream ended under the session (server drain, idle timeout, crash, network).

    The environment is gone; open a new session to go on.
    """


class ProtocolError(OpenEnvError):
    """The server answered something the protocol does not allow."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.INTERNAL, message)
