"""``Session``: one environment instance over one stream, for blocking code.

``with Session(stub) as env: env.reset(); env.step(action)``. Built on gRPC's blocking
API: requests go through a queue that gRPC's sender thread drains, answers are read in
the caller's thread. For many sessions in one process, prefer :class:`AsyncSession`.
"""

from __future__ import annotations

import concurrent.futures
import queue
import time
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import grpc
from google.protobuf.message import Message

from openenv_grpc.client.channel import auth_metadata, sync_channel
from openenv_grpc.client.errors import CapacityError, SessionLost
from openenv_grpc.client.protocol import (
    SessionProtocol,
    SessionTypes,
    StepResult,
    admitted_session_id,
    lost,
    refusal,
)
from openenv_grpc.client.retry import OpenRetry
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # typing.Self is 3.11+; only the type checker needs it
    from typing_extensions import Self

    from openenv_grpc.providers.base import Provider

__all__ = ["Session"]

ActionT = TypeVar("ActionT", bound=Message)
ObservationT = TypeVar("ObservationT", bound=Message)
StateT = TypeVar("StateT", bound=Message)
ResetOptionsT = TypeVar("ResetOptionsT", bound=Message)


#: What a read returns once the stream is over.
_END: Any = object()


class _RequestQueue(Iterator[pb.SessionRequest]):
    """The request side of the stream; ``end()`` half-closes it (and frees gRPC's thread)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()

    def __next__(self) -> pb.SessionRequest:
        item = self._queue.get()
        if item is None:
            self._queue.put(None)  # stay ended for any later next()
            raise StopIteration
        return item

    def put(self, request: pb.SessionRequest) -> None:
        self._queue.put(request)

    def end(self) -> None:
        self._queue.put(None)


class Session(Generic[ActionT, ObservationT, StateT, ResetOptionsT]):
    """A blocking session; see :class:`AsyncSession` for what ``target`` may be.

    ``target`` is a ``"host:port"`` string (the session owns a channel), a
    ``grpc.Channel``, or an ``EnvServiceStub`` over one. ``retry``, ``credentials``,
    ``token`` and ``reconnect`` work as in :class:`AsyncSession`, and so does each call's
    ``timeout``: a TimeoutError leaves the session open and the late answer is dropped
    when it comes. Calls without a timeout read in the caller's thread; a timed call reads
    in a helper thread of the session, so that the caller can stop waiting.
    """

    _types: ClassVar[SessionTypes] = SessionTypes()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._types = SessionTypes.from_generic(cls, (Session,))

    def __init__(
        self,
        target: str | grpc.Channel | pb_grpc.EnvServiceStub,
        *,
        metadata: Sequence[tuple[str, str]] = (),
        retry: OpenRetry | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        reconnect: bool = False,
    ) -> None:
        self._owned_channel: grpc.Channel | None = None
        if isinstance(target, str):
            self._owned_channel = sync_channel(target, credentials)
            target = self._owned_channel
        if isinstance(target, grpc.Channel):
            target = pb_grpc.EnvServiceStub(target)
        self._stub = target
        self._metadata = (*auth_metadata(token), *metadata)
        self._retry = retry
        self._reconnect = reconnect
        #: The stream was lost (not closed by us): with ``reconnect``, the next call reopens.
        self._lost = False
        self._protocol = SessionProtocol(self._types)
        self._call: Any = None  # grpc's rendezvous: both the Call and the response iterator
        self._requests: _RequestQueue | None = None
        #: The server's id for this session (it tags the server's log lines), once open.
        self.session_id = ""
        #: Reads for timed calls (started on the first one), and a read a timed-out call
        #: left running; its answer is stale when it comes.
        self._reader: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future[Any] | None = None
        #: A provider this session started and stops when it ends (see :meth:`launch`).
        self._owned_provider: Provider | None = None

    @classmethod
    def from_provider(cls, provider: Provider, **kwargs: Any) -> Self:
        """An unopened session on ``provider``'s servers (``with EchoEnv.from_provider(p)``);
        ``kwargs`` go to the constructor."""
        return provider.session(cls, **kwargs)

    @classmethod
    def launch(cls, provider: Provider, **kwargs: Any) -> Self:
        """Start ``provider`` and return an unopened session on it that owns it: closing or
        aborting the session, or a failed :meth:`open`, stops the provider's servers.

        Raises:
            ProviderError: the servers did not start (nothing is left running).
        """
        provider.start()
        try:
            session = provider.session(cls, **kwargs)
        except BaseException:
            provider.stop()
            raise
        session._owned_provider = provider
        return session

    @classmethod
    def from_docker_image(cls, image: str, **provider_kwargs: Any) -> Self:
        """A session on a container of ``image`` of its own, started now (host network,
        loopback port, until health SERVING); the container goes when the session ends.

        ``with EchoEnv.from_docker_image("openenv-grpc-echo:0.1.0") as env: env.reset()``.
        ``provider_kwargs`` go to :class:`~openenv_grpc.providers.LocalDockerProvider`
        (``max_concurrent_envs``, ``cpus``, ``mem_limit``, ...); needs the docker extra.

        Raises:
            ProviderError: no Docker daemon, or the container did not become healthy.
        """
        from openenv_grpc.providers.docker_provider import LocalDockerProvider

        return cls.launch(LocalDockerProvider(image, **provider_kwargs))

    def __enter__(self) -> Self:
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
        """
        if self._call is not None:
            raise RuntimeError("session is already open")
        delays = iter(self._retry.delays()) if self._retry else iter(())
        while True:
            try:
                self._open_once()
                return
            except CapacityError as exc:
                bound = next(delays, None)
                if bound is None:
                    self._give_up_open()
                    raise
                time.sleep(OpenRetry.wait(bound, exc.retry_after))
            except BaseException:
                self._give_up_open()
                raise

    def _open_once(self) -> None:
        requests = _RequestQueue()
        call = self._stub.Session(requests, metadata=self._metadata)
        session_id = admitted_session_id(call.initial_metadata())
        if session_id is not None:
            self._call, self._requests, self.session_id = call, requests, session_id
            return
        requests.end()
        raise refusal(call.code(), call.details() or "", call.trailing_metadata())

    def close(self) -> None:
        """Close the environment and the stream. Safe to call twice.

        Raises:
            EnvError: the environment's ``close`` raised (it is gone all the same).
        """
        self._reconnect = self._lost = False  # closing means closed: never reopen
        try:
            if self._call is not None:
                self._protocol.close_result(self._roundtrip(self._protocol.close_request()))
                if self._call is not None:
                    self._call.code()  # the server ends the stream right after its answer
        except SessionLost:
            pass  # already ended by the server: nothing left to close
        finally:
            self._end_stream()
            self._close_channel()
            self._stop_owned_provider()

    def abort(self) -> None:
        """Cancel the stream at once; the server closes the environment on its side."""
        self._reconnect = self._lost = False
        if self._call is not None:
            self._call.cancel()
        self._end_stream()
        self._close_channel()
        self._stop_owned_provider()

    def _stop_owned_provider(self) -> None:
        provider, self._owned_provider = self._owned_provider, None
        if provider is not None:
            provider.stop()

    def _end_stream(self) -> None:
        """Forget the stream and release gRPC's sender thread (it waits on the queue)."""
        if self._requests is not None:
            self._requests.end()
        self._call = self._requests = None
        self._pending = None
        if self._reader is not None:
            # Its read ends with the stream (cancelled or finished); do not wait for it.
            self._reader.shutdown(wait=False)
            self._reader = None

    def _give_up_open(self) -> None:
        """After a failed open: release the channel and an owned provider, unless a later
        call will reconnect."""
        if not self._reconnect:
            self._close_channel()
            self._stop_owned_provider()

    def _forget_channel_unless_reconnecting(self) -> None:
        if not self._reconnect:
            self._close_channel()

    def _close_channel(self) -> None:
        if self._owned_channel is not None:
            self._owned_channel.close()
            self._owned_channel = None

    @property
    def episode_id(self) -> str:
        """The current episode's id ("" before the first reset)."""
        return self._protocol.episode_id

    def reset(
        self,
        *,
        seed: int | None = None,
        episode_id: str | None = None,
        options: ResetOptionsT | None = None,
        timeout: float | None = None,
    ) -> StepResult[ObservationT]:
        """Start a new episode; see :meth:`AsyncSession.reset`."""
        request = self._protocol.reset_request(seed, episode_id, options)
        return self._protocol.step_result(self._roundtrip(request, timeout))

    def step(self, action: ActionT, *, timeout: float | None = None) -> StepResult[ObservationT]:
        """Apply ``action``; see :meth:`AsyncSession.step`."""
        request = self._protocol.step_request(action)
        return self._protocol.step_result(self._roundtrip(request, timeout))

    def state(self, *, timeout: float | None = None) -> StateT:
        """The environment's current state; see :meth:`AsyncSession.state`."""
        return self._protocol.state_result(  # type: ignore[no-any-return]
            self._roundtrip(self._protocol.state_request(), timeout)
        )

    def _read(self, call: Any, timeout: float | None) -> Any:
        """The stream's next answer (``_END`` once it is over).

        Raises:
            TimeoutError: none within ``timeout``; the read goes on for the next call.
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
            raise TimeoutError(f"no answer within {timeout}s; the session stays open") from None
        finally:
            if self._pending is not None and self._pending.done():
                self._pending = None
        return response

    def _roundtrip(
        self, request: pb.SessionRequest, timeout: float | None = None
    ) -> pb.SessionResponse:
        if self._call is None and self._lost and self._reconnect:
            # A fresh session: the lost episode is gone, so only a reset makes sense now.
            self.open()
            self._lost = False
        call, requests = self._call, self._requests
        if call is None or requests is None:
            raise RuntimeError("session is not open: use `with` or call open()")
        requests.put(request)
        try:
            while (response := self._read(call, timeout)) is not _END:
                if not self._protocol.is_stale(response, request):
                    return response  # type: ignore[no-any-return]
            error = lost(call.code(), call.details())
        except grpc.RpcError as exc:
            error = lost(exc.code(), exc.details())
        # The stream is over: forget it (and the channel we own, unless reconnecting).
        self._end_stream()
        self._lost = True
        self._forget_channel_unless_reconnecting()
        raise error
