"""The transport-free half of a client session, shared by the sync and async sessions.

It builds request envelopes, matches responses to request ids, decodes typed payloads
and turns errors and final statuses into exceptions, so that ``Session`` and
``AsyncSession`` differ only in how they move bytes. :class:`StreamProtocol` is what a
Session and a VectorSession stream share (ids, notices, errors, decoding);
:class:`SessionProtocol` adds the one-env commands (the vector ones are in
``vector_protocol.py``).
"""

from __future__ import annotations

import re
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import grpc
from google.protobuf import any_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

from openenv_grpc.client.errors import (
    CapacityError,
    EnvError,
    InvalidRequest,
    PayloadTypeError,
    ProtocolError,
    SessionLost,
    SessionRefused,
)
from openenv_grpc.client.fields import name_field_errors
from openenv_grpc.client.notices import Draining, read_notice
from openenv_grpc.client.outcome import Restored, StepOutcome
from openenv_grpc.codec import PayloadError, info_of, pack, type_name, unpack
from openenv_grpc.metadata import ADMITTED_KEY, RETRY_PUSHBACK_KEY, SESSION_ID_KEY
from openenv_grpc.v1 import session_pb2 as pb

__all__ = [
    "Metadata",
    "SessionProtocol",
    "SessionTypes",
    "StreamProtocol",
    "admitted_session_id",
    "checked_seed",
    "fill_reset",
    "lost",
    "nothing_listening",
    "pack_typed",
    "refusal",
    "status_code",
]

Metadata = Iterable[tuple[str, Any]]


@dataclass(frozen=True, slots=True)
class SessionTypes:
    """Message classes a typed client pins; None decodes whatever type the server sent."""

    action: type[Message] | None = None
    observation: type[Message] | None = None
    state: type[Message] | None = None
    reset_options: type[Message] | None = None

    @classmethod
    def from_generic(cls, klass: type[Any], origins: tuple[type[Any], ...]) -> SessionTypes:
        """Read ``Session[A, O, S, R]``-style type arguments off a typed client class;
        their constructors then name the field in their errors (``fields.py``)."""
        for base_class in klass.__mro__:
            for base in getattr(base_class, "__orig_bases__", ()):
                if typing.get_origin(base) in origins:
                    args = [
                        a if isinstance(a, type) and issubclass(a, Message) else None
                        for a in typing.get_args(base)
                    ]
                    if any(args):
                        for message_class in args:
                            if message_class is not None:
                                name_field_errors(message_class)
                        return cls(*args)
        return cls()


class StreamProtocol:
    """Request ids, envelopes, notices and decoding: what every kind of stream shares.
    Its requests and responses have the same field numbers for the id, close, error and
    notice (see session.proto), whichever message types a stream uses."""

    __slots__ = ("_next_id", "_types", "draining")

    #: The stream's request message.
    _request_class: ClassVar[type[Any]] = pb.SessionRequest

    def __init__(self, types: SessionTypes) -> None:
        self._types = types
        # Request ids start at 1: proto3 leaves 0 off the wire, and 0 is the server's id
        # for messages it sends on its own.
        self._next_id = 1
        #: The server's DRAINING notice, once one was read.
        self.draining: Draining | None = None

    def _envelope(self) -> Any:
        request = self._request_class(request_id=self._next_id)
        self._next_id += 1
        return request

    def close_request(self) -> Any:
        request = self._envelope()
        request.close.SetInParent()
        return request

    def close_result(self, response: Any) -> None:
        self._outcome(response, "closed")

    def is_stale(self, response: Any, request: Any) -> bool:
        """True for what is not the answer to ``request``: the late answer to an earlier
        request (one the caller gave up on), or a notice (request id 0, kept)."""
        if response.request_id == request.request_id:
            return False
        if response.request_id == 0 and response.WhichOneof("outcome") == "notice":
            self.draining = read_notice(response.notice) or self.draining
            return True
        if response.request_id < request.request_id:
            return True
        raise ProtocolError(
            f"response to request {response.request_id} arrived while waiting for "
            f"{request.request_id}"
        )

    def query_result(self, response: Any, expected: str) -> Any:
        """The ``expected`` result field of a query's answer.

        Raises:
            EnvError: the server answered with an error. ProtocolError: with something else.
        """
        return self._outcome(response, expected)

    def decode(self, payload: any_pb2.Any, role: str) -> Any:
        """A payload as the message of its ``role`` (a typed client's pinned type, else
        the registered type its URL names, else the raw ``Any``).

        Raises:
            ProtocolError: the payload does not parse as that type.
        """
        return self._decode(payload, role)

    def _outcome(self, response: Any, expected: str) -> Any:
        outcome = response.WhichOneof("outcome")
        if outcome == expected:
            return getattr(response, expected)
        if outcome == "error":
            error = response.error
            raise EnvError(status_code(error.code), error.message, error.exception_type)
        raise ProtocolError(f"expected a {expected!r} response, got {outcome!r}")

    def _decode(self, payload: any_pb2.Any, role: str) -> Any:
        message_class: type[Message] | None = getattr(self._types, role)
        if message_class is None:
            message_class = _registered_class(payload.type_url)
            if message_class is None:
                return payload  # type unknown to this process: hand over the raw Any
        try:
            return unpack(payload, message_class, f"the server's {role}")
        except PayloadError as exc:
            raise ProtocolError(str(exc)) from None


