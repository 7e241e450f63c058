"""The door's sessions as Session streams of the core (``SessionManager.run``: admission
by the limiter, the stream loop, the idle reaper, the drain, the byte budget and the
metrics are the gRPC port's), with no envelope: a request of the stream is a frame's
program (:mod:`.frames`), run by :class:`DoorView` on the session's ``SessionView``,
whose commands it calls directly; the answer is the frame the client waits for.

* :class:`SocketWire`: a ``/ws`` socket whose own task runs its stream. ``read`` takes
  the socket's next frame as the stream's next request; ``write`` sends its answer. The
  next frame is read once the last answer has left.
* :class:`ProgramStream`: a stream in a task of its own that answers programs handed to
  it one at a time, from any task (held ``/mcp`` sessions and the sockets attached to
  them, the stateless HTTP calls, ``WS /mcp``).

The caller authenticates before it opens a stream: nothing here checks a token.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf import struct_pb2
from google.protobuf.message import Message
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from openenv_grpc.client import EnvError, StepOutcome
from openenv_grpc.client.protocol import SessionTypes, fill_reset, status_code
from openenv_grpc.codec import info_from_json, info_from_struct
from openenv_grpc.integrations.openenv.frames import (
    FrameAnswers,
    Program,
    error_frame,
    parse_frame,
)
from openenv_grpc.server.errors import CODE_NAMES, RequestError
from openenv_grpc.server.local.batch import BatchOutcome
from openenv_grpc.server.local.calls import BatchRefused
from openenv_grpc.server.local.frames import info_text, struct_info
from openenv_grpc.server.stream.backend import Answer, Outcome, SessionBackend
from openenv_grpc.server.stream.session import Held, StreamOpening
from openenv_grpc.server.stream.session_view import SessionView
from openenv_grpc.server.stream.wire import Wire
from openenv_grpc.v1 import session_pb2 as pb

__all__ = [
    "DoorOpening",
    "DoorRequest",
    "DoorSessions",
    "DoorView",
    "OpenView",
    "ProgramStream",
    "Refused",
    "RunStream",
    "SocketWire",
    "StreamEnded",
]

log = logging.getLogger("openenv_grpc.gateway")

T = TypeVar("T")

#: Runs one stream of the core to its end: ``EnvServicer.run_stream``.
RunStream = Callable[[Wire, StreamOpening], Awaitable[None]]
#: Makes an admitted Session stream's env and its view (``objects``: its observations
#: unserialized where it can): ``EnvServicer.open_session_view``.
OpenView = Callable[[Held, bool], Awaitable[SessionView]]
_EOF: Any = grpc.aio.EOF
_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


class StreamEnded(Exception):
    """The core ended the stream (idle, drain, a lost env process, a refusal): ``code``
    and ``details`` are its status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class Refused(StreamEnded):
    """The core did not admit the stream (``RESOURCE_EXHAUSTED``: the server is full)."""


class DoorRequest:
    """One request of a door stream: a program, and what becomes of what it returns.

    ``finish`` turns the program's value into the answer's bytes (a socket's frame text;
    a program handed to a :class:`ProgramStream` gives it to its caller and answers
    nothing); ``fail`` does the same for what the program raised.
    """

    __slots__ = ("fail", "finish", "future", "kind", "program")

    def __init__(
        self,
        kind: str,
        program: Program[Any] | None,
        finish: Callable[[Any], bytes],
        fail: Callable[[BaseException], bytes],
        future: asyncio.Future[Any] | None = None,
    ) -> None:
        self.kind = kind  # the frame's type, for the core's refusals ("close": the close)
        self.program = program
        self.finish = finish
        self.fail = fail
        self.future = future  # a ProgramStream's caller waits on it


#: A frame's text as the answer's bytes (``str.encode`` itself: no call of ours a frame).
_encoded: Callable[[str], bytes] = str.encode


def _reraise(exc: BaseException) -> bytes:
    raise exc


#: The close of a socket's session (its ``close`` frame, or its going).
_CLOSE = DoorRequest("close", None, _encoded, _reraise)


class DoorOpening:
    """A door session, for ``SessionManager.run``: one slot, one env, as a gRPC Session
    (the same open); requests are :class:`DoorRequest`; a refusal is an error frame."""

    slots = 1
    in_flight = 0
    notices = False  # a socket learns of a drain by its close frame

    def __init__(self, sessions: DoorSessions, wire: SocketWire | ProgramStream) -> None:
        self._sessions = sessions
        self._wire = wire

    async def open(self, held: Held) -> SessionBackend:
        sessions = self._sessions
        view = await sessions.open_view(held, sessions.native)
        door = DoorView(view, sessions.types, sessions.max_response)
        self._wire.door = door
        return door

    def headers(self) -> tuple[tuple[str, str], ...]:
        return ()

    def command_of(self, raw: Any, strict: bool = False) -> tuple[int, str]:
        return 0, raw.kind if isinstance(raw, DoorRequest) else "request"

    def exhausted(self, request_id: int, message: str) -> bytes:
        return error_frame("EXECUTION_ERROR", message).encode()


