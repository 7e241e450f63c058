"""The door's sessions as Session streams of the core, run by the core's own handler
(``EnvServicer.Session``: ``SessionManager.run``) with a wire of this module: admission
by the limiter, the stream loop, the idle reaper, the drain, the byte budget and the
metrics are the gRPC port's. A request is what a program of :mod:`.frames` asks for, an
answer goes back to it; no client library or grpc-like call stands in between.

* :class:`SocketWire`: a ``/ws`` socket whose own task runs its stream. ``read`` takes
  the socket's next frame and turns it into the stream's next request (a frame that needs
  none, or is not understood, is answered at once); ``write`` turns the answer into the
  frame the client waits for. The next frame is read once the last answer has left.
* :class:`ProgramStream`: a stream in a task of its own that answers programs handed to
  it one at a time, from any task (held ``/mcp`` sessions and the sockets attached to
  them, the stateless HTTP calls, ``WS /mcp``).

The caller authenticates before it opens a stream: nothing here checks a token.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from collections.abc import Callable, Sequence
from time import monotonic
from typing import Any, NoReturn, TypeVar

import grpc
from starlette.websockets import WebSocket, WebSocketDisconnect

from openenv_grpc.client.protocol import SessionProtocol, SessionTypes
from openenv_grpc.integrations.openenv.frames import Call, FrameAnswers, Program, parse_frame
from openenv_grpc.metadata import INFO_JSON, INFO_KEY
from openenv_grpc.v1 import session_pb2 as pb

__all__ = ["ProgramStream", "Refused", "SocketWire", "StreamEnded"]

log = logging.getLogger("openenv_grpc.gateway")

T = TypeVar("T")

#: The servicer's Session handler: runs one stream to its end on a wire.
Handler = Callable[[Any, Any], Any]

#: The call a close makes: the stream's close command.
_CLOSE: Call = ("close",)
_EOF: Any = grpc.aio.EOF
#: Infos as JSON text (ints stay ints), as the door's answers write them.
_METADATA = ((INFO_KEY, INFO_JSON),)


class StreamEnded(Exception):
    """The core ended the stream (idle, drain, a lost env process, a refusal): ``code``
    and ``details`` are its status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class Refused(StreamEnded):
    """The core did not admit the stream (``RESOURCE_EXHAUSTED``: the server is full)."""


class _ProgramWire:
    """What both wires share: a program's calls as the stream's requests, the answers
    back into it (``server.stream.wire.Wire`` for the core)."""

    __slots__ = (
        "_call", "_heard", "_pending", "_program", "_protocol", "_request_id", "admitted",
        "status",
    )  # fmt: skip

    def __init__(self, types: SessionTypes) -> None:
        self._protocol = SessionProtocol(types)
        #: The program being run, and the call of it the core is answering.
        self._program: Program[Any] | None = None
        self._call: Call | None = None
        self._request_id = 0
        #: The program's next request, for the next ``read``.
        self._pending: bytes | None = None
        #: The core admitted the stream and made its env.
        self.admitted = False
        #: How the core ended the stream, if it aborted it: (code, details).
        self.status: tuple[grpc.StatusCode, str] | None = None
        #: Loop time the client last did something the core does not see (a frame the
        #: wire answered itself), inf while a frame waits on work beside the session.
        self._heard = 0.0

    def heard(self) -> float:
        """When the client was last heard apart from the core's requests (``Wire``): the
        idle reaper leaves the stream alone until this too is past the idle timeout."""
        return self._heard

    @property
    def episode_id(self) -> str:
        return self._protocol.episode_id

    @property
    def step_count(self) -> int:
        return self._protocol.step_count

    async def send_initial_metadata(self, initial_metadata: Sequence[tuple[str, str]]) -> None:
        self.admitted = True

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: Sequence[tuple[str, str]] = (),
    ) -> NoReturn:
        self.status = (code, details)
        raise grpc.aio.AbortError()

    def invocation_metadata(self) -> Sequence[tuple[str, Any]]:
        return _METADATA

    def _close_request(self) -> bytes:
        self._call = _CLOSE
        request: pb.SessionRequest = self._protocol.close_request()
        self._request_id = request.request_id
        return request.SerializeToString()

    def _answered(self, message: bytes) -> tuple[Call | None, Any, BaseException | None]:
        """The call ``message`` answers (None: no call of ours, e.g. a drain's notice, or
        the close), with its result or its error."""
        response = pb.SessionResponse.FromString(message)
        call = self._call
        if call is None or response.request_id != self._request_id:
            return None, None, None
        self._call = None
        if call is _CLOSE:
            return None, None, None
        try:
            return call, self._result(call, response), None
        except Exception as exc:  # an error answer: the program maps it
            return call, None, exc

    async def _advance(self, value: Any, error: BaseException | None) -> tuple[bytes | None, Any]:
        """Run the program to its next session call: that call's request bytes, or (None,
        what the program returned) once it is done. Work beside the session is awaited
        here. What the program raises comes out here."""
        program = self._program
        assert program is not None
        while True:
            try:
                call = program.throw(error) if error is not None else program.send(value)
            except StopIteration as stop:
                self._program = None
                return None, stop.value
            except BaseException:
                self._program = None
                raise
            value = error = None
            if call[0] == "await":
                self._heard = math.inf  # the client waits on it: not idle
                try:
                    value = await call[1]
                except Exception as exc:
                    error = exc
                finally:
                    self._heard = monotonic()
                continue
            try:
                request = self._request(call)
            except Exception as exc:  # a seed out of range, say: nothing is sent
                error = exc
                continue
            self._call = call
            self._request_id = request.request_id
            return request.SerializeToString(), None

    def _request(self, call: Call) -> pb.SessionRequest:
        protocol, kind = self._protocol, call[0]
        if kind == "step":
            return protocol.step_request(call[1])
        if kind == "reset":
            return protocol.reset_request(call[1], call[2], call[3])
        return protocol.query_request("state")

    def _result(self, call: Call, response: pb.SessionResponse) -> Any:
        protocol = self._protocol
        if call[0] == "state":
            return protocol.decode(protocol.query_result(response, "state").state, "state")
        return protocol.step_result(response)


