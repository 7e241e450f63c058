"""The one session core under both clients: what a session is and decides, apart from how
its bytes move.

:class:`~openenv_grpc.client.sync_session.Session` (blocking) and
:class:`~openenv_grpc.client.async_session.AsyncSession` (asyncio) are thin shells over
:class:`SessionBase`: they open the stream, write, read, sleep between open attempts,
close a channel and stop a provider, with blocking calls or with awaits. The vector
shells (``VectorSession``, ``AsyncVectorSession``) move their bytes the same way, over
:class:`StreamBase` too. Everything else lives here once:

- the target: a ``"host:port"`` string (the session then owns a channel), a channel, or a
  stub;
- request ids, envelopes and decoding (:class:`~openenv_grpc.client.protocol.SessionProtocol`);
- the open schedule (:class:`OpenSchedule`: retries while the server is full);
- what the session owns (a channel it made, a provider it launched) and when each goes;
- the reconnect state (a lost stream, and whether the next call opens a fresh one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypedDict, TypeVar

import grpc
from google.protobuf.message import Message

from openenv_grpc.client.channel import auth_metadata
from openenv_grpc.client.errors import CapacityError, SessionRefused, SessionStateError
from openenv_grpc.client.notices import Draining
from openenv_grpc.client.protocol import (
    Metadata,
    SessionProtocol,
    SessionTypes,
    StreamProtocol,
    admitted_session_id,
    refusal,
)
from openenv_grpc.client.retry import OpenRetry
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # typing.Self is 3.11+; only the type checker needs these
    from typing_extensions import Self, Unpack

__all__ = [
    "OpenSchedule",
    "Owned",
    "SessionBase",
    "SessionCore",
    "SessionOptions",
    "SessionSource",
    "StreamBase",
    "launched",
]

ClientT = TypeVar("ClientT")
#: The four message types a typed client pins (``Session[A, O, S, R]``).
ActionT = TypeVar("ActionT", bound=Message)
ObservationT = TypeVar("ObservationT", bound=Message)
StateT = TypeVar("StateT", bound=Message)
ResetOptionsT = TypeVar("ResetOptionsT", bound=Message)


class SessionOptions(TypedDict, total=False):
    """The keyword options of ``Session(target, ...)`` and ``AsyncSession(target, ...)``."""

    #: Extra call metadata, sent when the stream opens.
    metadata: Sequence[tuple[str, str]]
    #: Retries of the open while the server is full (RESOURCE_EXHAUSTED); none by default.
    retry: OpenRetry | None
    #: TLS for the channel the session makes from a ``"host:port"`` target.
    credentials: grpc.ChannelCredentials | None
    #: Sent as ``authorization: Bearer <token>``.
    token: str | None
    #: After the stream was lost, the next call opens a fresh session (reset to go on).
    reconnect: bool


class SessionSource(Protocol):
    """Servers a session can be launched on: any provider of
    :mod:`openenv_grpc.providers`, or anything else with these three methods."""

    def start(self) -> None:
        """Start the servers; return once they serve."""

    def stop(self) -> None:
        """Stop the servers (idempotent)."""

    def session(self, client_class: type[ClientT], **kwargs: Any) -> ClientT:
        """An unopened session of ``client_class`` on the servers."""
        ...


@dataclass(frozen=True, slots=True)
class Owned:
    """Things a session owns and must now let go of (either may be None)."""

    #: A channel the session made from a target string: close it.
    channel: Any = None
    #: A provider the session launched: stop it.
    provider: SessionSource | None = None


#: Nothing to let go of.
NOTHING = Owned()


class OpenSchedule:
    """The attempts of one ``open``: retries while the server answers RESOURCE_EXHAUSTED,
    as ``retry`` allows (none without it)."""

    __slots__ = ("_delays",)

    def __init__(self, retry: OpenRetry | None) -> None:
        self._delays = iter(retry.delays()) if retry is not None else iter(())

    def wait_after(self, refused: CapacityError) -> float:
        """Seconds to sleep before the next attempt: jittered backoff, never shorter than
        the server's pushback hint.

        Raises:
            CapacityError: ``refused`` itself, when no attempt is left.
        """
        bound = next(self._delays, None)
        if bound is None:
            raise refused
        return OpenRetry.wait(bound, refused.retry_after)


ProtocolT = TypeVar("ProtocolT", bound=StreamProtocol)


class SessionCore(Generic[ProtocolT]):
    """The state of one session, whichever shell moves its bytes; ``ProtocolT`` is the
    kind of stream's protocol (one env's, or a vector's)."""

    __slots__ = (
        "call", "channel", "headers", "lost", "metadata", "protocol", "provider", "reconnect",
        "retry", "rpc", "session_id", "stub",
    )  # fmt: skip

    def __init__(
        self,
        types: SessionTypes,
        stub: Any,
        channel: Any,
        metadata: Metadata,
        retry: OpenRetry | None,
        reconnect: bool,
        *,
        rpc: str = "Session",
        protocol: ProtocolT | None = None,
    ) -> None:
        self.protocol: ProtocolT = (
            protocol if protocol is not None else SessionProtocol(types)  # type: ignore[assignment]
        )
        #: The stub's method that opens the stream ("Session", "VectorSession").
        self.rpc = rpc
        #: The headers the server sent when it admitted the stream.
        self.headers: dict[str, str] = {}
        #: The EnvService stub the stream is opened on.
        self.stub = stub
        #: The channel this session made and closes (None when the caller gave one).
        self.channel = channel
        #: A provider this session launched and stops when it ends.
        self.provider: SessionSource | None = None
        self.metadata = tuple(metadata)
        self.retry = retry
        self.reconnect = reconnect
        #: The open stream (the shell's call object), None while closed.
        self.call: Any = None
        #: The stream was lost (not closed by us): with ``reconnect``, the next call reopens.
        self.lost = False
        #: The server's id for this session (it tags the server's log lines), once open.
        self.session_id = ""

    # -- opening ----------------------------------------------------------------------

    def begin_open(self) -> OpenSchedule:
        """The schedule of a new ``open``.

        Raises:
            SessionStateError: the session is open already.
        """
        if self.call is not None:
            raise SessionStateError("session is already open")
        return OpenSchedule(self.retry)

    def open_stream(self, *requests: Any) -> Any:
        """Start the stream's call on the stub (the shell passes its request iterator, if
        its API takes one); returns the call."""
        return getattr(self.stub, self.rpc)(*requests, metadata=self.metadata)

    def admit(self, call: Any, initial_metadata: Metadata | None) -> bool:
        """Take ``call`` as the session's stream if its headers say the server admitted
        it (and made its env); False when they do not (the call then ends refused)."""
        session_id = admitted_session_id(initial_metadata)
        if session_id is None:
            return False
        self.call, self.session_id, self.lost = call, session_id, False
        self.headers = {key: str(value) for key, value in initial_metadata or ()}
        return True

    @staticmethod
    def refused(
        code: grpc.StatusCode, details: str | None, trailers: Metadata | None
    ) -> SessionRefused:
        """The exception for a call that ended without being admitted."""
        return refusal(code, details or "", trailers)

    def failed_open(self) -> Owned:
        """After an open that gave up: what to let go of (nothing when a later call will
        reconnect, which needs the channel and the provider)."""
        return NOTHING if self.reconnect else self._take()

    # -- calls ------------------------------------------------------------------------

    def must_reopen(self) -> bool:
        """A call is about to be made on a stream that was lost and ``reconnect`` is on:
        open a fresh session first (its episode is gone, so only a reset makes sense)."""
        return self.call is None and self.lost and self.reconnect

    def open_call(self) -> Any:
        """The open stream.

        Raises:
            SessionStateError: the session is not open.
        """
        if self.call is None:
            raise SessionStateError(
                "session is not open: use it in a `with` / `async with` block or open() it"
            )
        return self.call

    def stream_lost(self) -> Owned:
        """The stream ended under a call: forget it; what to let go of (the owned channel,
        unless the next call will reconnect)."""
        self.call = None
        self.lost = True
        if self.reconnect:
            return NOTHING
        channel, self.channel = self.channel, None
        return Owned(channel=channel)

    # -- ending -----------------------------------------------------------------------

    def ending(self) -> None:
        """``close`` or ``abort`` started: closed means closed, never reopen."""
        self.reconnect = self.lost = False

    def ended(self) -> Owned:
        """``close`` or ``abort`` is done with the stream: what to let go of (all)."""
        self.call = None
        return self._take()

    def _take(self) -> Owned:
        owned = Owned(self.channel, self.provider)
        self.channel = self.provider = None
        return owned


