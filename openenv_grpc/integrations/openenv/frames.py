"""What OpenEnv's frames and tool calls are answered with, written once for every way
the door reaches a session of the core.

An answer is a *program*: a generator that yields the session calls it needs
(:data:`Call`: reset, step, state, or any other awaitable) and gets each call's result
(or its exception, thrown in) back; it returns the answer. A program is one request of a
Session stream of the core, run by :class:`~.streams.DoorView` on the session's view; the
stream is a ``/ws`` socket's own (:class:`~.streams.SocketWire`), or one that takes
programs from any task (:class:`~.streams.ProgramStream`: held ``/mcp`` sessions and the
sockets attached to them, the stateless HTTP routes, ``WS /mcp``).

So a frame means the same whichever way it came, and answers are OpenEnv's ``/ws``
frames (``{"type": "observation" | "state" | "mcp" | "error", "data": ...}``) and
JSON-RPC 2.0 objects as OpenEnv 0.10.0 writes them.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from collections.abc import Awaitable, Callable, Generator
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from pydantic import ValidationError

from openenv_grpc.client import EnvError, OpenEnvError
from openenv_grpc.codec import value_to_python
from openenv_grpc.integrations.json_view import JsonViewError, from_json, to_json
from openenv_grpc.integrations.trl.tools import ToolFields

__all__ = [
    "Call",
    "FrameAnswers",
    "Program",
    "SessionView",
    "error_frame",
    "observation_data",
    "parse_frame",
    "rpc_error",
    "rpc_request_problem",
    "rpc_result",
]

log = logging.getLogger("openenv_grpc.gateway")

T = TypeVar("T")

#: A session call a program asks for: ``("reset", seed, episode_id, options)``,
#: ``("step", action)``, ``("state",)``, or ``("await", awaitable)`` for work beside the
#: session (another session's close).
Call = tuple[Any, ...]
#: An answer in the making: yields calls, gets their results, returns the answer.
Program = Generator[Call, Any, T]

#: ``json.dumps``'s output, refusing NaN and infinities (which then take the slow path).
_FRAME = json.JSONEncoder(allow_nan=False)
#: Reset keywords that are the session's own, not the env's reset options.
_SESSION_KEYS = ("seed", "episode_id")

#: gRPC codes an OpenEnv client reads as a bad request rather than a failing env.
_VALIDATION = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}


class SessionView(Protocol):
    """What a program reads of its session between calls."""

    @property
    def episode_id(self) -> str: ...

    @property
    def step_count(self) -> int: ...

    @property
    def native(self) -> bool:
        """The session's env takes the door's native lane (``native.py``)."""
        ...


#: Answers a ``openenv/session/close`` of another session: the door's HTTP ``/mcp`` call.
OtherCall = Callable[[dict[str, Any], "str | None"], Awaitable[dict[str, Any]]]


class FrameAnswers:
    """The programs answering OpenEnv's ``/ws`` frames and tool calls for one env.

    Args:
        action: The env's action message class (JSON actions become it).
        reset_options: Its reset options class, if it takes any.
        tool_fields: The tools protocol of ``openenv_grpc.tools``, if the env speaks it.
        other_call: How an ``openenv/session/close`` naming another session is answered.
        native: The native lane of a bridged env (``native.NativeLane``), if it has one.
    """

    def __init__(
        self,
        action: Any,
        reset_options: Any,
        tool_fields: ToolFields | None,
        other_call: OtherCall,
        native: Any = None,
    ) -> None:
        self._native = native
        self._action = action
        self._reset_options = reset_options
        self._tool_fields = tool_fields
        self._other_call = other_call

    # -- /ws frames ---------------------------------------------------------------------

    def frame(
        self,
        session: SessionView,
        kind: str,
        data: Any,
        own_id: str,
        token: str | None,
        size: int = 0,
    ) -> Program[str]:
        """The frame answering one ``/ws`` request of ``size`` characters; never raises for
        what the client sent."""
        try:
            if kind == "mcp":
                return (yield from self._mcp_frame(session, data, own_id, token))
            if kind == "reset":
                result = yield from self.reset(data if data is not None else {})
                return self.observation(result)
            if kind == "step":
                if session.native:  # as OpenEnv: data must be an object, null too is refused
                    try:
                        action = self._native.action(data)
                    except ValidationError as exc:
                        return str(self._native.invalid(exc, size))
                else:
                    action = from_json(data if data is not None else {}, self._action, "action")
                if not session.episode_id:  # OpenEnv steps a fresh env; ours needs a reset
                    yield ("reset", None, None, None)
                return self.observation((yield ("step", action)))
            if kind == "state":
                state = state_data(session, (yield ("state",)))
                return json.dumps({"type": "state", "data": state})
            return error_frame("UNKNOWN_TYPE", f"Unknown message type: {str(kind)[:200]}")
        except (JsonViewError, TypeError, ValueError, RecursionError) as exc:
            message = str(exc)[:2000]
            return error_frame("VALIDATION_ERROR", message, errors=[{"msg": message}])
        except EnvError as exc:
            code = "VALIDATION_ERROR" if exc.code in _VALIDATION else "EXECUTION_ERROR"
            return error_frame(code, exc.message)
        except OpenEnvError as exc:
            return error_frame("EXECUTION_ERROR", f"{exc.code.name}: {exc.message}")
        except Exception as exc:  # a bug here must not end the client's session
            log.exception("the OpenEnv gateway failed to answer a %s frame", kind)
            return error_frame("EXECUTION_ERROR", f"{type(exc).__name__}: {exc}")

    def reset(self, data: Any) -> Program[Any]:
        """A reset with OpenEnv's keyword arguments (``seed``, ``episode_id``, the env's
        own options; those a ``**kwargs`` takes spill into it)."""
        if not isinstance(data, dict):
            raise JsonViewError("reset", f"expected an object of keyword arguments, got {data!r}")
        seed, episode_id = data.get("seed"), data.get("episode_id")
        rest = {k: v for k, v in data.items() if k not in _SESSION_KEYS}
        options = None
        if rest:
            if self._reset_options is None:
                raise JsonViewError("reset", f"this env takes no reset options: {sorted(rest)}")
            options = from_json(_spill(rest, self._reset_options), self._reset_options, "reset")
        return (yield ("reset", seed, episode_id, options))

    @staticmethod
    def stepped(action: Any) -> Program[Any]:
        """A step of a fresh env (OpenEnv's stateless ``/step``: ours needs a reset)."""
        yield ("reset", None, None, None)
        return (yield ("step", action))

    @staticmethod
    def fresh_state() -> Program[Any]:
        """The state of a fresh env (OpenEnv's stateless ``/state``); an env that has none
        before a reset (FAILED_PRECONDITION) is reset first."""
        try:
            return (yield ("state",))
        except EnvError as exc:
            if exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                raise
        yield ("reset", None, None, None)
        return (yield ("state",))

    def observation(self, result: Any) -> str:
        """OpenEnv's observation frame for a step result. Written strictly first: only a
        frame with a NaN or an infinity pays for the walk that writes them as null. The
        native lane's (the env's own observation) as OpenEnv writes it."""
        if not isinstance(result.observation, Message):
            return str(self._native.frame(result.observation))
        try:
            return _FRAME.encode(
                {"type": "observation", "data": self.observation_data(result, False)}
            )
        except ValueError:
            return json.dumps({"type": "observation", "data": self.observation_data(result)})

    def observation_data(self, result: Any, finite: bool = True) -> dict[str, Any]:
        """OpenEnv's ``serialize_observation`` of a step result; a tools-protocol env's
        tool list as OpenEnv's ``ListToolsObservation`` has it (a list of tools), so MCP
        clients read it. ``finite=False``: the info and reward as they are."""
        data = observation_data(result, finite)
        fields = self._tool_fields
        if fields is not None:
            observation = data["observation"]
            listed = observation.pop(fields.tools, None)
            if listed and listed.get("tools"):
                observation["tools"] = listed["tools"]
        return data

    # -- MCP ------------------------------------------------------------------------------

    def _mcp_frame(
        self, session: SessionView, data: Any, own_id: str, token: str | None
    ) -> Program[str]:
        """The answer to a ``{"type": "mcp"}`` frame: JSON-RPC on the socket's own session
        (OpenEnv's ``mcp_handler`` with the session's env)."""
        if not isinstance(data, dict):
            return error_frame("VALIDATION_ERROR", "Invalid message", errors=[
                {"type": "dict_type", "loc": ["data"], "msg": "Input should be a valid "
                 "dictionary", "input": data}])  # fmt: skip
        problem = rpc_request_problem(data)
        if problem:
            answer = rpc_error(None, -32600, f"Invalid request: {problem}")
        else:
            answer = yield from self.mcp_on(session, data, own_id, token)
        return json.dumps({"type": "mcp", "data": answer})

    def mcp_on(
        self, session: SessionView, call: dict[str, Any], own_id: str, token: str | None
    ) -> Program[dict[str, Any]]:
        """A JSON-RPC call on a session the socket owns (its id is ``own_id``)."""
        method, ident = call["method"], call.get("id")
        params = call.get("params") or {}
        if method == "openenv/session/create":
            return rpc_result(ident, {"session_id": own_id})
        if method == "openenv/session/close":
            target = params.get("session_id")
            if target and str(target) == own_id:
                return rpc_error(ident, -32600, "Cannot close active WebSocket-managed "
                                 "session via MCP method")  # fmt: skip
            answer: dict[str, Any] = yield ("await", self._other_call(call, token))
            return answer
        if method not in ("tools/list", "tools/call"):
            return rpc_error(ident, -32601, f"Method not found: {str(method)[:200]}")
        return (yield from self.tool_method(session, ident, method, params))

    def tool_method(
        self, session: SessionView, ident: Any, method: str, params: dict[str, Any]
    ) -> Program[dict[str, Any]]:
        """The answer to ``tools/list`` or ``tools/call``."""
        try:
            if not session.episode_id:  # OpenEnv calls tools before any reset; we need one
                yield ("reset", None, None, None)
            if method == "tools/list":
                return rpc_result(ident, {"tools": (yield from self._list_tools())})
            name = params.get("name")
            if not isinstance(name, str) or not name:
                return rpc_error(ident, -32602, "Missing 'name' in params")
            arguments = params.get("arguments")
            return rpc_result(ident, (yield from self._call_tool(name, arguments)))
        except _ToolFailed as exc:
            return rpc_error(ident, -32603, str(exc))
        except (JsonViewError, TypeError, ValueError, RecursionError) as exc:
            return rpc_error(ident, -32602, str(exc)[:2000])
        except OpenEnvError as exc:
            return rpc_error(ident, -32603, f"{exc.code.name}: {exc.message}")

    def _list_tools(self) -> Program[list[dict[str, Any]]]:
        fields = self._tool_fields
        if fields is not None:  # the tools protocol of openenv_grpc.tools (native envs)
            action = self._action()
            getattr(action, fields.list_call).SetInParent()
            tools = getattr((yield ("step", action)).observation, fields.tools)
            return [
                {
                    "name": tool.name,
                    "description": tool.description,
                    "inputSchema": json_format.MessageToDict(tool.input_schema),
                }
                for tool in tools.tools
            ]
        listing = self._mcp_action({"type": "list_tools"})
        observation = to_json((yield ("step", listing)).observation)
        if "tools" not in observation:
            raise _ToolFailed("Environment does not support MCP")
        return [_tool_json(tool) for tool in observation["tools"] or []]

    def _call_tool(self, name: str, arguments: Any) -> Program[Any]:
        arguments = arguments if arguments is not None else {}
        if not isinstance(arguments, dict):
            raise JsonViewError("arguments", f"expected an object, got {arguments!r}")
        fields = self._tool_fields
        if fields is not None:
            action = self._action()
            call = getattr(action, fields.tool_call)
            call.name, call.call_id = name, uuid.uuid4().hex[:12]
            call.arguments.update(arguments)
            observation = (yield ("step", action)).observation
            result = getattr(observation, fields.tool_result)
            if result.is_error:
                raise _ToolFailed(f"Tool '{name}' failed: {result.error}")
            return {"data": value_to_python(result.content)}
        action = self._mcp_action({"type": "call_tool", "tool_name": name, "arguments": arguments})
        observation = to_json((yield ("step", action)).observation)
        if observation.get("error"):
            # The env's own words, as OpenEnv's /mcp answers an MCP env's failed call.
            raise _ToolFailed(str(observation["error"].get("message")))
        return observation.get("result")

    def _mcp_action(self, data: dict[str, Any]) -> Any:
        return from_json(data, self._action, "action")


# -- what answers look like ----------------------------------------------------------------


def parse_frame(raw: str | None) -> tuple[str, Any] | str:
    """A ``/ws`` message (None: a binary one) as its (type, data), or the error frame
    answering what is none."""
    if raw is None:
        return error_frame("INVALID_JSON", "Invalid JSON: a binary frame; send JSON text")
    try:
        message = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # 5,000 digits, nesting too deep
        return error_frame("INVALID_JSON", f"Invalid JSON: {exc}")
    if not isinstance(message, dict):
        return error_frame("VALIDATION_ERROR", "expected a JSON object with a 'type', got "
                           f"{type(message).__name__}", errors=[])  # fmt: skip
    return message.get("type", ""), message.get("data")


def error_frame(code: str, message: str, **extra: Any) -> str:
    """OpenEnv's ``/ws`` error frame."""
    return json.dumps({"type": "error", "data": {"message": message, "code": code, **extra}})


def state_data(session: SessionView, state: Any) -> dict[str, Any]:
    """A state as OpenEnv's ``State`` (``episode_id`` and ``step_count`` always there)."""
    data = to_json(state)
    data.setdefault("episode_id", session.episode_id or None)
    data.setdefault("step_count", session.step_count)
    return data


def rpc_request_problem(call: dict[str, Any]) -> str | None:
    """Why ``call`` is no JSON-RPC 2.0 request as OpenEnv's ``JsonRpcRequest`` takes it
    (None: it is one)."""
    extra = sorted(set(call) - {"jsonrpc", "method", "params", "id"})
    if extra:
        return f"extra fields not permitted: {extra[:5]}"
    if call.get("jsonrpc") != "2.0":
        return "jsonrpc: Input should be '2.0'"
    if not isinstance(call.get("method"), str):
        return "method: Input should be a valid string"
    if not isinstance(call.get("params", {}), dict):
        return "params: Input should be a valid dictionary"
    ident = call.get("id")
    if ident is not None and (isinstance(ident, bool) or not isinstance(ident, (str, int))):
        return "id: Input should be a valid string or integer"
    return None


def rpc_result(ident: Any, result: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "result": result, "id": ident}


def rpc_error(ident: Any, code: int, message: str, data: Any = None) -> dict[str, Any]:
    """A JSON-RPC error as OpenEnv writes it (``data`` always there, null when none)."""
    return {"jsonrpc": "2.0", "id": ident, "error": {"code": code, "message": message,
                                                     "data": data}}  # fmt: skip


def observation_data(result: Any, finite: bool = True) -> dict[str, Any]:
    """What OpenEnv's ``serialize_observation`` makes of a step result; non-finite
    numbers in the info or the reward as ``null`` (never a bare ``NaN`` token; unless
    ``finite`` is False), and a reward the env did not give (its None: ``no_reward``) as
    ``null``, as OpenEnv does."""
    observation = to_json(result.observation)
    metadata = (_finite(dict(result.info)) if finite else dict(result.info)) if result.info else {}
    observation.setdefault("metadata", metadata)
    reward = result.reward
    data: dict[str, Any] = {
        "observation": observation,
        "reward": None if result.no_reward or (finite and not math.isfinite(reward)) else reward,
        "done": bool(result.terminated or result.truncated),
    }
    if metadata:
        data["metadata"] = metadata
    return data


class _ToolFailed(Exception):
    """A tool answered an error (a JSON-RPC error for the caller)."""


def _spill(options: dict[str, Any], message_class: Any) -> dict[str, Any]:
    """Reset options as the options message takes them: keywords it has no field for go
    into its ``kwargs`` field when ``reset`` takes ``**kwargs`` (the bridge then passes
    them to ``reset(**kwargs)``, as OpenEnv does); without one they stay, to be refused."""
    names = {field.name for field in message_class.DESCRIPTOR.fields}
    spill = next((name for name in ("extra_kwargs", "kwargs") if name in names), None)
    extra = {key: value for key, value in options.items() if key not in names}
    if spill is None or not extra:
        return options
    given = options.get(spill)
    kept = {key: value for key, value in options.items() if key in names}
    kept[spill] = {**(given if isinstance(given, dict) else {}), **extra}
    return kept


def _tool_json(tool: Any) -> dict[str, Any]:
    """A bridged env's Tool as MCP lists it (``inputSchema``)."""
    schema = tool.get("input_schema", tool.get("inputSchema")) or {}
    return {"name": tool.get("name"), "description": tool.get("description") or "",
            "inputSchema": schema}  # fmt: skip


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinity (which JSON cannot write) as None, as OpenEnv's
    pydantic serialization writes them (``null``)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value
