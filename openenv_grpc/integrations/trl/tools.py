"""Tool methods made at run time, for envs whose tools are only known from the server.

TRL reads a tool's name, type hints and Google-style docstring (``Args:`` lines) to
show it to the model, so a generated method carries a real ``__signature__``,
``__annotations__`` and ``__doc__``. Two sources:

- **the env's own tools** (:func:`tool_protocol_methods`): envs that speak the tools
  protocol of :mod:`openenv_grpc.tools` (an action field of type ``ToolCall``, an
  observation field of type ``ToolList``, like echo) list their tools with a JSON Schema
  each; every tool becomes one method that sends a ``ToolCall``;
- **the action's fields** (:func:`action_field_method`): any other env gets one tool,
  ``act``, whose arguments are the action message's fields.
"""

from __future__ import annotations

import inspect
import json
import keyword
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from openenv_grpc.codec import value_to_python
from openenv_grpc.integrations.json_view import JsonViewError, from_json, is_json_field
from openenv_grpc.tools import ToolList, ToolResult

__all__ = ["ToolFields", "action_field_method", "find_tool_fields", "tool_protocol_methods"]

_RESERVED = frozenset({"reset", "get_reward"})
_JSON_TYPES: dict[str, Any] = {
    "string": str,
    "integer": int,
    "number": float,
    "boolean": bool,
    "array": list,
    "object": dict,
}
_SCALARS: dict[int, Any] = {
    FieldDescriptor.TYPE_STRING: str,
    FieldDescriptor.TYPE_BOOL: bool,
    FieldDescriptor.TYPE_DOUBLE: float,
    FieldDescriptor.TYPE_FLOAT: float,
    FieldDescriptor.TYPE_BYTES: str,
}

Method = Callable[..., Awaitable[str]]


class ToolFields:
    """Where an env's action and observation carry the tools protocol (descriptors of either
    protobuf implementation, hence ``Any``)."""

    def __init__(self, list_call: str, tool_call: str, tools: str, tool_result: str) -> None:
        self.list_call = list_call
        self.tool_call = tool_call
        self.tools = tools
        self.tool_result = tool_result


def find_tool_fields(action: Any, observation: Any) -> ToolFields | None:
    """The tools-protocol fields of an env's messages, or None if it does not speak it."""

    def field_of(descriptor: Any, type_name: str) -> str | None:
        for field in descriptor.fields:
            if field.message_type is not None and field.message_type.full_name == type_name:
                return str(field.name)
        return None

    names = (
        field_of(action, "openenv_grpc.tools.v1.ListToolsCall"),
        field_of(action, "openenv_grpc.tools.v1.ToolCall"),
        field_of(observation, "openenv_grpc.tools.v1.ToolList"),
        field_of(observation, "openenv_grpc.tools.v1.ToolResult"),
    )
    if any(name is None for name in names):
        return None
    return ToolFields(*(name for name in names if name is not None))


def tool_protocol_methods(
    tools: ToolList, fields: ToolFields, action_class: type[Message]
) -> dict[str, Method]:
    """One method per tool in ``tools``; each sends ``action_class`` with a ``ToolCall``.

    Raises:
        ValueError: a tool's name cannot be a Python method name.
    """
    methods: dict[str, Method] = {}
    for spec in tools.tools:
        name = spec.name
        if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_"):
            raise ValueError(f"tool {name!r} cannot be a method name")
        if name in _RESERVED:
            raise ValueError(f"tool {name!r} collides with TRL's {name}()")
        schema = json_format.MessageToDict(spec.input_schema)
        parameters, args_doc = _schema_parameters(schema)

        def make(tool_name: str) -> Method:
            async def call_tool(self: Any, **arguments: Any) -> str:
                action = action_class()
                call = getattr(action, fields.tool_call)
                call.name = tool_name
                call.call_id = uuid.uuid4().hex[:12]
                call.arguments.update(
                    {key: value for key, value in arguments.items() if value is not None}
                )
                return await self._act(action)  # type: ignore[no-any-return]

            return call_tool

        doc = _docstring(spec.description or f"Call the {name} tool.", args_doc)
        methods[name] = _named(make(name), name, parameters, doc)
    return methods


