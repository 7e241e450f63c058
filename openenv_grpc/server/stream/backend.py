"""What the session lifecycle needs of a stream's request handler, and what the handler
says it answered.

The session lifecycle (``session.py``) reads raw request bytes, hands them to the
stream's :class:`SessionBackend` and writes back the bytes it returns; it never knows
which kind of stream it serves or where its envs run. The backend is a view over the one
driver (``driver.py``): :class:`~openenv_grpc.server.stream.session_view.SessionView` for a
Session, :class:`~openenv_grpc.server.stream.vector_view.VectorView` for a VectorSession, in
this process or ``--isolated`` alike (that difference lies below the driver, in
``calls.py`` and ``spread.py``).

Each answer says what it was (:class:`Answer`, :class:`Outcome`): the session records the
metrics from that, and ends the stream after a close, so no flag or metrics sink is
relayed through the layers below it. Both views parse a request (:func:`parse_request`),
answer a failed request (:func:`error_answer`) and an in-band RESOURCE_EXHAUSTED
(:func:`exhausted`) with the functions here.
"""

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
    """One request of a stream, parsed.

    Raises:
        UndecodableRequest: ``raw`` is not a ``request_class`` (no id to answer to).
    """
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
    #: For STEPPED: seconds the step took (the env call, or the round trip to its process).
    seconds: float = 0.0
    #: For FAILED and SATURATED: the gRPC code's name.
    error: str = ""
    #: The stream ends after this answer: a close, or a hung env that could not be
    #: replaced (nothing is left to serve).
    ends: bool = False
    #: For STEPPED: how many env steps the answer holds (a vector stream's step: one per
    #: env that stepped; ``seconds`` is then the whole call's time).
    steps: int = 1
    #: A vector stream's per-env errors in this answer: one gRPC code name each.
    env_errors: tuple[str, ...] = ()


class SessionBackend(Protocol):
    """One session's env, wherever it runs."""

    async def handle(self, raw: bytes) -> Answer:
        """Answer one serialized request.

        Raises:
            UndecodableRequest: ``raw`` does not parse.
            SessionLostError: the env is gone.
        """
        ...

    async def close(self) -> None:
        """Close the env; once, surviving a raising ``close`` (it is logged)."""
        ...


def error_answer(response: Any, failure: RequestError | BatchRefused, ends: bool) -> Answer:
    """``response`` (a SessionResponse or a VectorSessionResponse, its request id set)
    answering ``failure`` (a request's failure as a whole) in-band; ``ends``: the stream
    ends after it. A call that never got an env thread is SATURATED, any other FAILED."""
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
    """``response`` (a SessionResponse or a VectorSessionResponse, its request id set)
    answering RESOURCE_EXHAUSTED in-band with ``message``, serialized: the one builder of
    that answer, for a result over the message limit or the byte budget, or a request
    past a stream's cap. What it counts is the caller's to say."""
    response.ClearField("outcome")
    error = response.error
    error.code = _RESOURCE_EXHAUSTED
    error.message = message
    serialized: bytes = response.SerializeToString()
    return serialized
