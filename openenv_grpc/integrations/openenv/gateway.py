"""OpenEnv's client protocol served beside gRPC: ``serve ... --openenv-port PORT``.

OpenEnv's own clients (``GenericEnvClient``, an ``EnvClient`` subclass, sync or async)
connect to ``ws://HOST:PORT/ws`` and send JSON frames ``{"type": "reset" | "step" |
"state" | "close", "data": ...}``; they get ``{"type": "observation", "data":
{"observation", "reward", "done"[, "metadata"]}}``, ``{"type": "state", ...}`` or
``{"type": "error", "data": {"message", "code"}}`` back, as from OpenEnv 0.10's
``create_app`` server. The HTTP side serves ``/health``, ``/metadata`` and ``/schema``.

Each WebSocket is one real gRPC ``Session`` on the local server, opened over loopback
when the socket connects and closed when it goes: the capacity limiter, the auth token
(the client's ``Authorization: Bearer`` header is passed on), idle timeouts, drain and
metrics are exactly the gRPC ones, and a full server answers with OpenEnv's own
``CAPACITY_REACHED`` frame. JSON actions become the env's typed action through the Info
RPC's descriptors (:mod:`openenv_grpc.integrations.json_view`): native envs and bridged
OpenEnv envs alike. A frame that is not JSON, an action that does not fit, or an env
error is an error frame, and the session goes on, as with OpenEnv.

Differences from OpenEnv (documented in docs/from-openenv.md's list): reset keyword
arguments the env does not take are refused (``VALIDATION_ERROR`` naming them), where
OpenEnv drops them silently; enums are sent and read by their protobuf names.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import socket
import sys
import threading
import types
import uuid
from collections.abc import Callable
from typing import Any

import grpc
import uvicorn
from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse
from google.protobuf import json_format

from openenv_grpc.client import AsyncSession, CapacityError, EnvError, OpenEnvError, SessionLost
from openenv_grpc.client.channel import aio_channel
from openenv_grpc.client.errors import SessionRefused
from openenv_grpc.client.info import message_classes
from openenv_grpc.codec import value_to_python
from openenv_grpc.integrations.json_view import JsonViewError, from_json, to_json
from openenv_grpc.integrations.trl.tools import find_tool_fields
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc

__all__ = ["OpenEnvGateway", "free_port", "start_gateway"]

log = logging.getLogger("openenv_grpc.gateway")

#: The line the serve process prints once the OpenEnv protocol listens (tests wait for it).
GATEWAY_LINE = "openenv-grpc: OpenEnv protocol on http://{host}:{port} (ws://{host}:{port}/ws)"

#: Reset keywords that are the session's own, not the env's reset options.
_SESSION_KEYS = ("seed", "episode_id")

#: gRPC codes an OpenEnv client reads as a bad request rather than a failing env.
_VALIDATION = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}


def _error(code: str, message: str, **extra: Any) -> str:
    return json.dumps({"type": "error", "data": {"message": message, "code": code, **extra}})


class OpenEnvGateway:
    """The FastAPI app speaking OpenEnv's protocol for the gRPC server at ``target``.

    Args:
        target: The local gRPC server, ``host:port`` (plaintext loopback).
        info: Its Info answer (names, descriptors, capacity).
        token: The server's ``AUTH_TOKEN``, if any: HTTP endpoints but ``/health`` want
            it as a bearer token, and WebSockets pass the client's on to gRPC.
    """

    def __init__(self, target: str, info: pb.InfoResponse, token: str | None = None) -> None:
        self.target = target
        self.info = info
        self.token = token
        classes = message_classes(info)
        self._action = classes["action"]
        self._reset_options = classes.get("reset_options")
        roles = (classes["action"], classes["observation"], classes["state"], self._reset_options)
        self._session_class: Any = types.new_class(
            "GatewaySession",
            (AsyncSession[roles],),  # type: ignore[valid-type,misc]
        )
        self._channel: grpc.aio.Channel | None = None
        #: Sessions made by ``openenv/session/create`` over HTTP /mcp, by id: MCP calls
        #: and a WebSocket opened with ``?session_id=`` share them until
        #: ``openenv/session/close`` (MCPToolClient's production mode).
        self._held: dict[str, Any] = {}
        self._tool_fields = find_tool_fields(
            classes["action"].DESCRIPTOR, classes["observation"].DESCRIPTOR
        )
        self.app = FastAPI(title=f"{info.env_name} (openenv-grpc)", version=info.env_version)
        self._routes()

    @property
    def channel(self) -> grpc.aio.Channel:
        if self._channel is None:  # made on the loop that serves the app
            self._channel = aio_channel(self.target)
        return self._channel

    # -- HTTP ---------------------------------------------------------------------------

    def _authorized(self, header: str | None) -> bool:
        if not self.token:
            return True
        given = _bearer(header) or ""
        return hmac.compare_digest(given.encode(), self.token.encode())

    def _routes(self) -> None:
        app = self.app

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "healthy"}

        @app.get("/metadata")
        async def metadata(request: Request) -> Any:
            if not self._authorized(request.headers.get("authorization")):
                return JSONResponse({"detail": "missing or wrong bearer token"}, 401)
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
                return JSONResponse({"detail": "missing or wrong bearer token"}, 401)
            classes = message_classes(self.info)
            return {
                "action": _json_schema(classes["action"].DESCRIPTOR),
                "observation": _json_schema(classes["observation"].DESCRIPTOR),
                "reset_observation": _json_schema(classes["observation"].DESCRIPTOR),
                "state": _json_schema(classes["state"].DESCRIPTOR),
            }

        @app.post("/mcp")
        async def mcp(request: Request) -> Any:
            try:
                call = json.loads(await request.body())
            except json.JSONDecodeError:
                return _rpc_error(None, -32700, "Parse error")
            if not isinstance(call, dict) or not isinstance(call.get("method"), str):
                return _rpc_error(None, -32600, "Invalid request")
            return await self._mcp(call, _bearer(request.headers.get("authorization")))

        @app.websocket("/ws")
        async def ws(websocket: WebSocket) -> None:
            await self._serve_socket(websocket)

    # -- the WebSocket session ------------------------------------------------------------

    async def _serve_socket(self, websocket: WebSocket) -> None:
        await websocket.accept()
        attach = websocket.query_params.get("session_id")
        if attach:  # MCPToolClient: the session its HTTP /mcp call made
            held = self._held.get(attach)
            if held is None:
                await _send(websocket, _error("SESSION_ERROR", f"Unknown session_id: {attach}"))
                await _close(websocket)
                return
            try:
                await self._loop(websocket, held)
            except (WebSocketDisconnect, SessionLost):
                pass  # the session stays until openenv/session/close
            finally:
                await _close(websocket)
            return
        token = _bearer(websocket.headers.get("authorization"))
        session = self._session_class(self.channel, token=token)
        try:
            await session.open()
        except CapacityError as exc:
            active, limit = await self._capacity()
            await _send(
                websocket,
                _error(
                    "CAPACITY_REACHED",
                    f"Server at capacity: {active}/{limit} sessions active. Cannot accept "
                    f"new connections. ({exc.message})",
                    active_sessions=active,
                    max_sessions=limit,
                ),
            )
            await _close(websocket)
            return
        except SessionRefused as exc:
            await _send(websocket, _error("SESSION_ERROR", f"{exc.code.name}: {exc.message}"))
            await _close(websocket)
            return
        try:
            await self._loop(websocket, session)
        except WebSocketDisconnect:
            pass  # the client went: the session closes below
        except SessionLost as exc:
            await _send(websocket, _error("SESSION_ERROR", f"{exc.code.name}: {exc.message}"))
        finally:
            with contextlib.suppress(Exception):
                await session.close()
            if session.is_open:
                await session.abort()
            await _close(websocket)

    async def _loop(self, websocket: WebSocket, session: Any) -> None:
        while True:
            raw = await websocket.receive_text()
            try:
                message = json.loads(raw)
            except json.JSONDecodeError as exc:
                await websocket.send_text(_error("INVALID_JSON", f"Invalid JSON: {exc}"))
                continue
            kind = message.get("type", "") if isinstance(message, dict) else ""
            if kind == "close":
                return
            await websocket.send_text(await self._answer(session, kind, message.get("data")))

    async def _answer(self, session: Any, kind: str, data: Any) -> str:
        """The frame answering one request; never raises for what the client sent."""
        try:
            if kind == "reset":
                return self._observation(await self._reset(session, data or {}))
            if kind == "step":
                action = from_json(data if data is not None else {}, self._action, "action")
                return self._observation(await session.step(action))
            if kind == "state":
                state = to_json(await session.state())
                state.setdefault("episode_id", session.episode_id or None)
                state.setdefault("step_count", session.step_count)
                return json.dumps({"type": "state", "data": state})
            return _error("UNKNOWN_TYPE", f"Unknown message type: {kind}")
        except (JsonViewError, TypeError, ValueError) as exc:
            return _error("VALIDATION_ERROR", str(exc), errors=[{"msg": str(exc)}])
        except EnvError as exc:
            code = "VALIDATION_ERROR" if exc.code in _VALIDATION else "EXECUTION_ERROR"
            return _error(code, exc.message)
        except SessionLost:
            raise
        except OpenEnvError as exc:
            return _error("EXECUTION_ERROR", f"{exc.code.name}: {exc.message}")
        except Exception as exc:  # a bug here must not end the client's session
            log.exception("the OpenEnv gateway failed to answer a %s frame", kind)
            return _error("EXECUTION_ERROR", f"{type(exc).__name__}: {exc}")

    def _observation(self, result: Any) -> str:
        """OpenEnv's observation frame; a tools-protocol env's tool list as OpenEnv's
        ``ListToolsObservation`` has it (a list of tools), so MCP clients read it."""
        frame = _observation(result)
        fields = self._tool_fields
        if fields is None:
            return frame
        parsed = json.loads(frame)
        observation = parsed["data"]["observation"]
        listed = observation.pop(fields.tools, None)
        if listed and listed.get("tools"):
            observation["tools"] = listed["tools"]
        return json.dumps(parsed)

    async def _reset(self, session: Any, data: Any) -> Any:
        if not isinstance(data, dict):
            raise JsonViewError("reset", f"expected an object of keyword arguments, got {data!r}")
        seed, episode_id = data.get("seed"), data.get("episode_id")
        rest = {k: v for k, v in data.items() if k not in _SESSION_KEYS}
        options = None
        if rest:
            if self._reset_options is None:
                raise JsonViewError("reset", f"this env takes no reset options: {sorted(rest)}")
            options = from_json(rest, self._reset_options, "reset")
        return await session.reset(seed=seed, episode_id=episode_id, options=options)

    async def _mcp(self, call: dict[str, Any], token: str | None) -> dict[str, Any]:
        """One JSON-RPC call of OpenEnv's HTTP /mcp (session create/close, tools)."""
        method, ident = call["method"], call.get("id")
        params = call.get("params") or {}
        if not isinstance(params, dict):
            return _rpc_error(ident, -32602, "Params must be an object")
        if method == "openenv/session/create":
            session = self._session_class(self.channel, token=token)
            try:
                await session.open()
            except CapacityError:
                active, limit = await self._capacity()
                return _rpc_error(
                    ident, -32000,
                    f"Server at capacity: {active}/{limit} sessions active. Cannot accept "
                    "new connections.",
                    {"active_sessions": active, "max_sessions": limit},
                )  # fmt: skip
            except SessionRefused as exc:
                return _rpc_error(ident, -32000, f"{exc.code.name}: {exc.message}")
            self._held[session.session_id] = session
            return _rpc_result(ident, {"session_id": session.session_id})
        held = self._held.get(str(params.get("session_id", "")))
        if method == "openenv/session/close":
            if held is None:
                return _rpc_error(ident, -32602, f"Unknown session_id: {params.get('session_id')}")
            del self._held[held.session_id]
            with contextlib.suppress(Exception):
                await held.close()
            if held.is_open:
                await held.abort()
            return _rpc_result(ident, {"session_id": held.session_id, "closed": True})
        if method not in ("tools/list", "tools/call"):
            return _rpc_error(ident, -32601, f"Method not found: {method}")
        if held is None:  # OpenEnv would make a throwaway env; a session needs a slot
            return _rpc_error(ident, -32602, "tools/list and tools/call need a session_id "
                              "(from openenv/session/create)")  # fmt: skip
        try:
            if not held.episode_id:  # OpenEnv calls tools before any reset; we need one
                await held.reset()
            if method == "tools/list":
                return _rpc_result(ident, {"tools": await self._list_tools(held)})
            name = params.get("name")
            if not isinstance(name, str) or not name:
                return _rpc_error(ident, -32602, "Missing 'name' in params")
            return _rpc_result(ident, await self._call_tool(held, name, params.get("arguments")))
        except _ToolFailed as exc:
            return _rpc_error(ident, -32603, str(exc))
        except (JsonViewError, TypeError, ValueError) as exc:
            return _rpc_error(ident, -32602, str(exc))
        except OpenEnvError as exc:
            return _rpc_error(ident, -32603, f"{exc.code.name}: {exc.message}")

    async def _list_tools(self, session: Any) -> list[dict[str, Any]]:
        fields = self._tool_fields
        if fields is not None:  # the tools protocol of openenv_grpc.tools (native envs)
            action = self._action()
            getattr(action, fields.list_call).SetInParent()
            tools = getattr((await session.step(action)).observation, fields.tools)
            return [
                {
                    "name": tool.name,
                    "description": tool.description,
                    "inputSchema": json_format.MessageToDict(tool.input_schema),
                }
                for tool in tools.tools
            ]
        observation = to_json(
            (await session.step(self._mcp_action({"type": "list_tools"}))).observation
        )
        if "tools" not in observation:
            raise _ToolFailed("Environment does not support MCP")
        return [_tool_json(tool) for tool in observation["tools"] or []]

    async def _call_tool(self, session: Any, name: str, arguments: Any) -> Any:
        arguments = arguments if arguments is not None else {}
        if not isinstance(arguments, dict):
            raise JsonViewError("arguments", f"expected an object, got {arguments!r}")
        fields = self._tool_fields
        if fields is not None:
            action = self._action()
            call = getattr(action, fields.tool_call)
            call.name, call.call_id = name, uuid.uuid4().hex[:12]
            call.arguments.update(arguments)
            observation = (await session.step(action)).observation
            result = getattr(observation, fields.tool_result)
            if result.is_error:
                raise _ToolFailed(f"Tool '{name}' failed: {result.error}")
            return {"data": value_to_python(result.content)}
        action = self._mcp_action({"type": "call_tool", "tool_name": name, "arguments": arguments})
        observation = to_json((await session.step(action)).observation)
        if observation.get("error"):
            raise _ToolFailed(f"Tool '{name}' failed: {observation['error'].get('message')}")
        return observation.get("result")

    def _mcp_action(self, data: dict[str, Any]) -> Any:
        return from_json(data, self._action, "action")

    async def _capacity(self) -> tuple[int, int]:
        stub: Any = pb_grpc.EnvServiceStub(self.channel)
        try:
            info = await stub.Info(pb.InfoRequest(), timeout=5.0)
        except grpc.RpcError:
            return self.info.capacity.active_sessions, self.info.capacity.max_sessions
        return info.capacity.active_sessions, info.capacity.max_sessions


