"""``AsyncSession``: one environment instance over one stream, for asyncio trainers."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import grpc
from google.protobuf.message import Message

from openenv_grpc.client.channel import aio_channel, auth_metadata
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

__all__ = ["AsyncSession"]

ActionT = TypeVar("ActionT", bound=Message)
ObservationT = TypeVar("ObservationT", bound=Message)
StateT = TypeVar("StateT", bound=Message)
ResetOptionsT = TypeVar("ResetOptionsT", bound=Message)

_Call = grpc.aio.StreamStreamCall[pb.SessionRequest, pb.SessionResponse]


class AsyncSession(Generic[ActionT, ObservationT, StateT, ResetOptionsT]):
    """An asyncio session: ``async with AsyncSession(target) as env: await env.reset()``.

    ``target`` is a ``"host:port"`` string (the session owns a channel to it), a
    ``grpc.aio.Channel`` or an ``EnvServiceStub`` over one; many sessions may share a
    channel. Subclass it with concrete types (``AsyncSession[A, O, S, R]``) for a typed
    client that checks what it sends and decodes what it gets; the untyped session
    decodes any message type imported in this process.

    ``credentials`` (see :func:`openenv_grpc.client.channel.tls_credentials`) make the
    owned channel TLS; ``token`` is sent as ``authorization: Bearer <token>``; ``retry``
    retries the open while the server is full. With ``reconnect``, a call made after the
    stream was lost (SessionLost) first opens a fresh session; the call that saw the loss
    still raises, because its episode is gone: reset to go on. Calls on one session must
    not overlap: await each before the next.
    """

    _types: ClassVar[SessionTypes] = SessionTypes()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._types = SessionTypes.from_generic(cls, (AsyncSession,))

    def __init__(
        self,
        target: str | grpc.aio.Channel | pb_grpc.EnvServiceAsyncStub,
        *,
        metadata: Sequence[tuple[str, str]] = (),
        retry: OpenRetry | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        reconnect: bool = False,
    ) -> None:
        self._owned_channel: grpc.aio.Channel | None = None
        if isinstance(target, str):
            self._owned_channel = aio_channel(target, credentials)
            target = self._owned_channel
        if isinstance(target, grpc.aio.Channel):
            target = pb_grpc.EnvServiceStub(target)
        self._stub: pb_grpc.EnvServiceAsyncStub = target
        self._metadata = (*auth_metadata(token), *metadata)
        self._retry = retry
        self._reconnect = reconnect
        #: The stream was lost (not closed by us): with ``reconnect``, the next call reopens.
        self._lost = False
        self._protocol = SessionProtocol(self._types)
        self._call: _Call | None = None
        #: The server's id for this session (it tags the server's log lines), once open.
        self.session_id = ""
        #: A read left running by a timed-out request; its answer is stale when it comes.
        self._pending: asyncio.Future[Any] | None = None
        #: A provider this session started and stops when it ends (see :meth:`launch`).
        self._owned_provider: Provider | None = None

    # -- lifecycle --------------------------------------------------------------------

    @classmethod
    def from_provider(cls, provider: Provider, **kwargs: Any) -> Self:
        """An unopened session on ``provider``'s servers (``with EchoEnv.from_provider(p)``);
        ``kwargs`` go to the constructor."""
        return provider.session(cls, **kwargs)

    @classmethod
    async def launch(cls, provider: Provider, **kwargs: Any) -> Self:
        """Start ``provider`` (in a thread: starting blocks) and return an unopened session
        on it that owns it: closing or aborting the session, or a failed :meth:`open`,
        stops the provider's servers.

        Raises:
            ProviderError: the servers did not start (nothing is left running).
        """
        await asyncio.to_thread(provider.start)
        try:
            session = provider.session(cls, **kwargs)
        except BaseException:
            await asyncio.to_thread(provider.stop)
            raise
        session._owned_provider = provider
        return session

    @classmethod
    async def from_docker_image(cls, image: str, **provider_kwargs: Any) -> Self:
        """A session on a container of ``image`` of its own (see
        :meth:`Session.from_docker_image`): ``env = await
        AsyncEchoEnv.from_docker_image("openenv-grpc-echo:0.1.0")``, then ``async with env``.

        Raises:
            ProviderError: no Docker daemon, or the container did not become healthy.
        """
        from openenv_grpc.providers.docker_provider import LocalDockerProvider

        return await cls.launch(LocalDockerProvider(image, **provider_kwargs))

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            await self.close()
        else:
            await self.abort()

    async def open(self) -> None:
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
                self._call = await self._open_once()
                return
            except CapacityError as exc:
                bound = next(delays, None)
                if bound is None:
                    await self._give_up_open()
                    raise
                await asyncio.sleep(OpenRetry.wait(bound, exc.retry_after))
            except BaseException:
                await self._give_up_open()
                raise

    async def _open_once(self) -> _Call:
        call = self._stub.Session(metadata=self._metadata)
        session_id = admitted_session_id(await call.initial_metadata())
        if session_id is not None:
            self.session_id = session_id
            return call
        code = await call.code()
        raise refusal(code, await call.details(), await call.trailing_metadata())

    async def close(self) -> None:
        """Close the environment and the stream. Safe to call twice.

        Raises:
            EnvError: the environment's ``close`` raised (it is gone all the same).
        """
        self._reconnect = self._lost = False  # closing means closed: never reopen
        if self._call is None:
            await self._close_channel()
            await self._stop_owned_provider()
            return
        try:
            response = await self._roundtrip(self._protocol.close_request(), None)
            self._protocol.close_result(response)
            await self._call.code()  # the server ends the stream right after its answer
        except SessionLost:
            pass  # already ended by the server: nothing left to close
        finally:
            self._call = None
            await self._close_channel()
            await self._stop_owned_provider()

    async def abort(self) -> None:
        """Cancel the stream at once; the server closes the environment on its side."""
        self._reconnect = self._lost = False
        if self._call is not None:
            self._call.cancel()
            self._call = None
        await self._close_channel()
        await self._stop_owned_provider()

    async def _stop_owned_provider(self) -> None:
        provider, self._owned_provider = self._owned_provider, None
        if provider is not None:
            await asyncio.to_thread(provider.stop)  # stopping blocks (a drain, a container)

    async def _give_up_open(self) -> None:
        """After a failed open: release the channel and an owned provider, unless a later
        call will reconnect."""
        if not self._reconnect:
            await self._close_channel()
            await self._stop_owned_provider()

    async def _forget_channel_unless_reconnecting(self) -> None:
        if not self._reconnect:
            await self._close_channel()

    async def _close_channel(self) -> None:
        if self._owned_channel is not None:
            await self._owned_channel.close()
            self._owned_channel = None

    # -- commands ---------------------------------------------------------------------

    @property
    def episode_id(self) -> str:
        """The current episode's id ("" before the first reset)."""
        return self._protocol.episode_id

    async def reset(
        self,
        *,
        seed: int | None = None,
        episode_id: str | None = None,
        options: ResetOptionsT | None = None,
        timeout: float | None = None,
    ) -> StepResult[ObservationT]:
        """Start a new episode; returns its first observation.

        Raises:
            EnvError: the options were refused or the environment raised.
            SessionLost: the stream ended. TimeoutError: no answer within ``timeout``.
        """
        request = self._protocol.reset_request(seed, episode_id, options)
        return self._protocol.step_result(await self._roundtrip(request, timeout))

    async def step(
        self, action: ActionT, *, timeout: float | None = None
    ) -> StepResult[ObservationT]:
        """Apply ``action``; returns the resulting observation, reward and flags.

        Raises:
            EnvError: INVALID_ARGUMENT (bad action), FAILED_PRECONDITION (no episode
                running) or INTERNAL (the environment raised).
            SessionLost: the stream ended. TimeoutError: no answer within ``timeout``.
        """
        request = self._protocol.step_request(action)
        return self._protocol.step_result(await self._roundtrip(request, timeout))

    async def state(self, *, timeout: float | None = None) -> StateT:
        """The environment's current state.

        Raises:
            EnvError: the environment raised. SessionLost: the stream ended.
        """
        request = self._protocol.state_request()
        return self._protocol.state_result(  # type: ignore[no-any-return]
            await self._roundtrip(request, timeout)
        )

    # -- transport --------------------------------------------------------------------

    async def _roundtrip(self, request: pb.SessionRequest, timeout: float | None) -> Any:
        if self._call is None and self._lost and self._reconnect:
            # A fresh session: the lost episode is gone, so only a reset makes sense now.
            await self.open()
            self._lost = False
        call = self._call
        if call is None:
            raise RuntimeError("session is not open: use `async with` or await open()")
        try:
            await call.write(request)
        except grpc.aio.AioRpcError as exc:
            error = _write_failure(exc)
        except asyncio.InvalidStateError:  # written after the stream finished cleanly
            error = lost(await call.code(), await call.details())
        else:
            try:
                while True:
                    response = await self._read(call, timeout)
                    if response is grpc.aio.EOF:
                        break
                    if not self._protocol.is_stale(response, request):
                        return response
                error = lost(await call.code(), await call.details())
            except grpc.aio.AioRpcError as exc:
                error = lost(exc.code(), exc.details())
        # The stream is over: forget it (and the channel we own, unless reconnecting).
        self._call = None
        self._lost = True
        await self._forget_channel_unless_reconnecting()
        raise error

    async def _read(self, call: _Call, timeout: float | None) -> Any:
        if timeout is None and self._pending is None:
            return await call.read()  # the fast path: no extra task
        if self._pending is None:
            self._pending = asyncio.ensure_future(call.read())
        try:
            response = await asyncio.wait_for(asyncio.shield(self._pending), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no answer within {timeout}s; the session stays open") from None
        except BaseException:
            if self._pending.done():
                self._pending = None
            raise
        self._pending = None
        return response


def _write_failure(exc: grpc.aio.AioRpcError) -> SessionLost:
    """A failed write means the server had already ended the stream. grpc.aio then
    replaces the server's status with its own INTERNAL ("Internal error from Core"), so
    the server's reason (e.g. draining) is lost; report what is known."""
    if exc.code() is grpc.StatusCode.INTERNAL:
        return lost(
            grpc.StatusCode.UNAVAILABLE,
            "the server ended the session before the request was sent (it may be draining "
            f"or have closed the session; gRPC: {exc.details()})",
        )
    return lost(exc.code(), exc.details())
