"""``Session``: one environment instance over one stream, for blocking code.

``with Session(target) as env: env.reset(); env.step(action)``. Built on gRPC's blocking
API: requests go through a queue that gRPC's sender thread drains, answers are read in
the caller's thread. What a session is and decides lives in
:mod:`openenv_grpc.client.session_core`; this shell only moves bytes. For many sessions
in one process, prefer :class:`~openenv_grpc.client.async_session.AsyncSession`.
"""

from __future__ import annotations

import concurrent.futures
import queue
import time
from collections.abc import Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, overload

import grpc

from openenv_grpc.client import session_core
from openenv_grpc.client.channel import sync_channel
from openenv_grpc.client.errors import SessionLost, SessionRefused, SessionTimeout
from openenv_grpc.client.outcome import Restored, StepOutcome
from openenv_grpc.client.protocol import SessionProtocol, lost
from openenv_grpc.client.queries import SessionQueries
from openenv_grpc.client.recovery import run_blocking
from openenv_grpc.client.session_core import ActionT, ObservationT, ResetOptionsT, StateT
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # only the type checker needs these
    from typing_extensions import Self, Unpack

    from openenv_grpc.client.session_core import SessionOptions

__all__ = ["Session", "SyncStream"]


#: What a read returns once the stream is over.
_END: Any = object()


class _RequestQueue(Iterator[Any]):
    """The request side of the stream; ``end()`` half-closes it (and frees gRPC's thread)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def __next__(self) -> Any:
        item = self._queue.get()
        if item is None:
            self._queue.put(None)  # stay ended for any later next()
            raise StopIteration
        return item

    def put(self, request: Any) -> None:
        self._queue.put(request)

    def end(self) -> None:
        self._queue.put(None)


class SyncStream(session_core.StreamBase):
    """The blocking transport of a stream (one env's or a vector's): open with retries,
    write through a queue gRPC's sender thread drains, read in the caller's thread (or a
    helper thread for a timed call), close or abort, and let go of what it owns. The
    kind of stream's commands are the subclass's (:class:`Session`, ``VectorSession``).
    """

    _channel_class = grpc.Channel
    _make_channel = sync_channel

    def __init__(self, target: Any, **options: Unpack[SessionOptions]) -> None:
        super().__init__(target, **options)
        self._requests: _RequestQueue | None = None
        #: Reads for timed calls (started on the first one), and a read a timed-out call
        #: left running; its answer is stale when it comes.
        self._reader: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future[Any] | None = None

    # -- lifecycle --------------------------------------------------------------------

    @classmethod
    def launch(cls, provider: session_core.SessionSource, **kwargs: Any) -> Self:
        """Start ``provider`` and return an unopened session on it that owns it: closing or
        aborting the session, or a failed :meth:`open`, stops the provider's servers.
        ``kwargs`` go to the constructor.

        Raises:
            ProviderError: the servers did not start (nothing is left running).
        """
        provider.start()
        return session_core.launched(cls, provider, kwargs)

    def __enter__(self) -> Self:
        if self._core.call is None:  # a fork arrives open
            self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def open(self) -> None:
        """Open the stream; the server creates the environment.

        Raises:
            CapacityError: the server is full (after the retries ``retry`` allows).
            SessionRefused: the server is unreachable, draining or refused the caller.
            SessionStateError: the session is open already.
        """
        schedule = self._core.begin_open()
        try:
            while (refused := self._open_once()) is not None:
                time.sleep(schedule.wait_after(refused))
        except BaseException:
            self._let_go(self._core.failed_open())
            raise

    def _open_once(self) -> SessionRefused | None:
        """One attempt: None once admitted, else the refusal (the schedule decides
        whether another attempt follows)."""
        core = self._core
        requests = _RequestQueue()
        call = core.open_stream(requests)
        if core.admit(call, call.initial_metadata()):
            self._requests = requests
            return None
        requests.end()
        return core.refused(call.code(), call.details(), call.trailing_metadata())

    def close(self) -> None:
        """Close the environment and the stream. Safe to call twice.

        Raises:
            EnvError: the environment's ``close`` raised (it is gone all the same).
        """
        core = self._core
        core.ending()
        try:
            if core.call is not None:
                core.protocol.close_result(self._roundtrip(core.protocol.close_request()))
                if core.call is not None:
                    core.call.code()  # the server ends the stream right after its answer
        except SessionLost:
            pass  # already ended by the server: nothing left to close
        finally:
            self._end_stream()
            self._let_go(core.ended())

    def abort(self) -> None:
        """Cancel the stream at once; the server closes the environment on its side."""
        core = self._core
        core.ending()
        if core.call is not None:
            core.call.cancel()
        self._end_stream()
        self._let_go(core.ended())

    def _end_stream(self) -> None:
        """Release gRPC's sender thread (it waits on the queue) and the reader."""
        if self._requests is not None:
            self._requests.end()
            self._requests = None
        self._pending = None
        if self._reader is not None:
            # Its read ends with the stream (cancelled or finished); do not wait for it.
            self._reader.shutdown(wait=False)
            self._reader = None

    @staticmethod
    def _let_go(owned: session_core.Owned) -> None:
        if owned.channel is not None:
            owned.channel.close()
        if owned.provider is not None:
            owned.provider.stop()

    # -- transport --------------------------------------------------------------------

    def _roundtrip(self, request: Any, timeout: float | None = None) -> Any:
        if self._core.must_reopen():
            self.open()
        call = self._core.open_call()
        assert self._requests is not None  # set with the call
        self._requests.put(request)
        try:
            while (response := self._read(call, timeout)) is not _END:
                if not self._core.protocol.is_stale(response, request):
                    return response
            error = lost(call.code(), call.details())
        except grpc.RpcError as exc:
            error = lost(exc.code(), exc.details())
        self._end_stream()
        self._let_go(self._core.stream_lost())
        raise error

    def _read(self, call: Any, timeout: float | None) -> Any:
        """The stream's next answer (``_END`` once it is over).

        Raises:
            SessionTimeout: none within ``timeout``; the read goes on for the next call.
            grpc.RpcError: the stream failed.
        """
        if timeout is None and self._pending is None:
            return next(call, _END)  # the fast path: this thread reads
        if self._pending is None:
            if self._reader is None:
                self._reader = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="openenv-session-read"
                )
            self._pending = self._reader.submit(next, call, _END)
        try:
            response = self._pending.result(timeout)
        except concurrent.futures.TimeoutError:
            raise SessionTimeout(timeout or 0.0) from None
        finally:
            if self._pending is not None and self._pending.done():
                self._pending = None
        return response