class DoorSessions:
    """Runs the door's sessions as Session streams of the core.

    Args:
        run_stream: Runs one stream to its end (``EnvServicer.run_stream``).
        open_view: Makes an admitted Session's env (``EnvServicer.open_session_view``).
        types: The env's message classes (what results decode into).
        native: The env takes the native lane (a bridged env): its sessions keep their
            observations unserialized where the env runs in this process.
        max_response: The largest answer to one call (``--max-message-bytes``).
    """

    def __init__(
        self,
        run_stream: RunStream,
        open_view: OpenView,
        types: SessionTypes,
        native: bool,
        max_response: int,
    ) -> None:
        self._run_stream = run_stream
        self.open_view = open_view
        self.types = types
        self.native = native
        self.max_response = max_response

    def run(self, wire: SocketWire | ProgramStream) -> Awaitable[None]:
        """Run ``wire``'s stream to its end (raises ``grpc.aio.AbortError`` when the core
        aborted it: ``wire.status`` says how). Not a coroutine of its own: one frame less
        for every resume of the stream's task."""
        return self._run_stream(wire, DoorOpening(self, wire))


class DoorView:
    """The backend of a door session: runs each request's program, its session calls made
    on the session's :class:`SessionView` (what it returns as the client library would
    return it: a ``StepOutcome``, a state message; an in-band error as ``EnvError``).

    A program's ``("await", awaitable)`` (work beside the session: another session's
    close) is awaited inside the request, so the session is not idle meanwhile.
    """

    __slots__ = ("_driver", "_max", "_observation", "_options", "_state", "_view", "native")

    def __init__(self, view: SessionView, types: SessionTypes, max_response: int) -> None:
        assert types.observation is not None and types.state is not None
        self._max = max_response
        self._view = view
        self._driver = view.driver
        self._observation = types.observation
        self._state = types.state
        self._options = types.reset_options
        #: A step may take the native lane: the env runs here, its observations unserialized.
        self.native = view.objects

    @property
    def episode_id(self) -> str:
        return self._driver.episode_ids[0]

    @property
    def step_count(self) -> int:
        return self._driver.step_counts[0]

    async def close(self) -> None:
        await self._view.close()

    async def handle(self, raw: DoorRequest) -> Answer:
        view, driver = self._view, self._driver
        program = raw.program
        if program is None:  # the close: the stream ends after it, whatever close raised
            try:
                if view.replacing is not None and (waiting := view.replacing()) is not None:
                    await waiting
                await driver.close_command()
            except (RequestError, BatchRefused) as err:
                log.debug("a door session's close failed: %s", err.message)
            return Answer(b"", Outcome.CLOSED, ends=True)
        value: Any = None
        error: BaseException | None = None
        steps, seconds, failed, saturated = 0, 0.0, "", False
        try:
            while True:
                try:
                    call = program.throw(error) if error is not None else program.send(value)
                except StopIteration as stop:
                    response = raw.finish(stop.value)
                    break
                except Exception as exc:
                    response = raw.fail(exc)
                    break
                value = error = None
                kind = call[0]
                try:  # what the program itself should see fail: a side call, bad arguments
                    if kind == "await":
                        value = await call[1]
                        continue
                    command = self._reset(*call[1:]) if kind == "reset" else None
                except Exception as exc:
                    error = exc
                    continue
                try:  # a SessionLostError goes on up: the stream ends
                    if view.replacing is not None and (waiting := view.replacing()) is not None:
                        await waiting
                    if kind == "step":
                        outcome, took = await view.step(call[1])
                        steps += 1
                        seconds += took
                        value = self._outcome(outcome, "step")
                    elif command is not None:
                        value = self._outcome(await view.reset(command), "reset")
                    else:
                        state = await view.state()
                        self._fits("state", len(state))
                        value = self._state.FromString(state)
                except (RequestError, BatchRefused) as err:
                    if isinstance(err, BatchRefused):
                        driver.refused(err, kind)
                        saturated = saturated or err.saturated
                    failed = CODE_NAMES.get(err.code, str(err.code))
                    error = EnvError(status_code(err.code), err.message, err.exception_type)
        except BaseException:  # the stream ends under the program (lost, cancelled)
            program.close()
            raise
        if failed:
            outcome_kind = Outcome.SATURATED if saturated else Outcome.FAILED
        else:
            outcome_kind = Outcome.STEPPED if steps else Outcome.ANSWERED
        return Answer(response, outcome_kind, seconds, failed, driver.ends, steps)

    def _reset(self, seed: Any, episode_id: Any, options: Message | None) -> pb.ResetCommand:
        """A reset's arguments, checked as a Session client sends them (raises ValueError or
        PayloadTypeError: nothing is done)."""
        command = pb.ResetCommand()
        fill_reset(command, seed, episode_id, options, self._options)
        return command

    def _fits(self, command: str, size: int) -> None:
        """Raise the in-band RESOURCE_EXHAUSTED a gRPC answer of ``size`` bytes over the
        message limit gets (the call took effect)."""
        if size > self._max:
            raise RequestError(_RESOURCE_EXHAUSTED, _too_large(command, size, self._max))

    def _outcome(self, outcome: BatchOutcome, command: str) -> StepOutcome[Any]:
        """Row 0 of a reset or step as the client library reads it from its answer (one
        over the message limit refused as a gRPC answer would be)."""
        driver = self._driver
        observation = outcome.observations[0]
        if type(observation) is bytes:  # else the env's own object (``objects``)
            self._fits(command, len(observation))
            observation = self._observation.FromString(observation)
        elif isinstance(observation, Message):
            self._fits(command, observation.ByteSize())
        return StepOutcome(
            observation=observation,
            reward=outcome.rewards[0],
            terminated=outcome.terminated[0],
            truncated=outcome.truncated[0],
            episode_id=driver.episode_ids[0],
            step_count=driver.step_counts[0],
            info=_info(info) if (info := outcome.infos.get(0)) else {},
            no_reward=0 in outcome.no_reward,
        )


