"""``AsyncSession``: one environment instance over one stream, for asyncio trainers.

``async with AsyncSession(target) as env: await env.reset()``. What a session is and
decides lives in :mod:`openenv_grpc.client.session_core`; this shell only moves bytes,
with grpc.aio.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, overload

import grpc

from openenv_grpc.client import session_core
from openenv_grpc.client.aio_status import EndStatus, write_request
from openenv_grpc.client.channel import aio_channel
from openenv_grpc.client.errors import SessionLost, SessionRefused, SessionTimeout
from openenv_grpc.client.outcome import Restored, StepOutcome
from openenv_grpc.client.protocol import SessionProtocol, lost
from openenv_grpc.client.queries import AsyncSessionQueries
from openenv_grpc.client.session_core import ActionT, ObservationT, ResetOptionsT, StateT
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # only the type checker needs these
    from typing_extensions import Self, Unpack

    from openenv_grpc.client.session_core import SessionOptions

__all__ = ["AsyncSession", "AsyncStream"]


_Call = grpc.aio.StreamStreamCall[Any, Any]


class AsyncStream(session_core.StreamBase):
    """The asyncio transport of a stream (one env's or a vector's): the twin of
    :class:`~openenv_grpc.client.sync_session.SyncStream`, with grpc.aio. The kind of
    stream's commands are the subclass's (:class:`AsyncSession`, ``AsyncVectorSession``).
    """

    _channel_class = grpc.aio.Channel
    _make_channel = aio_channel

    def __init__(self, target: Any, **options: Unpack[SessionOptions]) -> None:
        super().__init__(target, **options)
        #: A read left running by a timed-out request; its answer is stale when it comes.
        self._pending: asyncio.Future[Any] | None = None
        #: How the open stream ended, as the server said (see :mod:`.aio_status`).
        self._ended: EndStatus | None = None

    # -- lifecycle --------------------------------------------------------------------

    @classmethod
    async def launch(cls, provider: session_core.SessionSource, **kwargs: Any) -> Self:
        """Start ``provider`` (in a thread: starting blocks) and return an unopened session
        on it that owns it (see :meth:`Session.launch`).

        Raises:
            ProviderError: the servers did not start (nothing is left running).
        """
        await asyncio.to_thread(provider.start)
        return session_core.launched(cls, provider, kwargs)

    async def __aenter__(self) -> Self:
        if self._core.call is None:  # a fork arrives open
            await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await (self.close() if exc_type is None else self.abort())

    async def open(self) -> None:
        """Open the stream; the server creates the environment (see :meth:`Session.open`)."""
        schedule = self._core.begin_open()
        try:
            while True:
                refused = await self._open_once()
                if refused is None:
                    return
                await asyncio.sleep(schedule.wait_after(refused))
        except BaseException:
            await self._let_go(self._core.failed_open())
            raise

    async def _open_once(self) -> SessionRefused | None:
        """One attempt: None once admitted, else the refusal (see :meth:`Session._open_once`)."""
        core = self._core
        call: _Call = core.open_stream()
        self._ended = EndStatus(call)
        if core.admit(call, await call.initial_metadata()):
            return None
        return core.refused(await call.code(), await call.details(), await call.trailing_metadata())

    async def close(self) -> None:
        """Close the environment and the stream; see :meth:`Session.close`."""
        core = self._core
        core.ending()
        try:
            if core.call is not None:
                response = await self._roundtrip(core.protocol.close_request(), None)
                core.protocol.close_result(response)
                await core.call.code()  # the server ends the stream right after its answer
        except SessionLost:
            pass  # already ended by the server: nothing left to close
        finally:
            self._pending = None
            await self._let_go(core.ended())

    async def abort(self) -> None:
        """Cancel the stream at once; see :meth:`Session.abort`."""
        core = self._core
        core.ending()
        if core.call is not None:
            core.call.cancel()
        self._pending = None
        await self._let_go(core.ended())

    @staticmethod
    async def _let_go(owned: session_core.Owned) -> None:
        if owned.channel is not None:
            await owned.channel.close()
        if owned.provider is not None:
            await asyncio.to_thread(owned.provider.stop)  # stopping blocks (a drain, a container)

    # -- transport --------------------------------------------------------------------

    async def _roundtrip(self, request: Any, timeout: float | None) -> Any:
        if self._core.must_reopen():
            await self.open()
        call: _Call = self._core.open_call()
        error = await write_request(call, request, self._ended)
        if error is None:
            try:
                while (response := await self._read(call, timeout)) is not grpc.aio.EOF:
                    if not self._core.protocol.is_stale(response, request):
                        return response
                error = lost(await call.code(), await call.details())
            except grpc.aio.AioRpcError as exc:
                error = lost(exc.code(), exc.details())
        self._pending = None
        await self._let_go(self._core.stream_lost())
        raise error

    async def _read(self, call: _Call, timeout: float | None) -> Any:
        if timeout is None and self._pending is None:
            return await call.read()  # the fast path: no extra task
        if self._pending is None:
            self._pending = asyncio.ensure_future(call.read())
        try:
            response = await asyncio.wait_for(asyncio.shield(self._pending), timeout)
        except asyncio.TimeoutError:
            raise SessionTimeout(timeout or 0.0) from None
        except BaseException:
            if self._pending.done():
                self._pending = None
            raise
        self._pending = None
        return response


class AsyncSession(
    AsyncStream,
    session_core.SessionBase,
    AsyncSessionQueries[StateT],
    Generic[ActionT, ObservationT, StateT, ResetOptionsT],
):
    """An asyncio session: ``async with AsyncEchoEnv("127.0.0.1:50051") as env: ...``.

    ``target`` is a ``"host:port"`` string (the session owns a channel to it), a
    ``grpc.aio.Channel`` or an ``EnvServiceStub`` over one; many sessions may share a
    channel. The options, typing and ``timeout`` work as in
    :class:`~openenv_grpc.client.sync_session.Session`. Calls on one session must not
    overlap: await each before the next.
    """

    def __init__(
        self,
        target: str | grpc.aio.Channel | pb_grpc.EnvServiceAsyncStub,
        **options: Unpack[SessionOptions],
    ) -> None:
        super().__init__(target, **options)

    # -- commands: see Session for what each returns and raises -----------------------

    async def reset(
        self, *, seed: int | None = None, episode_id: str | None = None,
        options: ResetOptionsT | None = None, timeout: float | None = None,
    ) -> StepOutcome[ObservationT]:  # fmt: skip
        """Start a new episode; see :meth:`Session.reset`."""
        if self._recovering is not None:
            return await self._recovering.reset(seed, episode_id, options, timeout)
        protocol = self._core.protocol
        response = await self._roundtrip(protocol.reset_request(seed, episode_id, options), timeout)
        return protocol.step_result(response)

    async def step(
        self, action: ActionT, *, timeout: float | None = None
    ) -> StepOutcome[ObservationT]:
        """Apply ``action``; see :meth:`Session.step`."""
        if self._recovering is not None:
            return await self._recovering.step(action, timeout)
        protocol = self._core.protocol
        return protocol.step_result(await self._roundtrip(protocol.step_request(action), timeout))

    async def _ask(self, command: str, result: str, timeout: float | None) -> Any:
        if self._recovering is not None:
            return await self._recovering.ask(command, result, timeout)
        protocol = self._core.protocol
        response = await self._roundtrip(protocol.query_request(command), timeout)
        return protocol.query_result(response, result)

    def _session_protocol(self) -> SessionProtocol:
        return self._core.protocol

    async def snapshot(self, *, timeout: float | None = None) -> bytes:
        """The current episode as bytes; see :meth:`Session.snapshot`."""
        if self._recovering is not None:
            return await self._recovering.snapshot(timeout)
        protocol = self._core.protocol
        response = await self._roundtrip(protocol.query_request("snapshot"), timeout)
        return protocol.snapshot_result(response)

    async def restore(self, data: bytes, *, timeout: float | None = None) -> Restored:
        """Continue from a snapshot; see :meth:`Session.restore`."""
        if self._recovering is not None:
            return await self._recovering.restore(data, timeout)
        protocol = self._core.protocol
        response = await self._roundtrip(protocol.restore_request(data), timeout)
        return protocol.restore_result(response)

    @overload
    async def fork(self, n: None = None, *, timeout: float | None = None) -> Self: ...
    @overload
    async def fork(self, n: int, *, timeout: float | None = None) -> list[Self]: ...
    async def fork(
        self, n: int | None = None, *, timeout: float | None = None
    ) -> Self | list[Self]:
        """Branch the episode into one open session (``n``: a list of ``n``, opened and
        restored concurrently); see :meth:`Session.fork`. ``async with await
        env.fork() as branch:``."""
        children = self._forks(n)
        try:
            data = await self.snapshot(timeout=timeout)
            done = await asyncio.gather(
                *(child._open_from(data, timeout) for child in children), return_exceptions=True
            )
            failure = next((d for d in done if isinstance(d, BaseException)), None)
            if failure is not None:
                raise failure
        except BaseException:
            await asyncio.gather(*(child.abort() for child in children))
            raise
        return children if n is not None else children[0]

    async def _open_from(self, data: bytes, timeout: float | None) -> None:
        await self.open()
        await self.restore(data, timeout=timeout)

    # -- recovery's I/O (see recovery.RecoveryIO) ------------------------------------

    async def _io_roundtrip(self, request: pb.SessionRequest, timeout: float | None) -> Any:
        return await self._roundtrip(request, timeout)

    async def _io_reopen(self, target: str | None) -> None:
        call = self._core.drop_call()  # one a timed-out replay left open
        if call is not None:
            call.cancel()
        self._pending = None
        await self._let_go(self._retarget(target))
        await self.open()

    async def _io_pause(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


AsyncSession._generic_origin = AsyncSession
