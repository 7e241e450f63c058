"""The toolbox: an object's tool methods, listed with their schemas and called by name.

Tool calling for environments: mark methods with :func:`tool`, serve them with
:class:`Toolbox`.

::

    class MyEnv(Environment[...]):
        def __init__(self):
            self.toolbox = Toolbox(self)

        @tool
        def reverse(self, message: str) -> str:
            '''Reverse a message.'''
            return message[::-1]

The JSON Schema of each tool's arguments is derived from its type hints (str, int, float,
bool, list[...] and dict[str, ...]; a parameter with a default is optional), and its
description from the docstring's first line. :meth:`Toolbox.call` checks the arguments
against that schema: an unknown tool or a bad argument raises :class:`InvalidAction`
(the caller's mistake, INVALID_ARGUMENT in-band); an exception inside the tool becomes an
``is_error`` result the agent can read, and the episode goes on.
"""

from __future__ import annotations

import inspect
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf import struct_pb2

from openenv_grpc.codec import info_from_struct, info_to_struct
from openenv_grpc.environment import InvalidAction
from openenv_grpc.tools.v1.tools_pb2 import Tool, ToolCall, ToolList, ToolResult

__all__ = ["Toolbox", "tool"]

F = TypeVar("F", bound=Callable[..., Any])

_MARK = "__openenv_tool__"
_JSON_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
}


@dataclass(frozen=True, slots=True)
class _ToolMark:
    name: str
    description: str


def tool(fn: F | None = None, *, name: str | None = None, description: str | None = None) -> Any:
    """Mark a method as a tool; usable bare (``@tool``) or with arguments."""

    def mark(function: F) -> F:
        doc = (inspect.getdoc(function) or "").strip().split("\n")[0]
        setattr(function, _MARK, _ToolMark(name or function.__name__, description or doc))
        return function

    return mark(fn) if fn is not None else mark


@dataclass(frozen=True, slots=True)
class _Entry:
    attribute: str
    spec: Tool
    schema: dict[str, Any]


_Catalogue = tuple[dict[str, _Entry], ToolList]
_CATALOGUES: dict[type, _Catalogue] = {}


def _catalogue(owner_type: type) -> _Catalogue:
    """The tools a class defines, worked out once per class (an env makes one Toolbox per
    instance, and a server makes thousands of instances)."""
    known = _CATALOGUES.get(owner_type)
    if known is not None:
        return known
    entries: dict[str, _Entry] = {}
    for attribute in sorted(dir(owner_type)):
        function = getattr(owner_type, attribute, None)
        mark = getattr(function, _MARK, None)
        if isinstance(mark, _ToolMark):
            assert function is not None
            schema = _schema(function, skip_self=True)
            spec = Tool(name=mark.name, description=mark.description)
            spec.input_schema.update(schema)
            entries[mark.name] = _Entry(attribute, spec, schema)
    _CATALOGUES[owner_type] = entries, ToolList(tools=[e.spec for e in entries.values()])
    return _CATALOGUES[owner_type]


class Toolbox:
    """The tools of one object (usually an environment instance), by name."""

    def __init__(self, owner: object) -> None:
        self._owner = owner
        self._entries, self._list = _catalogue(type(owner))

    def list(self) -> ToolList:
        """Every tool, sorted by method name."""
        return self._list

    def call(self, call: ToolCall) -> ToolResult:
        """Run ``call`` and return its result.

        Raises:
            InvalidAction: no tool has that name, or the arguments do not match its schema.
        """
        entry = self._entries.get(call.name)
        if entry is None:
            known = ", ".join(self._entries) or "none"
            raise InvalidAction(f"no tool named {call.name!r} (tools: {known})")
        arguments = info_from_struct(call.arguments)
        _check_arguments(call.name, entry.schema, arguments)
        result = ToolResult(call_id=call.call_id, name=call.name)
        try:
            value = getattr(self._owner, entry.attribute)(**arguments)
        except Exception as exc:  # the tool failed: the agent gets to read why
            result.is_error = True
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        result.content.CopyFrom(_to_value(value))
        return result


def _schema(function: Callable[..., Any], skip_self: bool) -> dict[str, Any]:
    hints = typing.get_type_hints(function)
    properties: dict[str, Any] = {}
    required: list[str] = []
    parameters = list(inspect.signature(function).parameters.values())
    for parameter in parameters[1:] if skip_self else parameters:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise TypeError(f"tool {function.__name__}: *args and **kwargs have no schema")
        annotation = hints.get(parameter.name)
        if annotation is None:
            raise TypeError(f"tool {function.__name__}: parameter {parameter.name!r} needs a type")
        properties[parameter.name] = _type_schema(annotation, function.__name__)
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def _type_schema(annotation: Any, tool_name: str) -> dict[str, Any]:
    origin = typing.get_origin(annotation) or annotation
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(options) == 1:  # Optional[X]
            return _type_schema(options[0], tool_name)
        raise TypeError(f"tool {tool_name}: unions other than Optional have no schema")
    kind = _JSON_TYPES.get(origin)
    if kind is None:
        raise TypeError(f"tool {tool_name}: type {annotation!r} has no JSON Schema")
    schema: dict[str, Any] = {"type": kind}
    args = typing.get_args(annotation)
    if origin is list and args:
        schema["items"] = _type_schema(args[0], tool_name)
    return schema


def _check_arguments(name: str, schema: dict[str, Any], arguments: dict[str, Any]) -> None:
    properties: dict[str, Any] = schema["properties"]
    unknown = sorted(set(arguments) - set(properties))
    if unknown:
        raise InvalidAction(f"tool {name!r} has no argument {', '.join(map(repr, unknown))}")
    missing = [key for key in schema["required"] if key not in arguments]
    if missing:
        raise InvalidAction(f"tool {name!r} is missing argument {', '.join(map(repr, missing))}")
    for key, value in arguments.items():
        arguments[key] = _coerce(name, key, properties[key], value)


def _coerce(tool_name: str, key: str, schema: dict[str, Any], value: Any) -> Any:
    """Check ``value`` against ``schema``; JSON numbers arrive as floats, so whole floats
    become ints where the schema says integer."""
    kind = schema["type"]
    ok: bool
    if kind in ("integer", "number") and isinstance(value, float) and not math.isfinite(value):
        raise InvalidAction(f"tool {tool_name!r}: argument {key!r} must be finite, got {value}")
    if kind == "integer":
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "number":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind == "string":
        ok = isinstance(value, str)
    elif kind == "boolean":
        ok = isinstance(value, bool)
    elif kind == "array":
        ok = isinstance(value, list)
        if ok and "items" in schema:
            value = [_coerce(tool_name, f"{key}[]", schema["items"], v) for v in value]
    else:
        ok = isinstance(value, dict)
    if not ok:
        raise InvalidAction(
            f"tool {tool_name!r}: argument {key!r} must be {kind}, got {type(value).__name__}"
        )
    return value


def _to_value(value: Any) -> struct_pb2.Value:
    holder = struct_pb2.Struct()
    info_to_struct({"v": value}, holder)  # same conversion as info maps: nothing dropped
    return holder.fields["v"]