class Session(
    SyncStream,
    session_core.SessionBase,
    SessionQueries[StateT],
    Generic[ActionT, ObservationT, StateT, ResetOptionsT],
):
    """A blocking session: ``with EchoEnv("127.0.0.1:50051") as env: env.reset()``.

    ``target`` is a ``"host:port"`` string (the session owns a channel to it), a
    ``grpc.Channel`` or an ``EnvServiceStub`` over one; many sessions may share a channel.
    Subclass it with concrete types (``Session[A, O, S, R]``) for a typed client that
    checks what it sends and decodes what it gets; the untyped session decodes any message
    type imported in this process.

    Options (keywords): ``credentials`` (see
    :func:`openenv_grpc.client.channel.tls_credentials`) make the owned channel TLS;
    ``token`` is sent as ``authorization: Bearer <token>``; ``metadata`` is added to the
    call; ``retry`` (an :class:`~openenv_grpc.client.retry.OpenRetry`) retries the open
    while the server is full; with ``reconnect``, a call made after the stream was lost
    (:class:`SessionLost`) first opens a fresh session; the call that saw the loss still
    raises, because its episode is gone: reset to go on. With ``recovery`` (a
    :class:`~openenv_grpc.client.recovery.Recovery`), no call raises for a lost stream
    the session can come back from: it reopens, restores its last snapshot, replays the
    actions since and goes on with the same episode (``recoveries`` counts it).

    Each call takes a ``timeout``: :class:`SessionTimeout` leaves the session open and the
    late answer is dropped when it comes. Calls without a timeout read in the caller's
    thread; a timed call reads in a helper thread of the session, so that the caller can
    stop waiting. Calls on one session must not overlap.
    """

    def __init__(
        self, target: str | grpc.Channel | pb_grpc.EnvServiceStub, **options: Unpack[SessionOptions]
    ) -> None:
        super().__init__(target, **options)

    # -- commands ---------------------------------------------------------------------

    def reset(
        self, *, seed: int | None = None, episode_id: str | None = None,
        options: ResetOptionsT | None = None, timeout: float | None = None,
    ) -> StepOutcome[ObservationT]:  # fmt: skip
        """Start a new episode; returns its first observation.

        Raises:
            EnvError: the options were refused or the environment raised.
            SessionLost: the stream ended. SessionTimeout: no answer within ``timeout``.
        """
        if self._recovering is not None:
            return run_blocking(self._recovering.reset(seed, episode_id, options, timeout))
        request = self._core.protocol.reset_request(seed, episode_id, options)
        return self._core.protocol.step_result(self._roundtrip(request, timeout))

    def step(self, action: ActionT, *, timeout: float | None = None) -> StepOutcome[ObservationT]:
        """Apply ``action``; returns the resulting observation, reward and flags.

        Raises:
            EnvError: INVALID_ARGUMENT (bad action), FAILED_PRECONDITION (no episode
                running), DEADLINE_EXCEEDED (the server's step timeout) or INTERNAL (the
                environment raised).
            PayloadTypeError: a typed client got an action of another type (not sent).
            SessionLost: the stream ended. SessionTimeout: no answer within ``timeout``.
        """
        if self._recovering is not None:
            return run_blocking(self._recovering.step(action, timeout))
        request = self._core.protocol.step_request(action)
        return self._core.protocol.step_result(self._roundtrip(request, timeout))

    def _ask(self, command: str, result: str, timeout: float | None) -> Any:
        if self._recovering is not None:
            return run_blocking(self._recovering.ask(command, result, timeout))
        protocol = self._core.protocol
        return protocol.query_result(
            self._roundtrip(protocol.query_request(command), timeout), result
        )

    def _session_protocol(self) -> SessionProtocol:
        return self._core.protocol

    def snapshot(self, *, timeout: float | None = None) -> bytes:
        """The current episode as bytes this client keeps (the env's own bytes plus the
        episode id, step count and phase, signed by the server): :meth:`restore` them on
        this session, a fork, or any server of the same env and version holding the key.
        Signed, not encrypted: whoever holds them can read them.

        Raises:
            EnvError: UNIMPLEMENTED (the env has no snapshots), FAILED_PRECONDITION (no
                episode yet), RESOURCE_EXHAUSTED (over the server's snapshot limit),
                INVALID_ARGUMENT or INTERNAL (the env refused or raised); the episode goes
                on in every case.
            SessionLost: the stream ended. SessionTimeout: no answer within ``timeout``.
        """
        if self._recovering is not None:
            return run_blocking(self._recovering.snapshot(timeout))
        request = self._core.protocol.query_request("snapshot")
        return self._core.protocol.snapshot_result(self._roundtrip(request, timeout))

    def restore(self, data: bytes, *, timeout: float | None = None) -> Restored:
        """Continue from a snapshot: this session's episode becomes the captured one,
        with its episode id and step count; returns where it now is.

        Raises:
            EnvError: INVALID_ARGUMENT (not one intact snapshot: altered, truncated, over
                the server's limit; or the env refused it), FAILED_PRECONDITION (signed by
                a key this server does not hold, of another env or env version),
                UNIMPLEMENTED (the env has no snapshots): the episode is unchanged.
                INTERNAL: the env's restore raised (reset to go on).
            TypeError: ``data`` is not bytes (nothing sent).
            SessionLost: the stream ended. SessionTimeout: no answer within ``timeout``.
        """
        if self._recovering is not None:
            return run_blocking(self._recovering.restore(data, timeout))
        request = self._core.protocol.restore_request(data)
        return self._core.protocol.restore_result(self._roundtrip(request, timeout))

    @overload
    def fork(self, n: None = None, *, timeout: float | None = None) -> Self: ...
    @overload
    def fork(self, n: int, *, timeout: float | None = None) -> list[Self]: ...
    def fork(self, n: int | None = None, *, timeout: float | None = None) -> Self | list[Self]:
        """Branch the episode: a snapshot of this session restored in a new open session
        of the same class (``n``: a list of ``n`` of them), on the same server and
        channel, admitted like any open (``retry`` applies). Each is a context manager
        (``with env.fork() as branch:``) and goes on independently of this one; closing
        this session leaves them open.

        Raises:
            ValueError: ``n`` is below 1.
            EnvError, SessionLost, SessionTimeout: as :meth:`snapshot` and
                :meth:`restore`; CapacityError, SessionRefused: as :meth:`open`. No fork
                stays open when one fails.
        """
        children = self._forks(n)
        try:
            data = self.snapshot(timeout=timeout)
            for child in children:
                child.open()
                child.restore(data, timeout=timeout)
        except BaseException:
            for child in children:
                child.abort()
            raise
        return children if n is not None else children[0]

    # -- recovery's I/O (see recovery.RecoveryIO): blocking, so each await ends at once --

    async def _io_roundtrip(self, request: pb.SessionRequest, timeout: float | None) -> Any:
        return self._roundtrip(request, timeout)

    async def _io_reopen(self, target: str | None) -> None:
        call = self._core.drop_call()  # one a timed-out replay left open
        if call is not None:
            call.cancel()
        self._end_stream()
        self._let_go(self._retarget(target))
        self.open()

    async def _io_pause(self, seconds: float) -> None:
        time.sleep(seconds)  # noqa: ASYNC251 -- run by run_blocking, never on a loop


Session._generic_origin = Session
