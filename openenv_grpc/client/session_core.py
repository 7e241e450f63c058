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
- what the session owns (a channel it made, shared with its forks; a provider it
  launched) and when each goes;
- the reconnect state (a lost stream, and whether the next call opens a fresh one);
- forks: unopened sessions of the same class on the same server and channel.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypedDict, TypeVar

import grpc
from google.protobuf.message import Message

from openenv_grpc.client.channel import auth_metadata
from openenv_grpc.client.errors import (
    CapacityError,
    SessionLost,
    SessionRefused,
    SessionStateError,
)
from openenv_grpc.client.notices import Draining
from openenv_grpc.client.protocol import (
    Metadata,
    SessionProtocol,
    SessionTypes,
    StreamProtocol,
    admitted_session_id,
    refusal,
)
from openenv_grpc.client.recovery import RecoveringCalls, Recovery
from openenv_grpc.client.retry import OpenRetry
from openenv_grpc.metadata import INFO_JSON, INFO_KEY
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # typing.Self is 3.11+; only the type checker needs these
    from typing_extensions import Self, Unpack

__all__ = [
    "ChannelShare",
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
    #: Survive a lost stream: reopen (here or on another target), restore, replay, go on.
    recovery: Recovery | None


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


class ChannelShare:
    """A channel a session made from a target string, shared with the sessions forked
    from it: the last of them to let go closes it (so a parent closed before its forks
    leaves them working)."""

    __slots__ = ("_lock", "_users", "channel")

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self._users = 1
        self._lock = threading.Lock()  # sync forks may live in other threads

    def join(self) -> ChannelShare:
        """One more session uses the channel; returns this share."""
        with self._lock:
            self._users += 1
        return self

    def leave(self) -> Any:
        """One session is done with the channel: returns it to close when that session
        was the last user, else None."""
        with self._lock:
            self._users -= 1
            return self.channel if self._users == 0 else None


#: Backoff before each retry of a stream the server refused unprocessed (HTTP/2
#: REFUSED_STREAM). It happens when a connection has as many streams open as the
#: server's per-connection limit (and a just-ended stream still counts on its side):
#: the server did nothing, so another attempt is always safe.
UNPROCESSED_RETRY_DELAYS = (0.005, 0.02, 0.05, 0.1, 0.2, 0.5)


class OpenSchedule:
    """The attempts of one ``open``: retries while the server answers RESOURCE_EXHAUSTED,
    as ``retry`` allows (none without it), and a few times when it refused the stream
    before any processing (``UNPROCESSED_RETRY_DELAYS``)."""

    __slots__ = ("_delays", "_unprocessed")

    def __init__(self, retry: OpenRetry | None) -> None:
        self._delays = iter(retry.delays()) if retry is not None else iter(())
        self._unprocessed = iter(UNPROCESSED_RETRY_DELAYS)

    def wait_after(self, refused: SessionRefused) -> float:
        """Seconds to sleep before the next attempt: for a full server, jittered backoff
        never shorter than its pushback hint.

        Raises:
            SessionRefused: ``refused`` itself, when it is not worth another attempt or
                no attempt is left.
        """
        if isinstance(refused, CapacityError):
            bound = next(self._delays, None)
            if bound is None:
                raise refused
            return OpenRetry.wait(bound, refused.retry_after)
        if refused.unprocessed:
            delay = next(self._unprocessed, None)
            if delay is not None:
                return delay
        raise refused


ProtocolT = TypeVar("ProtocolT", bound=StreamProtocol)


class SessionCore(Generic[ProtocolT]):
    """The state of one session, whichever shell moves its bytes; ``ProtocolT`` is the
    kind of stream's protocol (one env's, or a vector's)."""

    __slots__ = (
        "call", "dial", "headers", "lost", "metadata", "protocol", "provider", "reconnect",
        "recovering", "retry", "rpc", "session_id", "share", "stub",
    )  # fmt: skip

    def __init__(
        self,
        types: SessionTypes,
        stub: Any,
        channel: Any,
        metadata: Metadata,
        retry: OpenRetry | None,
        reconnect: bool,
        dial: Callable[[], Any] | None = None,
        recovering: bool = False,
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
        #: The channel this session made (None when the caller gave one), shared with its
        #: forks: the last of them to end closes it.
        self.share = ChannelShare(channel) if channel is not None else None
        #: Makes the owned channel anew for an open after the last one was let go (None
        #: when the caller gave the channel).
        self.dial = dial
        #: A provider this session launched and stops when it ends.
        self.provider: SessionSource | None = None
        self.metadata = tuple(metadata)
        self.retry = retry
        self.reconnect = reconnect
        #: Recovery is on: a lost stream keeps the channel and the provider for reopening.
        self.recovering = recovering
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
        if self.share is None and self.dial is not None:
            # Closed or lost before: a session that owns its channel makes a new one.
            channel = self.dial()
            self.share = ChannelShare(channel)
            self.stub = pb_grpc.EnvServiceStub(channel)
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
        return NOTHING if self.reconnect or self.recovering else self._take()

    # -- calls ------------------------------------------------------------------------

    def must_reopen(self) -> bool:
        """A call is about to be made on a stream that was lost and ``reconnect`` is on:
        open a fresh session first (its episode is gone, so only a reset makes sense)."""
        return self.call is None and self.lost and self.reconnect

    def open_call(self) -> Any:
        """The open stream.

        Raises:
            SessionLost: the stream was lost and recovery is on: it will try again.
            SessionStateError: the session is not open.
        """
        if self.call is None:
            if self.lost and self.recovering:  # a recovery gave up before: try once more
                raise SessionLost(grpc.StatusCode.UNAVAILABLE, "the session was lost earlier")
            raise SessionStateError(
                "session is not open: use it in a `with` / `async with` block or open() it"
            )
        return self.call

    def stream_lost(self) -> Owned:
        """The stream ended under a call: forget it; what to let go of (the owned channel,
        unless the next call will reconnect)."""
        self.call = None
        self.lost = True
        if self.reconnect or self.recovering:
            return NOTHING
        share, self.share = self.share, None
        return Owned(channel=share.leave() if share is not None else None)

    def drop_call(self) -> Any:
        """Forget the stream (recovery moves on from it): returns it to cancel, or None."""
        call, self.call = self.call, None
        return call

    # -- ending -----------------------------------------------------------------------

    def ending(self) -> None:
        """``close`` or ``abort`` started: closed means closed, never reopen."""
        self.reconnect = self.lost = self.recovering = False

    def ended(self) -> Owned:
        """``close`` or ``abort`` is done with the stream: what to let go of (all)."""
        self.call = None
        return self._take()

    def _take(self) -> Owned:
        share, self.share = self.share, None
        owned = Owned(share.leave() if share is not None else None, self.provider)
        self.provider = None
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
        #: What the session was made with: its forks are made the same way.
        self._options: SessionOptions = options
        channel = dial = None
        #: The target string this session makes its channels from (None: given one).
        self._home: str | None = target if isinstance(target, str) else None
        if isinstance(target, str):
            dial = functools.partial(self._new_channel, target)
            channel = target = dial()
        if isinstance(target, self._channel_class):
            target = pb_grpc.EnvServiceStub(target)
        #: The stub it was given or made first: where recovery goes back to.
        self._home_stub = target
        metadata = (
            *auth_metadata(options.get("token")),
            *options.get("metadata", ()),
            *self._open_metadata(),
            (INFO_KEY, INFO_JSON),  # infos as JSON text: ints stay ints
        )
        recovery = options.get("recovery")
        self._core = SessionCore(
            self._types,
            target,
            channel,
            metadata,
            options.get("retry"),
            options.get("reconnect", False),
            dial,
            recovering=recovery is not None,
            rpc=self._rpc,
            protocol=self._new_protocol(),
        )
        #: The calls with recovery on (None: off, the shells' direct paths).
        self._recovering = (
            RecoveringCalls(recovery, self._core.protocol, self)  # type: ignore[arg-type]
            if recovery is not None
            else None
        )

    def _new_protocol(self) -> StreamProtocol | None:
        """The stream's protocol (None: a one-env session's)."""
        return None

    def _open_metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata the kind of stream sends when it opens."""
        return ()

    def _new_channel(self, target: str) -> Any:
        """A channel to ``target`` made the way this session makes its own."""
        # Looked up on the class: a plain function kept as a class attribute.
        return type(self)._make_channel(target, self._options.get("credentials"))

    @property
    def recoveries(self) -> int:
        """Lost streams this session recovered from (0 without ``recovery``)."""
        return self._recovering.recoveries if self._recovering is not None else 0

    def _retarget(self, target: str | None) -> Owned:
        """Point the session, for its next open, at ``target`` (None: its own) on a fresh
        channel -- or back at the channel it was given; returns what to let go of."""
        core = self._core
        old = core.share
        home = self._home
        if target is None and home is None:
            core.stub, core.share = self._home_stub, None
        else:
            channel = self._new_channel(target or home)  # type: ignore[arg-type]
            core.stub, core.share = pb_grpc.EnvServiceStub(channel), ChannelShare(channel)
        return Owned(channel=old.leave() if old is not None else None)

    @property
    def session_id(self) -> str:
        """The server's id for this session (it tags the server's log lines); "" before
        the session is open."""
        return self._core.session_id

    @property
    def is_open(self) -> bool:
        """True while the stream is open: False before :meth:`open`, after ``close`` or
        ``abort``, and once the stream has ended (a lost stream may show here before the
        next call raises ``SessionLost``)."""
        call = self._core.call
        return call is not None and not call.done()

    @property
    def draining(self) -> Draining | None:
        """The server's DRAINING notice once the session has read one (None before):
        the session ends at its deadline. Notices are read on the way to a call's answer,
        so this turns on at the first call after the server began to drain."""
        draining: Draining | None = self._core.protocol.draining
        return draining

    def _forks(self, n: int | None) -> list[Self]:
        """``n`` (None: one) unopened sessions of this class on this session's server,
        channel and options, for a fork; each must be opened, or aborted to let go of
        the shared channel. The provider stays with this session.

        Raises:
            ValueError: ``n`` is below 1.
        """
        count = 1 if n is None else n
        if count < 1:
            raise ValueError(f"fork needs n >= 1, got {n}")
        children = [type(self)(self._core.stub, **self._options) for _ in range(count)]
        for child in children:
            self._share_with(child)
        return children

    def _share_with(self, child: StreamBase) -> None:
        """``child`` (made on this session's stub) uses this session's server and channel:
        it keeps the channel alive while it runs, and reopens to the same target."""
        core = self._core
        child._home = self._home  # recovery makes fresh channels to the same target
        child._core.dial = core.dial  # so does an open after close
        if core.share is not None:
            child._core.share = core.share.join()

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