class StreamBase:
    """What every shell shares that does no I/O: the constructor, the typed-client
    machinery and the stream's identity.

    A shell sets :attr:`_channel_class` (channels it accepts as a target) and
    :attr:`_make_channel` (how it makes one from ``"host:port"``); a kind of stream sets
    :attr:`_rpc`, and may override :meth:`_new_protocol` and :meth:`_open_metadata`.
    """

    #: The stub's method that opens the stream.
    _rpc: ClassVar[str] = "Session"
    _types: ClassVar[SessionTypes] = SessionTypes()
    _core: SessionCore[Any]
    #: The generic class whose type arguments a typed client pins (the shell itself).
    _generic_origin: ClassVar[type[Any] | None] = None
    _channel_class: ClassVar[type[Any]]
    _make_channel: ClassVar[Callable[..., Any]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls._generic_origin is not None:
            cls._types = SessionTypes.from_generic(cls, (cls._generic_origin,))

    def __init__(self, target: Any, **options: Unpack[SessionOptions]) -> None:
        unknown = set(options) - set(SessionOptions.__annotations__)
        if unknown:
            raise TypeError(f"unknown session option(s): {', '.join(sorted(unknown))}")
        channel = None
        if isinstance(target, str):
            # Looked up on the class: a plain function kept as a class attribute.
            make_channel = type(self)._make_channel
            channel = target = make_channel(target, options.get("credentials"))
        if isinstance(target, self._channel_class):
            target = pb_grpc.EnvServiceStub(target)
        metadata = (
            *auth_metadata(options.get("token")),
            *options.get("metadata", ()),
            *self._open_metadata(),
        )
        self._core = SessionCore(
            self._types,
            target,
            channel,
            metadata,
            options.get("retry"),
            options.get("reconnect", False),
            rpc=self._rpc,
            protocol=self._new_protocol(),
        )

    def _new_protocol(self) -> StreamProtocol | None:
        """The stream's protocol (None: a one-env session's)."""
        return None

    def _open_metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata the kind of stream sends when it opens."""
        return ()

    @property
    def session_id(self) -> str:
        """The server's id for this session (it tags the server's log lines); "" before
        the session is open."""
        return self._core.session_id

    @property
    def draining(self) -> Draining | None:
        """The server's DRAINING notice once the session has read one (None before):
        the session ends at its deadline. Notices are read on the way to a call's answer,
        so this turns on at the first call after the server began to drain."""
        draining: Draining | None = self._core.protocol.draining
        return draining

    def _adopt(self, provider: SessionSource) -> Self:
        """Own ``provider``: the session stops it when it ends or fails to open."""
        self._core.provider = provider
        return self


class SessionBase(StreamBase):
    """What ``Session`` and ``AsyncSession`` add: the one env's episode."""

    _core: SessionCore[SessionProtocol]

    @property
    def episode_id(self) -> str:
        """The current episode's id ("" before the first reset)."""
        return self._core.protocol.episode_id

    @property
    def step_count(self) -> int:
        """Steps taken in the current episode, as the server last said."""
        return self._core.protocol.step_count


def launched(cls: type[ClientT], provider: SessionSource, kwargs: dict[str, Any]) -> ClientT:
    """A session of ``cls`` on the started ``provider``, owning it.

    Raises:
        Exception: whatever making the session raised; the provider is stopped first
            (here, blocking: this only happens for a programming error such as a bad
            keyword argument).
    """
    try:
        session = provider.session(cls, **kwargs)
    except BaseException:
        provider.stop()
        raise
    if not isinstance(session, StreamBase):
        provider.stop()
        raise TypeError(f"{cls.__qualname__} is not a session class (Session, AsyncSession, ...)")
    return session._adopt(provider)