class _ToolFailed(Exception):
    """A tool answered an error (a JSON-RPC error for the caller)."""


def _rpc_result(ident: Any, result: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "result": result, "id": ident}


def _rpc_error(ident: Any, code: int, message: str, data: Any = None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": "2.0", "error": error, "id": ident}


def _tool_json(tool: Any) -> dict[str, Any]:
    """A bridged env's Tool as MCP lists it (``inputSchema``)."""
    schema = tool.get("input_schema", tool.get("inputSchema")) or {}
    return {"name": tool.get("name"), "description": tool.get("description") or "",
            "inputSchema": schema}  # fmt: skip


def _observation(result: Any) -> str:
    """OpenEnv's observation frame for a step result."""
    observation = to_json(result.observation)
    metadata = dict(result.info or {})
    observation.setdefault("metadata", metadata)
    data: dict[str, Any] = {
        "observation": observation,
        "reward": result.reward,
        "done": bool(result.terminated or result.truncated),
    }
    if metadata:
        data["metadata"] = metadata
    return json.dumps({"type": "observation", "data": data})


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


async def _close(websocket: WebSocket) -> None:
    with contextlib.suppress(Exception):
        await websocket.close()


# -- running it in the serve process ----------------------------------------------------


def free_port(host: str) -> int:
    """A port free on ``host`` right now (for a gRPC ``--port 0`` the gateway must know)."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family) as probe:
        probe.bind((host.strip("[]"), 0))
        return int(probe.getsockname()[1])


def start_gateway(
    target: str,
    host: str,
    port: int,
    token: str | None = None,
    ready_timeout: float = 120.0,
    announce: Callable[[str], None] | None = None,
) -> threading.Thread:
    """Serve OpenEnv's protocol on ``host:port`` for the gRPC server at ``target``, from a
    daemon thread with its own event loop: it waits for the gRPC server to answer Info
    (it is started just before it), then listens and prints :data:`GATEWAY_LINE`.
    A gateway that cannot start ends the process (exit 1), as a port that cannot be
    bound would."""

    def run() -> None:
        try:
            asyncio.run(_run(target, host, port, token, ready_timeout, announce or _say))
        except BaseException as exc:  # a half-started server must not look healthy
            log.error("the OpenEnv gateway failed: %s", exc)
            print(f"openenv-grpc: the OpenEnv gateway failed: {exc}", file=sys.stderr)
            sys.stderr.flush()
            os._exit(1)

    thread = threading.Thread(target=run, name="openenv-gateway", daemon=True)
    thread.start()
    return thread


async def _run(
    target: str,
    host: str,
    port: int,
    token: str | None,
    ready_timeout: float,
    announce: Callable[[str], None],
) -> None:
    channel = aio_channel(target)
    stub: Any = pb_grpc.EnvServiceStub(channel)
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    info = await stub.Info(
        pb.InfoRequest(), timeout=ready_timeout, wait_for_ready=True, metadata=metadata
    )
    await channel.close()
    gateway = OpenEnvGateway(target, info, token)
    config = uvicorn.Config(
        gateway.app,
        host=host.strip("[]"),
        port=port,
        log_level="warning",
        lifespan="off",
        ws="websockets-sansio",
        ws_ping_interval=20.0,
        ws_ping_timeout=20.0,
    )
    server = uvicorn.Server(config)  # off the main thread: it installs no signal handlers
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():  # it could not bind
            serving.result()
            raise RuntimeError(f"cannot listen on {host}:{port}")
        await asyncio.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    shown = f"[{host.strip('[]')}]" if ":" in host.strip("[]") else host
    announce(GATEWAY_LINE.format(host=shown, port=bound))
    await serving


def _say(line: str) -> None:
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"{line}\n".encode())