#: Value types a JSON round trip gives back unchanged (a float too, when finite).
_PLAIN = frozenset({str, int, bool, type(None)})


def _too_large(command: str, size: int, limit: int) -> str:
    return (
        f"the {command} response is {size} bytes, over the server's message limit of "
        f"{limit} bytes (--max-message-bytes): the {command} took effect but its result "
        "cannot be sent; the session goes on"
    )


def _info(info: Any) -> dict[str, Any]:
    """A row's info as a Session's client reads it: through JSON text, or a Struct (a NaN
    or an infinity in it). A flat map of plain values is that already (no round trip)."""
    if not info:
        return {}
    if type(info) is dict:
        for key, value in info.items():
            kind = type(value)
            # value - value: 0.0 for a finite float, NaN otherwise
            if type(key) is not str or (
                kind not in _PLAIN and (kind is not float or value - value)
            ):
                break
        else:
            return info
    text = info_text(info)
    if text is not None:
        return info_from_json(text)
    struct = struct_pb2.Struct()
    struct_info(info, struct)
    return info_from_struct(struct)


class _DoorWire:
    """What both wires share (``server.stream.wire.Wire`` for the core), and what a
    program reads of its session between calls (``frames.SessionView``)."""

    __slots__ = ("admitted", "door", "status")

    def __init__(self) -> None:
        #: The core admitted the stream and made its env.
        self.admitted = False
        #: How the core ended the stream, if it aborted it: (code, details).
        self.status: tuple[grpc.StatusCode, str] | None = None
        #: The session's backend, once the core opened it.
        self.door: DoorView | None = None

    @property
    def episode_id(self) -> str:
        return "" if self.door is None else self.door.episode_id

    @property
    def step_count(self) -> int:
        return 0 if self.door is None else self.door.step_count

    @property
    def native(self) -> bool:
        return self.door is not None and self.door.native

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
        return ()


class DoorSocket(WebSocket):
    """starlette's WebSocket, whose ASGI calls a :class:`SocketWire` makes itself for each
    frame (starlette's ``receive`` and ``send_text`` are two more coroutines a message);
    the wire keeps starlette's state as they would."""

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        super().__init__(scope, receive, send)
        self.asgi_receive = receive
        self.asgi_send = send


