"""An OpenEnv ``/ws`` WebSocket that is itself a Session stream of the core.

The socket's own task runs the core's Session handler (``EnvServicer.Session``:
``SessionManager.run``) with a :class:`SocketWire` as its wire: admission by the limiter,
the stream loop, the idle reaper, the drain, the byte budget and the metrics are the gRPC
port's, and no client library, mailbox or second task stands between the socket and the
env. The wire's ``read`` takes the socket's next frame and turns it into the next request
of the stream (a frame that needs none, or is not understood, is answered at once); its
``write`` turns the answer into the frame the client waits for. A frame needing several
requests (a step before any reset, a tool call) is a program of :mod:`.frames`: its
requests go to the core one by one.

The caller authenticates the socket before the core sees it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import grpc
from starlette.websockets import WebSocket, WebSocketDisconnect

from openenv_grpc.client.protocol import SessionProtocol, SessionTypes
from openenv_grpc.integrations.openenv.frames import Call, FrameAnswers, Program, parse_frame
from openenv_grpc.metadata import INFO_JSON, INFO_KEY
from openenv_grpc.v1 import session_pb2 as pb

__all__ = ["SocketWire"]

#: The call a ``{"type": "close"}`` frame makes: the stream's close command.
_CLOSE: Call = ("close",)
_EOF: Any = grpc.aio.EOF
#: Infos as JSON text, as the door's other sessions read them (ints stay ints).
_METADATA = ((INFO_KEY, INFO_JSON),)


class SocketWire:
    """The server's end of one socket's Session stream (a ``server.stream.wire.Wire``).

    Args:
        websocket: The accepted socket.
        answers: The frame programs of the door's env.
        types: The env's message classes (what results decode into).
        own_id: The id an ``openenv/session/create`` on this socket answers.
        token: The bearer token the socket came with (``/mcp`` calls it makes use it).
    """

    __slots__ = (
        "_answers", "_call", "_ended", "_in_flight", "_own_id", "_pending", "_program",
        "_protocol", "_request_id", "_token", "_ws", "admitted", "status",
    )  # fmt: skip

    def __init__(
        self,
        websocket: WebSocket,
        answers: FrameAnswers,
        types: SessionTypes,
        own_id: str,
        token: str | None,
    ) -> None:
        self._ws = websocket
        self._answers = answers
        self._protocol = SessionProtocol(types)
        self._own_id = own_id
        self._token = token
        #: The frame being answered, and the call of it the core is answering.
        self._program: Program[str] | None = None
        self._call: Call | None = None
        self._request_id = 0
        #: The next request of the frame under way, for the next ``read``.
        self._pending: bytes | None = None
        #: A frame is being answered: the client waits for its answer.
        self._in_flight = False
        #: The client went, or asked to close: nothing more is read.
        self._ended = False
        #: The core admitted the stream and made its env.
        self.admitted = False
        #: How the core ended the stream, if it aborted it: (code, details).
        self.status: tuple[grpc.StatusCode, str] | None = None

    @property
    def in_flight(self) -> bool:
        """The client waits for the answer to a frame."""
        return self._in_flight

    # -- the Wire ---------------------------------------------------------------------------

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
            request, text = await self._start(frame)
            if request is not None:
                return request
            await self._ws.send_text(text)

    async def write(self, message: bytes) -> None:
        """Take the core's answer to the frame's call: go on with the frame, or send the
        frame's answer. Answers to no call of ours (a drain's notice) are dropped: the
        socket learns of a drain by its close frame."""
        response = pb.SessionResponse.FromString(message)
        call = self._call
        if call is None or response.request_id != self._request_id:
            return
        self._call = None
        if call is _CLOSE:
            return  # the stream ends after it; the socket closes 1000
        value: Any = None
        error: BaseException | None = None
        try:
            value = self._result(call, response)
        except Exception as exc:  # an error answer: the program maps it to a frame
            error = exc
        request, text = await self._advance(value, error)
        if request is not None:
            self._pending = request
            return
        self._in_flight = False
        await self._ws.send_text(text)

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

    def cancelled(self) -> bool:
        return self._ended

    def invocation_metadata(self) -> Sequence[tuple[str, Any]]:
        return _METADATA

    # -- frames -----------------------------------------------------------------------------

    async def _next_frame(self) -> tuple[str, Any] | str | None:
        """The socket's next frame as (type, data), or the error frame answering what was
        not one; None once the client went or asked to close."""
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

    async def _start(self, frame: tuple[str, Any] | str) -> tuple[bytes | None, str]:
        """Begin answering ``frame``: its first request, or its whole answer."""
        if isinstance(frame, str):
            return None, frame
        kind, data = frame
        if kind == "close":
            self._ended = True
            self._call = _CLOSE
            request = self._protocol.close_request()
            self._request_id = request.request_id
            return request.SerializeToString(), ""
        self._in_flight = True
        self._program = self._answers.frame(self._protocol, kind, data, self._own_id, self._token)
        request, text = await self._advance(None, None)
        if request is None:
            self._in_flight = False
        return request, text

    async def _advance(self, value: Any, error: BaseException | None) -> tuple[bytes | None, str]:
        """Run the frame's program to its next session call: that call's request bytes,
        or (None, the answer) once it is done. Work beside the session is awaited here."""
        program = self._program
        assert program is not None
        while True:
            try:
                call = program.throw(error) if error is not None else program.send(value)
            except StopIteration as stop:
                self._program = None
                return None, stop.value
            value = error = None
            if call[0] == "await":
                try:
                    value = await call[1]
                except Exception as exc:
                    error = exc
                continue
            try:
                request = self._request(call)
            except Exception as exc:  # a seed out of range, say: nothing is sent
                error = exc
                continue
            self._call = call
            self._request_id = request.request_id
            return request.SerializeToString(), ""

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