class SocketWire(_ProgramWire):
    """The server's end of one ``/ws`` socket's stream, run by the socket's own task.

    Args:
        websocket: The accepted socket.
        answers: The frame programs of the door's env.
        types: The env's message classes (what results decode into).
        own_id: The id an ``openenv/session/create`` on this socket answers.
        token: The bearer token the socket came with (``/mcp`` calls it makes use it).
    """

    __slots__ = ("_answers", "_ended", "_in_flight", "_own_id", "_token", "_ws")

    def __init__(
        self,
        websocket: WebSocket,
        answers: FrameAnswers,
        types: SessionTypes,
        own_id: str,
        token: str | None,
    ) -> None:
        super().__init__(types)
        self._ws = websocket
        self._answers = answers
        self._own_id = own_id
        self._token = token
        #: A frame is being answered: the client waits for its answer.
        self._in_flight = False
        #: The client went, or asked to close: nothing more is read.
        self._ended = False

    @property
    def in_flight(self) -> bool:
        """The client waits for the answer to a frame."""
        return self._in_flight

    async def read(self) -> Any:
        """The stream's next request: the rest of the frame under way, else the next
        frame's first; ``grpc.aio.EOF`` once the client went."""
        pending = self._pending
        if pending is not None:
            self._pending = None
            return pending
        if not self.admitted or self._ended:
            return _EOF  # only a refusal reads before admission
        while True:
            frame = await self._next_frame()
            if frame is None:
                return _EOF
            if isinstance(frame, str):  # not a frame: answered at once
                self._heard = monotonic()  # a frame the core does not see (the loop's clock)
                if not await self._send(frame):
                    return _EOF
                continue
            kind, data = frame
            if kind == "close":
                self._ended = True
                return self._close_request()
            self._in_flight = True
            self._program = self._answers.frame(self, kind, data, self._own_id, self._token)
            request, text = await self._advance(None, None)
            if request is not None:
                return request  # the core's clock sees this one
            self._heard = monotonic()  # answered without the core
            self._in_flight = False
            if not await self._send(text):
                return _EOF

    async def write(self, message: bytes) -> None:
        """Take the core's answer to the frame's call: go on with the frame, or send the
        frame's answer. Answers to no call of ours (a drain's notice) are dropped: the
        socket learns of a drain by its close frame."""
        call, value, error = self._answered(message)
        if call is None:
            return
        request, text = await self._advance(value, error)
        if request is not None:
            self._pending = request
            return
        self._in_flight = False
        await self._ws.send_text(text)

    def cancelled(self) -> bool:
        return self._ended

    async def _send(self, text: str) -> bool:
        """Send an answer the core did not write (a frame that needed no request of it);
        False if the client has gone (the stream then ends as on its going)."""
        try:
            await self._ws.send_text(text)
        except Exception:  # gone mid-frame: nobody to tell, nothing to log
            self._ended = True
            return False
        return True

    async def _next_frame(self) -> tuple[str, Any] | str | None:
        """The socket's next frame as (type, data), or the error frame answering what was
        not one; None once the client went."""
        try:
            event = await self._ws.receive()
        except (RuntimeError, WebSocketDisconnect):  # already closed
            self._ended = True
            return None
        if event["type"] == "websocket.disconnect":
            self._ended = True
            return None
        raw = event.get("text")
        return parse_frame(raw if isinstance(raw, str) else None)


