"""What a stream's request handler (a view over ``driver.py``) gives the session loop:
:class:`Answer` says what each request got, so the loop records the metrics and ends the
stream after a close; and the in-band error answers both views build."""

from __future__ import annotations

import enum
from typing import Any, NamedTuple, Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from openenv_grpc.server.errors import CODE_NAMES, RequestError
from openenv_grpc.server.local.calls import BatchRefused

__all__ = [
    "Answer",
    "Outcome",
    "SessionBackend",
    "UndecodableRequest",
    "error_answer",
    "exhausted",
    "parse_request",
]

_RequestT = TypeVar("_RequestT", bound=Message)

_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


class UndecodableRequest(Exception):
    """The request bytes are not a SessionRequest: the stream is out of sync."""


def parse_request(raw: bytes, request_class: type[_RequestT]) -> _RequestT:
    """Raises UndecodableRequest: ``raw`` is not a ``request_class`` (no id to answer to)."""
    try:
        return request_class.FromString(raw)
    except DecodeError as exc:
        name = request_class.DESCRIPTOR.full_name
        raise UndecodableRequest(f"request is not a valid {name}: {exc}") from None


class Outcome(enum.IntEnum):
    """What a request was answered with, as far as the session's metrics care."""

    ANSWERED = 0  # any other command's answer (a reset, a state, a snapshot, ...)
    STEPPED = 1  # a completed step (counted in Info's activity and Prometheus)
    CLOSED = 2  # the env is closed: the stream ends after this answer
    FAILED = 3  # an in-band error; Answer.error names its code
    SATURATED = 4  # RESOURCE_EXHAUSTED: the call never got an env thread in time


class Answer(NamedTuple):
    """One serialized response and what it was."""

    response: bytes
    outcome: Outcome
    seconds: float = 0.0  # STEPPED: the whole env call's time
    error: str = ""  # FAILED, SATURATED: the gRPC code's name
    #: The stream ends after this answer: a close, or a hung env not replaceable.
    ends: bool = False
    steps: int = 1  # STEPPED: env steps taken (a vector step: one per env that stepped)
    env_errors: tuple[str, ...] = ()  # a vector answer's per-env error code names


class SessionBackend(Protocol):
    """One session's env, wherever it runs."""

    async def handle(self, raw: Any) -> Answer:
        """Answer request ``raw`` (what the wire read: a gRPC stream's bytes). Raises
        UndecodableRequest (``raw`` does not parse), SessionLostError (env gone)."""
        ...

    async def close(self) -> None:
        """Close the envs, once; a raising ``close`` is logged."""
        ...


def error_answer(response: Any, failure: RequestError | BatchRefused, ends: bool) -> Answer:
    """``response`` (its request id set) answering a whole request's ``failure`` in-band;
    SATURATED when the call never got an env thread, else FAILED."""
    response.ClearField("outcome")
    error = response.error
    error.code = failure.code
    error.message = failure.message
    error.exception_type = failure.exception_type
    saturated = isinstance(failure, BatchRefused) and failure.saturated
    outcome = Outcome.SATURATED if saturated else Outcome.FAILED
    name = CODE_NAMES.get(failure.code, str(failure.code))
    return Answer(response.SerializeToString(), outcome, 0.0, name, ends)


def exhausted(response: Any, message: str) -> bytes:
    """``response`` (its request id set) answering RESOURCE_EXHAUSTED in-band, serialized;
    the caller counts it."""
    response.ClearField("outcome")
    error = response.error
    error.code = _RESOURCE_EXHAUSTED
    error.message = message
    serialized: bytes = response.SerializeToString()
    return serialized
