"""A Session stream served in this process, for counting what a step costs in Python
(``bench.step_calls``): the session core and the typed client, without a network hop.

:class:`LocalStub` stands where a gRPC ``EnvServiceStub`` would: its ``Session()`` call
runs the servicer's own ``Session`` handler (``SessionManager.run``: the limiter, the
idle reaper, the drain, the byte budget, the metrics) in a task on this loop, with a
:class:`LocalCall` as the client's end and a :class:`_ServerEnd` (a
``server.stream.wire.Wire``) as the server's. The typed ``AsyncSession`` client works on
it unchanged. Requests and answers cross as the same bytes a gRPC stream would carry.

The caller authenticates before it opens a stream: nothing here checks a token.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn

import grpc

from openenv_grpc.v1 import session_pb2 as pb

__all__ = ["LocalCall", "LocalStub"]

log = logging.getLogger(__name__)

_Metadata = tuple[tuple[str, str], ...]
#: What runs a stream on the server's side: ``EnvServicer.Session``'s shape.
_Handler = Callable[[None, "_ServerEnd"], Awaitable[None]]
_OnEnd = Callable[[grpc.StatusCode, str], None]


class LocalStub:
    """An ``EnvServiceStub`` whose ``Session`` streams run in this process.

    Args:
        session: The servicer's ``Session`` handler (``EnvServicer.Session``).
        on_end: Called with the status of each stream as it ends, whoever ended it (the
            idle reaper, a drain): a wire closes its connection with it.
    """

    def __init__(self, session: _Handler, on_end: _OnEnd | None = None) -> None:
        self._session = session
        self._on_end = on_end

    def ending_with(self, on_end: _OnEnd) -> LocalStub:
        """The same stub, telling ``on_end`` how each of its streams ended."""
        return LocalStub(self._session, on_end)

    def Session(self, *_requests: Any, metadata: Sequence[tuple[str, str]] = ()) -> LocalCall:
        """Open a stream: the server's handler starts at once, as a gRPC call's does."""
        return LocalCall(self._session, tuple(metadata), self._on_end)


class LocalCall:
    """The client's end of a local stream, with the methods of a grpc.aio
    ``StreamStreamCall`` that the session clients use."""

    def __init__(
        self, handler: _Handler, metadata: _Metadata, on_end: _OnEnd | None = None
    ) -> None:
        loop = asyncio.get_running_loop()
        self._metadata = metadata
        self._on_end = on_end
        #: Requests on their way to the server (bytes; EOF once the client is done).
        self._requests = _Mailbox()
        #: Answers written and not yet read, each with the future its write awaits
        #: (:data:`_TAKEN`: handed to a reader that was waiting); :data:`_END` last.
        self._answers = _Mailbox()
        self._headers: asyncio.Future[_Metadata] = loop.create_future()
        self._status: tuple[grpc.StatusCode, str, _Metadata] | None = None
        self._ended = asyncio.Event()
        self._callbacks: list[Callable[[Any], None]] = []
        self._cancelled = False
        self._writes_done = False
        self._task = asyncio.create_task(self._serve(handler))

    # -- the server's side ---------------------------------------------------------------

    async def _serve(self, handler: _Handler) -> None:
        server = _ServerEnd(self)
        status: tuple[grpc.StatusCode, str, _Metadata] = (grpc.StatusCode.OK, "", ())
        try:
            await handler(None, server)
        except grpc.aio.AbortError:
            status = server.status or (grpc.StatusCode.UNKNOWN, "aborted", ())
        except asyncio.CancelledError:
            status = (grpc.StatusCode.CANCELLED, "Locally cancelled by the client", ())
        except Exception as exc:  # a bug in a handler: the client gets it as gRPC would
            log.exception("a local session's handler raised")
            status = (grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc).__name__}: {exc}", ())
        finally:
            self._finish(status)

    def _finish(self, status: tuple[grpc.StatusCode, str, _Metadata]) -> None:
        self._status = status
        if not self._headers.done():
            self._headers.set_result(())
        for item in self._answers.items:
            if item is not _END and not item[1].done():
                item[1].cancel()
        self._answers.put(_END)
        self._ended.set()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)
        if self._on_end is not None:
            self._on_end(status[0], status[1])

    # -- the client's side ---------------------------------------------------------------

    async def initial_metadata(self) -> _Metadata:
        """The headers the server sent once it admitted the stream (empty if it ended)."""
        return await self._headers

    async def write(self, request: Any) -> None:
        """Send one request.

        Raises:
            grpc.aio.AioRpcError: the stream has ended (with the server's status).
        """
        if self._status is not None or self._cancelled:
            code, details, trailers = self._status or (grpc.StatusCode.CANCELLED, "", ())
            raise grpc.aio.AioRpcError(
                code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details
            )
        self._requests.put(request.SerializeToString())

    async def done_writing(self) -> None:
        """The client sends nothing more: the server reads EOF."""
        if not self._writes_done:
            self._writes_done = True
            self._requests.put(grpc.aio.EOF)

    async def read(self) -> Any:
        """The next answer, or ``grpc.aio.EOF`` once the stream has ended (its status
        is then :meth:`code` and :meth:`details`)."""
        item = await self._answers.get()
        if item is _END:
            self._answers.put(_END)  # and for every later read
            return grpc.aio.EOF
        raw, written = item
        if not written.done():
            written.set_result(None)  # the server's write is done: its bytes go back
        return pb.SessionResponse.FromString(raw)

    def cancel(self) -> bool:
        """End the stream from the client's side (the server sees a cancelled stream)."""
        if self._status is not None:
            return False
        self._cancelled = True
        self._task.cancel()
        return True

    def done(self) -> bool:
        return self._status is not None

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        if self._status is not None:
            asyncio.get_running_loop().call_soon(callback, self)
        else:
            self._callbacks.append(callback)

    async def code(self) -> grpc.StatusCode:
        if self._status is None:
            await self._ended.wait()
        assert self._status is not None
        return self._status[0]

    async def details(self) -> str:
        if self._status is None:
            await self._ended.wait()
        assert self._status is not None
        return self._status[1]

    async def trailing_metadata(self) -> _Metadata:
        if self._status is None:
            await self._ended.wait()
        assert self._status is not None
        return self._status[2]


class _Mailbox:
    """What one task hands another, in order: items, and the future of the one task
    waiting for the next (cheaper than an ``asyncio.Queue`` for one reader)."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: collections.deque[Any] = collections.deque()
        self.waiter: asyncio.Future[Any] | None = None

    def handed(self, item: Any) -> bool:
        """Give ``item`` to the task waiting for one, if any; False if none waits."""
        waiter = self.waiter
        if waiter is None or waiter.done() or self.items:
            return False
        self.waiter = None
        waiter.set_result(item)
        return True

    def put(self, item: Any) -> None:
        if not self.handed(item):
            self.items.append(item)

    async def get(self) -> Any:
        if self.items:
            return self.items.popleft()
        self.waiter = waiter = asyncio.get_running_loop().create_future()
        try:
            return await waiter
        finally:
            if self.waiter is waiter:
                self.waiter = None


#: The last item of a finished stream's answers.
_END: Any = object()


class _Taken:
    """The mark of an answer handed to a client that was waiting for it."""

    @staticmethod
    def done() -> bool:
        return True


_TAKEN: Any = _Taken()


class _ServerEnd:
    """The server's end of a local stream: a :class:`~.wire.Wire`."""

    __slots__ = ("_call", "admitted", "status")

    def __init__(self, call: LocalCall) -> None:
        self._call = call
        self.admitted = False
        self.status: tuple[grpc.StatusCode, str, _Metadata] | None = None

    async def read(self) -> Any:
        if not self.admitted:
            # Only a refusal reads before admission; a local client writes nothing until
            # it is admitted, so there is nothing to wait for.
            return grpc.aio.EOF
        return await self._call._requests.get()

    async def write(self, message: bytes) -> None:
        answers = self._call._answers
        if answers.handed((message, _TAKEN)):
            return  # the client was waiting for it: taken as it was written
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        answers.put((message, written))
        await written  # until the client has taken it

    async def send_initial_metadata(self, initial_metadata: Sequence[tuple[str, str]]) -> None:
        self.admitted = True
        headers = self._call._headers
        if not headers.done():
            headers.set_result(tuple(initial_metadata))

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: Sequence[tuple[str, str]] = (),
    ) -> NoReturn:
        self.status = (code, details, tuple(trailing_metadata))
        raise grpc.aio.AbortError()

    def cancelled(self) -> bool:
        return self._call._cancelled

    def invocation_metadata(self) -> Sequence[tuple[str, Any]]:
        return self._call._metadata