class ProgramStream(_ProgramWire):
    """A stream of the core in a task of its own, answering the programs handed to
    :meth:`run` one at a time, in order, from any task.

    Args:
        handler: The servicer's ``Session`` handler.
        types: The env's message classes.
        on_end: Called with the stream's status when the core ends it (idle, drain, a
            lost env process): a socket on it closes.
    """

    __slots__ = ("_closing", "_ended", "_future", "_opened", "_queue", "_task", "_wake")

    def __init__(
        self,
        handler: Handler,
        types: SessionTypes,
        on_end: Callable[[grpc.StatusCode, str], None] | None = None,
    ) -> None:
        super().__init__(types)
        loop = asyncio.get_running_loop()
        #: Programs handed over and not yet begun, each with the future of its caller.
        self._queue: collections.deque[tuple[Program[Any], asyncio.Future[Any]]] = (
            collections.deque()
        )
        #: Set when the queue gets something (or the stream should close).
        self._wake: asyncio.Future[None] | None = None
        #: The caller of the program under way.
        self._future: asyncio.Future[Any] | None = None
        self._closing = False
        #: The stream's status once it ended; None while it runs.
        self._ended: StreamEnded | None = None
        self._opened: asyncio.Future[None] = loop.create_future()
        self._task = asyncio.ensure_future(self._serve(handler, on_end))

    async def open(self) -> None:
        """Wait until the core admitted the stream and made its env.

        Raises:
            Refused: it was not admitted (RESOURCE_EXHAUSTED: the server is full), or its
                env could not be made.
        """
        await asyncio.shield(self._opened)

    async def run(self, program: Program[T]) -> T:
        """Run ``program`` on the stream, after those handed over before it.

        Raises:
            StreamEnded: the stream ended before the program did.
            Exception: what the program raised.
        """
        if self._ended is not None or self._closing:
            program.close()
            raise self._ended or StreamEnded(grpc.StatusCode.CANCELLED, "the session closed")
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._queue.append((program, future))
        self._poke()
        return await future

    async def close(self) -> None:
        """Close the env (after the programs handed over) and end the stream; never raises
        for how the stream ended."""
        if self._ended is None:
            self._closing = True
            self._poke()
        await asyncio.wait((self._task,))

    # -- the Wire -----------------------------------------------------------------------------

    async def read(self) -> Any:
        pending = self._pending
        if pending is not None:
            self._pending = None
            return pending
        if not self.admitted:
            return _EOF  # only a refusal reads before admission
        while True:
            while not self._queue:
                if self._closing:
                    return self._close_request()
                self._wake = asyncio.get_running_loop().create_future()
                try:
                    await self._wake
                finally:
                    self._wake = None
            program, future = self._queue.popleft()
            if future.done():  # its caller gave up
                program.close()
                continue
            self._program, self._future = program, future
            request, value = await self._begin()
            if request is not None:
                return request
            self._finish(value)

    async def write(self, message: bytes) -> None:
        call, value, error = self._answered(message)
        if call is None:
            return
        try:
            request, result = await self._advance(value, error)
        except Exception as exc:
            self._fail(exc)
            return
        if request is not None:
            self._pending = request
            return
        self._finish(result)

    def cancelled(self) -> bool:
        return False

    # -- its task -----------------------------------------------------------------------------

    async def _serve(
        self, handler: Handler, on_end: Callable[[grpc.StatusCode, str], None] | None
    ) -> None:
        status: tuple[grpc.StatusCode, str] = (grpc.StatusCode.OK, "the session closed")
        try:
            await handler(None, self)
        except grpc.aio.AbortError:
            status = self.status or (grpc.StatusCode.UNKNOWN, "aborted")
        except asyncio.CancelledError:
            status = (grpc.StatusCode.CANCELLED, "the session was cancelled")
        except Exception as exc:  # a bug in the handler: say so, end the stream
            log.exception("a door session's stream failed")
            status = (grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc).__name__}: {exc}")
        finally:
            code, details = status
            admitted = self.admitted
            ended = self._ended = (StreamEnded if admitted else Refused)(code, details)
            if not self._opened.done():
                if admitted:
                    self._opened.set_result(None)
                else:
                    self._opened.set_exception(ended)
                    self._opened.exception()  # retrieved: open() raises it to its caller
            if self._future is not None and not self._future.done():
                self._future.set_exception(ended)
            if self._program is not None:
                self._program.close()
                self._program = None
            while self._queue:
                program, future = self._queue.popleft()
                program.close()
                if not future.done():
                    future.set_exception(ended)
            if on_end is not None and code is not grpc.StatusCode.OK:
                on_end(code, details)

    async def send_initial_metadata(self, initial_metadata: Sequence[tuple[str, str]]) -> None:
        self.admitted = True
        if not self._opened.done():
            self._opened.set_result(None)

    async def _begin(self) -> tuple[bytes | None, Any]:
        try:
            return await self._advance(None, None)
        except Exception as exc:
            self._fail(exc)
            return None, _FAILED

    def _finish(self, value: Any) -> None:
        future, self._future = self._future, None
        if value is _FAILED or future is None:
            return
        if not future.done():
            future.set_result(value)

    def _fail(self, exc: BaseException) -> None:
        future, self._future = self._future, None
        if future is not None and not future.done():
            future.set_exception(exc)

    def _poke(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)


#: A program that raised: its caller got the exception already.
_FAILED: Any = object()