class SessionProtocol(StreamProtocol):
    """Request ids, envelopes and decoding for one session."""

    __slots__ = ("episode_id", "step_count")

    def __init__(self, types: SessionTypes) -> None:
        super().__init__(types)
        self.episode_id = ""
        self.step_count = 0

    # -- requests ---------------------------------------------------------------------

    def reset_request(
        self, seed: int | None, episode_id: str | None, options: Message | None
    ) -> pb.SessionRequest:
        request: pb.SessionRequest = self._envelope()
        request.reset.SetInParent()
        fill_reset(request.reset, seed, episode_id, options, self._types.reset_options)
        return request

    def step_request(self, action: Message) -> pb.SessionRequest:
        request: pb.SessionRequest = self._envelope()
        pack_typed(request.step.action, action, self._types.action, "action")
        return request

    def query_request(self, command: str) -> pb.SessionRequest:
        """A per-env query (``state``, ``snapshot``, ``render``: its command field)."""
        request: pb.SessionRequest = self._envelope()
        getattr(request, command).SetInParent()
        return request

    def replayed_reset(self, command: pb.ResetCommand) -> pb.SessionRequest:
        """A reset exactly as an earlier one was sent (recovery replays it)."""
        request: pb.SessionRequest = self._envelope()
        request.reset.CopyFrom(command)
        return request

    def replayed_step(self, action: any_pb2.Any) -> pb.SessionRequest:
        """A step with an action exactly as it was packed before (recovery replays it)."""
        request: pb.SessionRequest = self._envelope()
        request.step.action.CopyFrom(action)
        return request

    def restore_request(self, data: bytes) -> pb.SessionRequest:
        """Raises TypeError: ``data`` is not bytes (nothing is sent)."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"a snapshot is bytes, got {type(data).__qualname__}")
        request: pb.SessionRequest = self._envelope()
        request.restore.snapshot = bytes(data)
        return request

    # -- responses --------------------------------------------------------------------

    def step_result(self, response: pb.SessionResponse) -> StepOutcome[Any]:
        result = self._outcome(response, "result")
        self.episode_id = result.episode_id
        self.step_count = result.step_count
        return StepOutcome(
            observation=self._decode(result.observation, "observation"),
            reward=result.reward,
            terminated=result.terminated,
            truncated=result.truncated,
            episode_id=result.episode_id,
            step_count=result.step_count,
            info=info_of(result.info, result.info_json),
            no_reward=result.no_reward,
        )

    def snapshot_result(self, response: pb.SessionResponse) -> bytes:
        result = self._outcome(response, "snapshot")
        return bytes(result.snapshot)

    def restore_result(self, response: pb.SessionResponse) -> Restored:
        result = self._outcome(response, "restored")
        self.episode_id = result.episode_id
        self.step_count = result.step_count
        return Restored(result.episode_id, result.step_count, result.terminated, result.truncated)


def pack_typed(
    target: any_pb2.Any, message: Message, pinned: type[Message] | None, what: str
) -> None:
    """Pack ``message`` into ``target``, checking it against the type a typed client pins.

    Raises:
        PayloadTypeError: ``message`` is not a protobuf message, or not of the ``pinned``
            type (nothing is sent); the error names ``what`` and the type it accepts.
    """
    if pinned is not None and not isinstance(message, pinned):
        raise PayloadTypeError(
            f"{what} must be {pinned.DESCRIPTOR.full_name}, got {type(message).__qualname__}"
        )
    if not isinstance(message, Message):
        raise PayloadTypeError(f"{what} must be a protobuf message, got {_kind(message)}")
    pack(message, target)


#: The seed field is a uint64 (session.proto): what a seed may be.
SEED_MAX = 2**64 - 1


def fill_reset(
    reset: pb.ResetCommand,
    seed: Any,
    episode_id: Any,
    options: Message | None,
    options_class: type[Message] | None,
) -> None:
    """Put a reset's arguments in ``reset``, checked as they are sent.

    Raises:
        ValueError: the seed is out of range. PayloadTypeError: a wrong type.
    """
    if seed is not None:
        reset.seed = checked_seed(seed)
    if episode_id is not None:
        if not isinstance(episode_id, str):
            raise PayloadTypeError(
                f"episode_id must be a str or None, got {type(episode_id).__qualname__}"
            )
        reset.episode_id = episode_id
    if options is not None:
        pack_typed(reset.options, options, options_class, "options")


def checked_seed(seed: Any, what: str = "seed") -> int:
    """``seed`` as the int the wire carries (a Python or numpy integer).

    Raises:
        PayloadTypeError: ``seed`` is not an integer (a str, a float, a bool).
        InvalidRequest: ``seed`` is outside 0..2**64-1.
    """
    if isinstance(seed, bool) or not hasattr(seed, "__index__"):
        raise PayloadTypeError(
            f"{what} must be an int from 0 to 2**64-1 or None, got {_kind(seed)}"
        )
    value = seed.__index__()
    if not 0 <= value <= SEED_MAX:
        raise InvalidRequest(f"{what} must be an int from 0 to 2**64-1 or None, got {value}")
    return int(value)


def _kind(value: Any) -> str:
    """How an error names a wrong argument: its type, and a short repr."""
    shown = repr(value)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return f"{type(value).__qualname__} {shown}"


def _registered_class(url: str) -> type[Message] | None:
    try:
        descriptor = descriptor_pool.Default().FindMessageTypeByName(type_name(url))
    except KeyError:
        return None
    return message_factory.GetMessageClass(descriptor)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    """The gRPC status code with this number (UNKNOWN for a number gRPC does not know)."""
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


def refusal(code: grpc.StatusCode, details: str, trailers: Metadata | None) -> SessionRefused:
    """The exception for a Session call that ended before it was admitted."""
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return CapacityError(code, details, _pushback(trailers))
    return SessionRefused(code, nothing_listening(code, details) or details)


#: gRPC's words for a refused TCP connection, and the address it names.
_REFUSED = re.compile(r"(?:ipv4|ipv6):(\S+?): [^;]*Connection refused")


def nothing_listening(code: grpc.StatusCode | None, details: str | None) -> str | None:
    """ "nothing is listening on HOST:PORT ..." when a call failed because the connection
    was refused (gRPC's own words bury it in "failed to connect to all addresses"), else
    None."""
    if code is not grpc.StatusCode.UNAVAILABLE or not details:
        return None
    match = _REFUSED.search(details)
    if match is None:
        return None
    return f"nothing is listening on {match.group(1)} (connection refused): is the server up?"


def lost(code: grpc.StatusCode | None, details: str | None) -> SessionLost:
    """The exception for a stream that ended while the session was in use."""
    if code is None or code is grpc.StatusCode.OK:
        return SessionLost(grpc.StatusCode.UNAVAILABLE, "the server ended the session")
    return SessionLost(code, details or "stream ended")


def _pushback(trailers: Metadata | None) -> float | None:
    for key, value in trailers or ():
        if key == RETRY_PUSHBACK_KEY:
            try:
                return int(value) / 1000.0
            except (TypeError, ValueError):
                return None
    return None


def admitted_session_id(initial_metadata: Metadata | None) -> str | None:
    """The session id from headers that say the session was admitted and its env exists
    ("" if the server sent none); None when the headers do not say so."""
    items = dict(initial_metadata or ())
    if ADMITTED_KEY not in items:
        return None
    return str(items.get(SESSION_ID_KEY, ""))