#: Fields of a bridged OpenEnv action that are the trainer's, not the model's: OpenEnv's
#: ``Action.metadata`` (a JSON field every action inherits).
_NOT_FOR_THE_MODEL = frozenset({"metadata"})


def action_field_method(action_class: type[Message]) -> dict[str, Method]:
    """One tool, ``act``, whose arguments are the action's fields (message fields as JSON
    objects, JSON fields as any JSON value; OpenEnv's ``metadata`` is left out); it sends
    the action built from them."""
    parameters: list[inspect.Parameter] = []
    args_doc: list[str] = []
    for field in action_class.DESCRIPTOR.fields:
        if field.name in _NOT_FOR_THE_MODEL and is_json_field(field):
            continue
        annotation = _field_type(field)
        parameters.append(
            inspect.Parameter(
                field.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation
            )
        )
        args_doc.append(f"{field.name}: The action's {field.name} ({_type_name(annotation)}).")

    async def act(self: Any, **values: Any) -> str:
        present = {key: value for key, value in values.items() if value is not None}
        try:
            action = from_json(present, action_class, "act")
        except JsonViewError as exc:
            return f"Refused: {exc}. Nothing changed; try again."
        return await self._act(action)  # type: ignore[no-any-return]

    name = action_class.DESCRIPTOR.name
    doc = _docstring(f"Take one step in the environment with a {name}.", args_doc)
    return {"act": _named(act, "act", parameters, doc)}


def describe_tool_result(result: ToolResult) -> str:
    """A tool's result as text: its JSON content, or its error."""
    if result.is_error:
        return f"Error: {result.error}"
    value = value_to_python(result.content)
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON numbers travel as doubles; a count reads better as 2
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


# -- helpers ---------------------------------------------------------------------------


def _schema_parameters(schema: dict[str, Any]) -> tuple[list[inspect.Parameter], list[str]]:
    properties: dict[str, Any] = schema.get("properties", {})
    required = set(schema.get("required", ()))
    parameters: list[inspect.Parameter] = []
    docs: list[str] = []
    # Required arguments first: a signature cannot put a defaulted one before them.
    for key in sorted(properties, key=lambda k: k not in required):
        prop = properties[key]
        annotation = _json_type(prop)
        if key in required:
            parameter = inspect.Parameter(
                key, inspect.Parameter.KEYWORD_ONLY, annotation=annotation
            )
        else:
            parameter = inspect.Parameter(
                key, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation | None
            )
        parameters.append(parameter)
        text = prop.get("description") or f"The {key} ({_type_name(annotation)})"
        docs.append(f"{key}: {text.rstrip('.')}." + ("" if key in required else " Optional."))
    return parameters, docs


def _json_type(prop: dict[str, Any]) -> Any:
    kind = _JSON_TYPES.get(prop.get("type", ""), Any)
    if kind is list:
        return list[_json_type(prop.get("items", {}))]  # type: ignore[misc]
    if kind is dict:
        return dict[str, Any]
    return kind


def _field_type(field: Any) -> Any:
    message = field.message_type
    if message is not None and message.GetOptions().map_entry:
        return dict[str, _field_type(message.fields_by_name["value"])]  # type: ignore[misc]
    if is_json_field(field):
        base: Any = Any  # any JSON value: OpenEnv's dict[str, Any], Any, nested lists
    elif field.message_type is not None:
        base = dict[str, Any]
    elif field.enum_type is not None:
        base = str
    else:
        base = _SCALARS.get(field.type, int)
    return list[base] if field.is_repeated else base


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _docstring(summary: str, args: Iterable[str]) -> str:
    lines = [summary.strip(), ""]
    args = list(args)
    if args:
        lines += ["Args:", *(f"    {line}" for line in args), ""]
    lines += ["Returns:", "    What the environment answered, as text."]
    return "\n".join(lines)


def _named(function: Method, name: str, parameters: list[inspect.Parameter], doc: str) -> Method:
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    function.__name__ = name
    function.__qualname__ = name
    function.__doc__ = doc
    function.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [self_parameter, *parameters], return_annotation=str
    )
    function.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": str}
    return function
