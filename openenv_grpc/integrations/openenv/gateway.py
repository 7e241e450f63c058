"""OpenEnv's client protocol served beside gRPC: ``serve ... --openenv-port PORT``.

OpenEnv's own clients (``GenericEnvClient``, an ``EnvClient`` subclass, sync or async,
``MCPToolClient``) get OpenEnv 0.10.0's client protocol as its ``create_app`` serves it in
simulation mode: ``WS /ws`` frames ``{"type": "reset" | "step" | "state" | "close" |
"mcp", "data": ...}`` answered by ``{"type": "observation" | "state" | "mcp" | "error",
"data": ...}``; ``WS /mcp`` (plain JSON-RPC); the stateless ``POST /reset``, ``POST
/step``, ``GET /state`` (a session for each call); ``POST /mcp`` JSON-RPC with or without
a session; ``/health``, ``/metadata``, ``/schema`` (for a bridged env its own models'
schemas and ``get_metadata()``: :mod:`.published`).

Every session is a Session stream of this process's core, run by the core's own handler
with a wire of :mod:`.streams` (no client library, no network hop): a ``/ws`` socket's
own task runs its stream; held ``/mcp`` sessions, the stateless calls and ``WS /mcp``
are streams in a task of their own that take the door's calls in turn. So the capacity
limiter, the token check (the gRPC
port's own), idle timeouts, drain, the byte budget and metrics are exactly the gRPC ones,
and a full server answers with OpenEnv's own ``CAPACITY_REACHED`` frame. Frames and tool
calls are answered by the programs of :mod:`.frames`, the same on either kind of session.
JSON actions become the env's typed action through the Info RPC's descriptors
(:mod:`openenv_grpc.integrations.json_view`): native envs and bridged OpenEnv envs alike.
A frame that is not JSON, an action that does not fit, or an env error is an error frame,
and the session goes on, as with OpenEnv.

Differences from OpenEnv (docs/from-openenv.md lists them, and
tests/test_openenv_differential.py checks every other answer is OpenEnv's): reset keyword
arguments the env does not take are refused (``VALIDATION_ERROR`` naming them) where
OpenEnv drops them silently (those a ``**kwargs`` takes are passed on); stateless calls
take a slot of the limiter; enums travel by protobuf name.

Bounds (issue 37; docs/reliability.md, "The OpenEnv door under attack"): with
``AUTH_TOKEN`` every route but ``/health`` and every WebSocket wants the token, checked
before a byte of a body is read; a held session's id is a random capability of its own
(not the gRPC session id the server logs), bound to the token that made it; bodies and
messages are capped at the server's request limit, permessage-deflate is off, silent
connections are closed (:mod:`.gateway_limits`); calls on one held session are answered
one at a time; held sessions left idle are closed; a drain closes every WebSocket with
close code 1012 before the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from openenv_grpc.client import EnvError, OpenEnvError
from openenv_grpc.client.info import message_classes
from openenv_grpc.client.protocol import SessionTypes
from openenv_grpc.integrations.json_view import JsonViewError, from_json
from openenv_grpc.integrations.openenv.frames import (
    FrameAnswers,
    error_frame,
    parse_frame,
    rpc_error,
    rpc_request_problem,
    rpc_result,
    state_data,
)
from openenv_grpc.integrations.openenv.gateway_limits import SMALL_BYTES as _SMALL
from openenv_grpc.integrations.openenv.gateway_limits import GatewayLimits
from openenv_grpc.integrations.openenv.published import openenv_metadata, openenv_schemas
from openenv_grpc.integrations.openenv.streams import (
    DoorSessions,
    DoorSocket,
    OpenView,
    ProgramStream,
    Refused,
    RunStream,
    SocketWire,
    StreamEnded,
)
from openenv_grpc.integrations.trl.tools import find_tool_fields
from openenv_grpc.server.process.auth import AUTHORIZATION_KEY, TokenAuthInterceptor
from openenv_grpc.server.process.limiter import SessionLimiter
from openenv_grpc.v1 import session_pb2 as pb

__all__ = ["OpenEnvGateway"]

log = logging.getLogger("openenv_grpc.gateway")


#: gRPC codes an OpenEnv client reads as a bad request rather than a failing env.
_VALIDATION = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}


#: WebSocket close codes (RFC 6455): policy (no token), going away (idle), restart (drain).
_CLOSE_POLICY, _CLOSE_IDLE, _CLOSE_DRAIN = 1008, 1001, 1012

_UNAUTHORIZED = {"detail": "missing or wrong bearer token"}


def _draining() -> JSONResponse:
    """The answer to a request whose body was still arriving when the server drained."""
    return JSONResponse(
        {"detail": "server draining: retry on another server"}, 503,
        headers={"Connection": "close", "Retry-After": "1"},
    )  # fmt: skip


def openenv_mode() -> str:
    """OpenEnv's server mode, from ``OPENENV_MODE`` as its ``create_app`` reads it:
    ``simulation`` (the default) or ``production`` (no ``/reset``, ``/step``, ``/state``).

    Raises:
        ValueError: any other value (OpenEnv refuses it too).
    """
    mode = os.environ.get("OPENENV_MODE", "simulation").strip().lower() or "simulation"
    if mode not in ("simulation", "production"):
        raise ValueError(f"OPENENV_MODE must be simulation or production, got {mode!r}")
    return mode


def short_id(session_id: str) -> str:
    """What logs may show of a session id (a capability): a hash prefix, never the id."""
    return hashlib.sha256(session_id.encode()).hexdigest()[:8]


@dataclasses.dataclass(eq=False)
class _Held:
    """A session made by ``openenv/session/create``: its owner's credentials (a digest of
    the token that made it), a lock answering its calls one at a time, and when it was
    last used (held sessions left idle past ``--idle-timeout`` are closed)."""

    session: Any
    owner: bytes
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    last_used: float = 0.0
    #: Closed (``openenv/session/close``, the idle reaper): sockets attached to it close.
    closed: bool = False


def _owner(token: str | None) -> bytes:
    return hashlib.sha256((token or "").encode()).digest()


class OpenEnvGateway:
    """The FastAPI app speaking OpenEnv's protocol on the session core of this process.

    Args:
        run_stream: Runs a stream of the core (``EnvServicer.run_stream``): every session
            of the door is one (:mod:`.streams`).
        open_view: Makes an admitted session's env (``EnvServicer.open_session_view``).
        info: The server's Info answer (names, descriptors, capacity).
        token: The server's ``AUTH_TOKEN``, if any: every route but ``/health`` and every
            WebSocket want it as a bearer token, checked by the gRPC port's own check.
        limiter: The server's limiter (what a full server's answer reports).
    """

    def __init__(
        self,
        run_stream: RunStream,
        open_view: OpenView,
        info: pb.InfoResponse,
        token: str | None = None,
        limits: GatewayLimits | None = None,
        limiter: SessionLimiter | None = None,
    ) -> None:
        self.info = info
        self.token = token
        self._auth = TokenAuthInterceptor(token) if token else None
        self.limits = limits or GatewayLimits()
        self._limiter = limiter
        classes = message_classes(info)
        self._action = classes["action"]
        roles = (classes["action"], classes["observation"], classes["state"],
                 classes.get("reset_options"))  # fmt: skip
        lane = _native_lane(info.env_name)
        self._sessions = DoorSessions(
            run_stream, open_view, SessionTypes(*roles), native=lane is not None,
            max_response=self.limits.response_bytes,
        )  # fmt: skip
        #: Sessions made by ``openenv/session/create`` over HTTP /mcp, by a random id of
        #: their own: MCP calls and a WebSocket opened with ``?session_id=`` share them
        #: until ``openenv/session/close`` or the idle timeout (MCPToolClient's
        #: production mode).
        self._held: dict[str, _Held] = {}
        #: Open WebSockets: a drain closes each with a close frame.
        self._sockets: set[WebSocket] = set()
        #: Closes of sockets whose sessions the core ended, and of held sessions closed by
        #: ``openenv/session/close`` (referenced until done).
        self._closers: set[asyncio.Future[None]] = set()
        #: Requests whose bodies are arriving: a drain stops each with a 503 at once
        #: rather than leaving uvicorn to cancel it at its shutdown timeout.
        self._reading: set[asyncio.Task[Any]] = set()
        #: Those a drain stopped (their cancellation is the door's, not their caller's).
        self._stopped: set[asyncio.Task[Any]] = set()
        self.draining = False
        tool_fields = find_tool_fields(
            classes["action"].DESCRIPTOR, classes["observation"].DESCRIPTOR
        )
        #: What every frame and tool call is answered with, on any session.
        self.answers = FrameAnswers(self._action, roles[3], tool_fields, self._mcp, lane)
        # No /docs, /redoc, /openapi.json: they answered without a token (issue 37).
        self.app = FastAPI(
            title=f"{info.env_name} (openenv-grpc)",
            version=info.env_version,
            docs_url=None,
            redoc_url=None,
            openapi_url=None,
        )
        self._routes()

    async def asgi(self, scope: Any, receive: Any, send: Any) -> None:
        """The door's ASGI app: ``WS /ws`` and ``WS /mcp`` straight to their sessions
        (every message would otherwise pass FastAPI's middleware both ways), the rest
        to :attr:`app`."""
        if scope["type"] == "websocket" and scope["path"] in ("/ws", "/mcp"):
            # Served here, not in a coroutine of its own: each frame in a socket task's
            # chain of awaits is resumed at every message.
            websocket = DoorSocket(scope, receive, send)
            try:
                await websocket.accept()
                self._sockets.add(websocket)
                try:
                    if scope["path"] == "/mcp":
                        await self._serve_jsonrpc(websocket)
                    else:
                        await self._serve_accepted(websocket)
                finally:
                    self._sockets.discard(websocket)
            except Exception:  # a bug here ends its socket, never the door
                log.exception("the OpenEnv door failed serving a WebSocket")
                await _close(websocket, 1011)
            return
        await self.app(scope, receive, send)

    # -- HTTP ---------------------------------------------------------------------------

    def _authorized(self, header: str | None) -> bool:
        """Whether ``header`` carries the token: the gRPC port's own check."""
        if self._auth is None:
            return True
        given = _bearer(header)
        return given is not None and self._auth.allows(((AUTHORIZATION_KEY, f"Bearer {given}"),))

    def _routes(self) -> None:
        app = self.app

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "healthy"}

        @app.get("/metadata")
        async def metadata(request: Request) -> Any:
            if not self._authorized(request.headers.get("authorization")):
                return JSONResponse(_UNAUTHORIZED, 401)
            bridged = await openenv_metadata(self.info.env_name)
            if bridged is not None:  # the env's own get_metadata(), as OpenEnv's
                return bridged
            return {
                "name": self.info.env_name,
                "description": f"{self.info.env_name}, served by openenv-grpc",
                "version": self.info.env_version or None,
                "readme_content": None,
                "author": None,
                "documentation_url": None,
            }

        @app.get("/schema")
        async def schema(request: Request) -> Any:
            if not self._authorized(request.headers.get("authorization")):
                return JSONResponse(_UNAUTHORIZED, 401)
            bridged = openenv_schemas(self.info.env_name)
            if bridged is not None:  # the env's own pydantic models, as OpenEnv's
                return bridged
            classes = message_classes(self.info)
            return {
                "action": _json_schema(classes["action"].DESCRIPTOR),
                "observation": _json_schema(classes["observation"].DESCRIPTOR),
                "reset_observation": _json_schema(classes["observation"].DESCRIPTOR),
                "state": _json_schema(classes["state"].DESCRIPTOR),
            }

        if openenv_mode() == "simulation":  # production mode has no simulation routes
            self._simulation_routes()

        @app.post("/mcp")
        async def mcp(request: Request) -> Any:
            if not self._authorized(request.headers.get("authorization")):
                return JSONResponse(_UNAUTHORIZED, 401)  # before a byte of the body
            body = await self._body(request)
            if isinstance(body, JSONResponse):
                return body
            try:
                call = json.loads(body)
            except (ValueError, RecursionError):  # not JSON, 5,000 digits, too deep
                return rpc_error(None, -32700, "Parse error")
            if not isinstance(call, dict):  # OpenEnv: JsonRpcRequest(**call) fails to parse
                return rpc_error(None, -32700, "Parse error")
            problem = rpc_request_problem(call)
            if problem:
                return rpc_error(None, -32600, f"Invalid request: {problem}")
            return await self._mcp(call, _bearer(request.headers.get("authorization")))

    def _simulation_routes(self) -> None:
        app = self.app

        @app.post("/reset")
        async def reset(request: Request) -> Any:
            return await self._stateless(request, "reset")

        @app.post("/step")
        async def step(request: Request) -> Any:
            return await self._stateless(request, "step")

        @app.get("/state")
        async def state(request: Request) -> Any:
            return await self._stateless(request, "state")

    async def _stateless(self, request: Request, route: str) -> Any:
        """OpenEnv's simulation routes ``POST /reset``, ``POST /step``, ``GET /state``:
        each call its own env, as OpenEnv serves them (here a gRPC session opened for the
        call and closed after it; ``/step`` and ``/state`` reset it first, a session
        steps only after a reset). Auth first, then the body, capped like ``/mcp``'s."""
        header = request.headers.get("authorization")
        if not self._authorized(header):
            return JSONResponse(_UNAUTHORIZED, 401)  # before a byte of the body
        payload: Any = {}
        if route != "state":
            body = await self._body(request)
            if isinstance(body, JSONResponse):
                return body
            try:
                payload = json.loads(body) if body.strip() else {}
            except (ValueError, RecursionError) as exc:
                return _unprocessable(f"JSON decode error: {str(exc)[:200]}", "body")
            if not isinstance(payload, dict):
                return _unprocessable("Input should be a valid dictionary", "body")
            if route == "step" and not isinstance(payload.get("action"), dict):
                return _unprocessable("Field required: a dictionary", "body", "action")
        try:
            async with self._one_call_session(_bearer(header)) as session:
                if route == "reset":
                    result = await session.run(self.answers.reset(payload))
                    return self._http_observation(result)
                if route == "state":  # a fresh env's state, as OpenEnv's (no reset)
                    return state_data(session, await session.run(self.answers.fresh_state()))
                action = from_json(payload["action"], self._action, "action")
                return self._http_observation(await session.run(self.answers.stepped(action)))
        except _NoRoom as exc:
            return JSONResponse({"detail": exc.message}, 503)
        except StreamEnded as exc:
            return JSONResponse({"detail": f"{exc.code.name}: {exc.details}"}, 500)
        except (JsonViewError, TypeError, ValueError, RecursionError) as exc:
            return _unprocessable(str(exc)[:2000], "body", "action" if route == "step" else "")
        except EnvError as exc:
            if exc.code in _VALIDATION:
                return _unprocessable(exc.message, "body")
            return JSONResponse({"detail": exc.message}, 500)
        except OpenEnvError as exc:
            return JSONResponse({"detail": f"{exc.code.name}: {exc.message}"}, 500)

    def _http_observation(self, result: Any) -> dict[str, Any]:
        """A step result as OpenEnv's ``ResetResponse`` / ``StepResponse`` (``metadata``
        always there, null when none)."""
        data = self.answers.observation_data(result)
        data.setdefault("metadata", None)
        return data

    async def _body(self, request: Request) -> bytes | JSONResponse:
        """The request's body, or the HTTP error ending it: 413 past the request limit
        (by its Content-Length before reading, else as it arrives), 408 if it does not
        arrive within the arrival timeout."""
        limit = self.limits.request_bytes
        too_large = JSONResponse({"detail": f"body larger than the limit of {limit} bytes "
                                  "(--max-request-bytes)"}, 413)  # fmt: skip
        declared = request.headers.get("content-length", "")
        if declared.strip().isdigit() and int(declared) > limit:
            return too_large
        body = bytearray()
        budget = self.limits.budget
        held = 0  # what of the body the byte budget counts while it arrives

        async def read() -> bool | None:
            nonlocal held
            async for chunk in request.stream():
                if budget is not None:
                    size = len(chunk)
                    # Small bodies may use the reserve, as small WebSocket frames do.
                    if not (
                        budget.try_take(size) or (size <= _SMALL and budget.try_overdraw(size))
                    ):
                        return None
                    held += size
                body.extend(chunk)
                if len(body) > limit:
                    return False
            return True

        task = asyncio.current_task()
        assert task is not None
        if self.draining:
            return _draining()
        self._reading.add(task)
        try:
            complete = await asyncio.wait_for(read(), self.limits.arrival_timeout)
        except asyncio.TimeoutError:
            return JSONResponse({"detail": "the body did not arrive within "
                                 f"{self.limits.arrival_timeout:g}s"}, 408)  # fmt: skip
        except ClientDisconnect:
            return JSONResponse({"detail": "the client went"}, 400)
        except asyncio.CancelledError:
            if task not in self._stopped:
                raise
            uncancel = getattr(task, "uncancel", None)  # Python 3.11+ counts cancellations
            if uncancel is not None:
                uncancel()  # the drain's cancellation, answered here
            return _draining()
        finally:
            self._reading.discard(task)
            self._stopped.discard(task)
            if budget is not None:
                budget.give(held)
        if complete is None:
            assert budget is not None
            return JSONResponse(
                {"detail": f"server busy: it holds {budget.used} of its {budget.total} bytes "
                 "for clients (--max-held-bytes); retry later"}, 503,
                headers={"Retry-After": "1"},
            )  # fmt: skip
        if not complete:
            return too_large
        return bytes(body)

    def _find(self, session_id: Any, token: str | None) -> _Held | None:
        """The held session ``session_id`` if ``token`` made it; None as for an unknown
        id otherwise (no answer tells an outsider whether an id exists)."""
        held = self._held.get(str(session_id or ""))
        if held is None or not hmac.compare_digest(held.owner, _owner(token)):
            return None
        return held

    async def _let_go(self, session_id: str, held: _Held) -> None:
        """Forget and close a held session (exactly once: whoever pops it closes it)."""
        if self._held.get(session_id) is held:
            del self._held[session_id]
            held.closed = True
            await held.session.close()

    def _close_later(self, session_id: str, held: _Held) -> None:
        """Forget a held session now and close it once the calls in flight on it are done,
        in a task of its own: whoever asked never waits on that session. (A socket waiting
        there while holding its own session's lock could wait for ever: two sessions
        attached to sockets that each closed the other held every slot they ever had.)"""
        if self._held.get(session_id) is not held:
            return
        del self._held[session_id]
        held.closed = True
        closing = asyncio.ensure_future(held.session.close())
        self._closers.add(closing)
        closing.add_done_callback(self._closers.discard)

    async def reap_idle(self) -> None:
        """Close held sessions left idle past the idle timeout, forever (the server has
        ended their gRPC streams by then: only the handle would be left)."""
        idle = self.limits.idle_timeout
        if idle <= 0:
            return
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(max(idle / 4, 0.05), 5.0))
            now = loop.time()
            for session_id, held in list(self._held.items()):
                if not held.lock.locked() and now - held.last_used > idle:
                    log.info("held OpenEnv session %s idle: closed", short_id(session_id))
                    await self._let_go(session_id, held)

    def start_draining(self) -> None:
        """The server drains: sockets that end from now on close with 1012 (restart), and
        bodies still arriving are answered 503 now."""
        self.draining = True
        for task in self._reading:
            self._stopped.add(task)
            task.cancel()

    async def close_sockets(self) -> None:
        """Close every WebSocket still open with 1012 (the core ends their sessions)."""
        await asyncio.gather(*(_close(ws, _CLOSE_DRAIN, "server draining") for ws in self._sockets))

    # -- the WebSocket session ------------------------------------------------------------

    async def _serve_jsonrpc(self, websocket: WebSocket) -> None:
        """OpenEnv's ``WS /mcp``: plain JSON-RPC 2.0 messages on a session of the socket's
        own (the same auth, limiter, message cap and idle timeout as ``/ws``)."""
        header = websocket.headers.get("authorization")
        if not self._authorized(header):
            refused = rpc_error(None, -32000, "UNAUTHENTICATED: missing or wrong bearer token")
            await _send(websocket, json.dumps(refused))
            await _close(websocket, _CLOSE_POLICY)
            return
        token = _bearer(header)
        own_id = secrets.token_urlsafe(24)
        try:
            async with self._one_call_session(token, websocket) as session:
                while True:
                    raw = await self._receive(websocket)
                    answer = await self._jsonrpc_message(session, raw, own_id, token)
                    await websocket.send_text(json.dumps(answer))
        except _NoRoom as exc:
            await _send(websocket, json.dumps(rpc_error(None, -32000, exc.message, exc.data)))
        except WebSocketDisconnect:
            pass  # the client went: the session closes with the block above
        except StreamEnded as exc:
            lost = rpc_error(None, -32000, f"{exc.code.name}: {exc.details}")
            await _send(websocket, json.dumps(lost))
        finally:
            await _close(websocket, *self._closing())

    async def _jsonrpc_message(
        self, session: Any, raw: str | None, own_id: str, token: str | None
    ) -> dict[str, Any]:
        """The JSON-RPC answer to one ``WS /mcp`` message; never raises for what the
        client sent. Raises StreamEnded if the session's stream ended."""
        if raw is None:
            return rpc_error(None, -32700, "Parse error: a binary frame; send JSON text")
        try:
            call = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            return rpc_error(None, -32700, f"Parse error: {str(exc)[:200]}")
        if not isinstance(call, dict):
            return rpc_error(None, -32600, "Invalid request: expected a JSON object")
        problem = rpc_request_problem(call)
        if problem:
            return rpc_error(None, -32600, f"Invalid request: {problem}")
        try:
            answer: dict[str, Any] = await session.run(
                self.answers.mcp_on(session, call, own_id, token)
            )
            return answer
        except StreamEnded:
            raise
        except Exception as exc:  # a bug here must not end the client's session
            log.exception("the OpenEnv gateway failed to answer a WS /mcp message")
            return rpc_error(call.get("id"), -32603, f"{type(exc).__name__}: {exc}")

    async def _serve_accepted(self, websocket: DoorSocket) -> None:
        token = _bearer(websocket.headers.get("authorization"))
        if not self._authorized(websocket.headers.get("authorization")):
            await _send(websocket, error_frame("SESSION_ERROR", "UNAUTHENTICATED: missing or wrong "
                                          "bearer token"))  # fmt: skip
            await _close(websocket, _CLOSE_POLICY)
            return
        attach = websocket.query_params.get("session_id")
        if attach:  # MCPToolClient: the session its HTTP /mcp call made
            held = self._find(attach, token)
            if held is None:
                await _send(
                    websocket, error_frame("SESSION_ERROR", f"Unknown session_id: {attach}")
                )
                await _close(websocket)
                return
            try:
                await self._loop(websocket, held.session, attach, token, held)
            except WebSocketDisconnect:
                pass  # the session stays until openenv/session/close
            except StreamEnded as exc:  # under a frame the client waits on: it is told
                await _send(
                    websocket, error_frame("SESSION_ERROR", f"{exc.code.name}: {exc.details}")
                )
                await self._let_go(attach, held)
            finally:
                await _close(websocket, *self._closing())
            return
        # The id an mcp frame's openenv/session/create answers: the socket's own.
        wire = SocketWire(websocket, self.answers, secrets.token_urlsafe(24), token)
        try:
            await self._sessions.run(wire)
        except grpc.aio.AbortError:
            await self._ended(websocket, wire)
            return
        await _close(websocket, *self._closing())

    async def _ended(self, websocket: WebSocket, wire: SocketWire) -> None:
        """Tell a socket how the core ended its stream, and close it: a full server's
        ``CAPACITY_REACHED``, a refusal's or a lost session's error frame (to a client
        waiting for an answer), an idle session's close 1001."""
        assert wire.status is not None
        code, details = wire.status
        if not wire.admitted and code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            message, counts = self._full()
            await _send(
                websocket, error_frame("CAPACITY_REACHED", f"{message} ({details})", **counts)
            )
            await _close(websocket)
            return
        if wire.admitted and code is grpc.StatusCode.DEADLINE_EXCEEDED and not wire.in_flight:
            await _close(websocket, _CLOSE_IDLE, "idle timeout")
            return
        if not wire.admitted or wire.in_flight:
            await _send(websocket, error_frame("SESSION_ERROR", f"{code.name}: {details}"))
        await _close(websocket, *self._closing())

    def _socket_ending(self, websocket: WebSocket) -> Callable[[grpc.StatusCode, str], None]:
        """What a socket on a stream of its own does when the core ends that stream as
        idle: it closes 1001 (one idle policy: the core's, no timer per message)."""

        def ended(code: grpc.StatusCode, _details: str) -> None:
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                closing = asyncio.ensure_future(_close(websocket, _CLOSE_IDLE, "idle timeout"))
                self._closers.add(closing)
                closing.add_done_callback(self._closers.discard)

        return ended

    def _closing(self) -> tuple[int, str]:
        return (_CLOSE_DRAIN, "server draining") if self.draining else (1000, "")

    async def _receive(self, websocket: WebSocket, timed: bool = False) -> str | None:
        """The next text message; None for a binary one. Raises WebSocketDisconnect when
        the client goes. A socket on a session of its own is closed when the core ends
        that session (:meth:`_socket_ending`: idle); one attached to a held session
        (``timed``) is closed here if it stays silent past the idle timeout (1001)."""
        idle = self.limits.idle_timeout
        try:
            if timed and idle > 0:
                event = await asyncio.wait_for(websocket.receive(), idle)
            else:
                event = await websocket.receive()
        except asyncio.TimeoutError:
            await _close(websocket, _CLOSE_IDLE, "idle timeout")
            raise WebSocketDisconnect(_CLOSE_IDLE) from None
        if event["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(event.get("code", 1000))
        text = event.get("text")
        return text if isinstance(text, str) else None

    async def _loop(
        self,
        websocket: WebSocket,
        session: Any,
        own_id: str,
        token: str | None,
        held: _Held | None = None,
    ) -> None:
        while True:
            answer = await self._frame_answer(websocket, session, own_id, token, held)
            if answer is None:
                return
            await websocket.send_text(answer)
            del answer  # not kept while the next request is awaited (it may be large)

    async def _frame_answer(
        self, websocket: WebSocket, session: Any, own_id: str, token: str | None, held: _Held | None
    ) -> str | None:
        """The frame answering the socket's next message (None: it asked to close)."""
        raw = await self._receive(websocket, timed=held is not None)
        if held is not None and held.closed:  # closed meanwhile: so is the socket
            return None
        frame, size = parse_frame(raw), len(raw or "")
        del raw
        if isinstance(frame, str):
            return frame
        kind, data = frame
        if kind == "close":
            return None
        program = self.answers.frame(session, kind, data, own_id, token, size)
        if held is None:
            answer: str = await session.run(program)
            return answer
        async with held.lock:  # one call at a time on a session /mcp shares
            try:
                answer = await session.run(program)
                return answer
            finally:
                held.last_used = asyncio.get_running_loop().time()

    async def _mcp(self, call: dict[str, Any], token: str | None) -> dict[str, Any]:
        """One JSON-RPC call of OpenEnv's HTTP /mcp (session create/close, tools)."""
        method, ident = call["method"], call.get("id")
        params = call.get("params") or {}
        if not isinstance(params, dict):
            return rpc_error(ident, -32602, "Params must be an object")
        if method == "openenv/session/create":
            try:
                session = await self._open()
            except _NoRoom as exc:
                return rpc_error(ident, -32000, exc.message, exc.data)
            # A random capability of its own, not the gRPC session id the server logs.
            session_id = secrets.token_urlsafe(24)
            loop = asyncio.get_running_loop()
            self._held[session_id] = _Held(session, _owner(token), last_used=loop.time())
            return rpc_result(ident, {"session_id": session_id})
        requested = params.get("session_id")
        session_id = str(requested or "")
        held = self._find(session_id, token)
        if method == "openenv/session/close":
            if not requested:
                return rpc_error(ident, -32602, "Invalid params - 'session_id' is required")
            if held is None:
                return rpc_error(ident, -32602, f"Unknown session_id: {session_id[:64]}")
            self._close_later(session_id, held)  # after the calls in flight on it
            return rpc_result(ident, {"session_id": session_id, "closed": True})
        if method not in ("tools/list", "tools/call"):
            return rpc_error(ident, -32601, f"Method not found: {str(method)[:200]}")
        if not requested:  # OpenEnv's throwaway env: here a session of its own, one call
            return await self._throwaway_call(ident, method, params, token)
        if held is None:
            return rpc_error(ident, -32602, f"Unknown session_id: {session_id[:64]}")
        async with held.lock:  # one call at a time: each answer to its own request
            try:
                program = self.answers.tool_method(held.session, ident, method, params)
                answer: dict[str, Any] = await held.session.run(program)
                return answer
            except StreamEnded as exc:
                await self._let_go(session_id, held)
                return rpc_error(ident, -32603, f"{exc.code.name}: {exc.details}")
            finally:
                held.last_used = asyncio.get_running_loop().time()

    async def _throwaway_call(
        self, ident: Any, method: str, params: dict[str, Any], token: str | None
    ) -> dict[str, Any]:
        """A sessionless ``tools/list`` or ``tools/call``: a session opened for the call
        alone (it takes a slot of the one limiter while it lasts) and closed after it."""
        try:
            async with self._one_call_session(token) as session:
                program = self.answers.tool_method(session, ident, method, params)
                answer: dict[str, Any] = await session.run(program)
                return answer
        except _NoRoom as exc:
            return rpc_error(ident, -32000, exc.message, exc.data)
        except StreamEnded as exc:
            return rpc_error(ident, -32603, f"{exc.code.name}: {exc.details}")

    @contextlib.asynccontextmanager
    async def _one_call_session(
        self, token: str | None, websocket: WebSocket | None = None
    ) -> AsyncIterator[ProgramStream]:
        """A session of the core for one stateless call (HTTP ``/reset``, ``/step``,
        ``/state``, sessionless ``/mcp``) or one ``WS /mcp`` socket, closed when it ends.
        Raises _NoRoom when the server is full or refuses the token."""
        session = await self._open(websocket)
        try:
            yield session
        finally:
            await session.close()

    async def _open(self, websocket: WebSocket | None = None) -> ProgramStream:
        """A session of the core that takes programs (a socket's: closed 1001 when the
        core ends it as idle). Raises _NoRoom when the server is full or refuses it."""
        ending = None if websocket is None else self._socket_ending(websocket)
        session = ProgramStream(self._sessions, ending)
        try:
            await session.open()
        except Refused as exc:
            if exc.code is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise _NoRoom(str(exc)) from None
            raise _NoRoom(*self._full()) from None
        return session

    def _full(self) -> tuple[str, dict[str, int]]:
        """OpenEnv's words for a full server, and the counts its answers carry."""
        limiter = self._limiter
        if limiter is None:
            active, limit = self.info.capacity.active_sessions, self.info.capacity.max_sessions
        else:
            active, limit = limiter.active, limiter.capacity
        message = (f"Server at capacity: {active}/{limit} sessions active. Cannot accept new "
                   "connections.")  # fmt: skip
        return message, {"active_sessions": active, "max_sessions": limit}


def _native_lane(env_name: str) -> Any:
    """The native lane of the bridged env ``env_name`` (None: a native env, or no openenv)."""
    try:
        from openenv_grpc.integrations.openenv.native import native_lane
    except ImportError:
        return None
    return native_lane(env_name)


class _NoRoom(Exception):
    """No session for a stateless call: the server is full, or refused the token."""

    def __init__(self, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.message, self.data = message, data


def _unprocessable(message: str, *where: str) -> JSONResponse:
    """FastAPI's 422 answer, as OpenEnv's routes give it for a body that does not fit."""
    loc = [part for part in where if part]
    return JSONResponse({"detail": [{"type": "value_error", "loc": loc, "msg": message}]}, 422)


def _json_schema(descriptor: Any) -> dict[str, Any]:
    """A JSON Schema of a message, read off its descriptor (what ``/schema`` shows)."""
    properties: dict[str, Any] = {}
    for field in descriptor.fields:
        properties[field.name] = _field_schema(field)
    return {"title": descriptor.name, "type": "object", "properties": properties}


def _field_schema(field: Any) -> dict[str, Any]:
    from openenv_grpc.integrations.json_view import is_json_field

    if is_json_field(field):
        item: dict[str, Any] = {}
    elif field.message_type is not None:
        item = _json_schema(field.message_type)
    elif field.enum_type is not None:
        item = {"type": "string", "enum": [v.name for v in field.enum_type.values]}
    else:
        item = {"type": _SCHEMA_TYPES.get(field.cpp_type, "string")}
    return {"type": "array", "items": item} if field.is_repeated else item


_SCHEMA_TYPES = {
    1: "integer", 2: "integer", 3: "integer", 4: "integer",  # int32/int64/uint32/uint64
    5: "number", 6: "number", 7: "boolean", 9: "string",  # double/float/bool/string
}  # fmt: skip


def _bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


async def _send(websocket: WebSocket, text: str) -> None:
    with contextlib.suppress(Exception):  # the client may be gone already
        await websocket.send_text(text)


async def _close(websocket: WebSocket, code: int = 1000, reason: str = "") -> None:
    with contextlib.suppress(Exception):
        await websocket.close(code, reason)