class SocketWire(_DoorWire):
    """The server's end of one ``/ws`` socket's stream, run by the socket's own task.

    Args:
        websocket: The accepted socket.
        answers: The frame programs of the door's env.
        own_id: The id an ``openenv/session/create`` on this socket answers.
        token: The bearer token the socket came with (``/mcp`` calls it makes use it).
    """

    __slots__ = ("_answers", "_ended", "_in_flight", "_own_id", "_token", "_ws")

    def __init__(
        self, websocket: DoorSocket, answers: FrameAnswers, own_id: str, token: str | None
    ) -> None:
        super().__init__()
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
        """The stream's next request: the socket's next frame; ``grpc.aio.EOF`` once the
        client went or asked to close."""
        ws = self._ws
        if not self.admitted or self._ended or ws.client_state is not WebSocketState.CONNECTED:
            return _EOF  # only a refusal reads before admission
        event = await ws.asgi_receive()
        if event["type"] == "websocket.disconnect":
            ws.client_state = WebSocketState.DISCONNECTED
            self._ended = True
            return _EOF
        raw: Any = event.get("text")
        frame = parse_frame(raw if isinstance(raw, str) else None)
        if isinstance(frame, str):  # not a frame: its error frame is the answer
            self._in_flight = True
            return DoorRequest("error", _answered(frame), _encoded, _reraise)
        kind, data = frame
        if kind == "close":
            self._ended = True
            return _CLOSE
        self._in_flight = True
        session = self.door if self.door is not None else self  # what its program reads
        program = self._answers.frame(session, kind, data, self._own_id, self._token, len(raw))
        return DoorRequest(str(kind), program, _encoded, _reraise)

    async def write(self, message: bytes) -> None:
        """Send the answer to the frame (nothing for the close)."""
        if message:
            ws = self._ws
            if ws.application_state is not WebSocketState.CONNECTED:  # closed meanwhile
                raise WebSocketDisconnect(1006)
            try:
                await ws.asgi_send({"type": "websocket.send", "text": message.decode()})
            except OSError:  # uvicorn's ClientDisconnected: as starlette's send says it
                ws.application_state = WebSocketState.DISCONNECTED
                raise WebSocketDisconnect(1006) from None
        self._in_flight = False

    def cancelled(self) -> bool:
        return self._ended


def _answered(text: str) -> Program[str]:
    """A program that needs no session call: its answer is ``text``."""
    return text
    yield  # a generator


class ProgramStream(_DoorWire):
    """A stream of the core in a task of its own, answering the programs handed to
    :meth:`run` one at a time, in order, from any task.

    Args:
        sessions: Runs the stream on the core.
        on_end: Called with the stream's status when the core ends it (idle, drain, a
            lost env process): a socket on it closes.
    """

    __slots__ = (
        "_closing", "_current", "_ended", "_opened", "_queue", "_sessions", "_task", "_wake",
    )  # fmt: skip

    def __init__(
        self,
        sessions: DoorSessions,
        on_end: Callable[[grpc.StatusCode, str], None] | None = None,
    ) -> None:
        super().__init__()
        loop = asyncio.get_running_loop()
        #: Programs handed over and not yet begun, each with the future of its caller.
        self._queue: collections.deque[DoorRequest] = collections.deque()
        #: The request under way (its caller is told if the stream ends under it).
        self._current: DoorRequest | None = None
        #: Set when the queue gets something (or the stream should close).
        self._wake: asyncio.Future[None] | None = None
        self._closing = False
        #: The stream's status once it ended; None while it runs.
        self._ended: StreamEnded | None = None
        self._opened: asyncio.Future[None] = loop.create_future()
        self._sessions = sessions
        self._task = asyncio.ensure_future(self._serve(sessions, on_end))

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
        limit = self._sessions.max_response

        def finish(value: Any) -> bytes:
            # A frame (a native lane's), measured in bytes as a socket's own answers are.
            if (
                type(value) is str
                and len(value) * 4 > limit
                and len(encoded := value.encode()) > limit
            ):
                value = error_frame("EXECUTION_ERROR", _too_large("frame", len(encoded), limit))
            if not future.done():
                future.set_result(value)
            return b""

        def fail(exc: BaseException) -> bytes:
            if not future.done():
                future.set_exception(exc)
            return b""

        self._queue.append(DoorRequest("program", program, finish, fail, future))
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
        if not self.admitted:
            return _EOF  # only a refusal reads before admission
        while True:
            while not self._queue:
                if self._closing:
                    return _CLOSE
                self._wake = asyncio.get_running_loop().create_future()
                try:
                    await self._wake
                finally:
                    self._wake = None
            request = self._queue.popleft()
            if request.future is not None and request.future.done():  # its caller gave up
                assert request.program is not None
                request.program.close()
                continue
            self._current = request
            return request

    async def write(self, message: bytes) -> None:
        """Nothing to send: the program's caller has its answer already."""
        self._current = None

    def cancelled(self) -> bool:
        return False

    # -- its task -----------------------------------------------------------------------------

    async def _serve(
        self, sessions: DoorSessions, on_end: Callable[[grpc.StatusCode, str], None] | None
    ) -> None:
        status: tuple[grpc.StatusCode, str] = (grpc.StatusCode.OK, "the session closed")
        try:
            await sessions.run(self)
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
            current, self._current = self._current, None
            if current is not None:  # the stream ended under it
                current.fail(ended)
            while self._queue:
                request = self._queue.popleft()
                if request.program is not None:
                    request.program.close()
                request.fail(ended)
            if on_end is not None and code is not grpc.StatusCode.OK:
                on_end(code, details)

    async def send_initial_metadata(self, initial_metadata: Sequence[tuple[str, str]]) -> None:
        self.admitted = True
        if not self._opened.done():
            self._opened.set_result(None)

    def _poke(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)
