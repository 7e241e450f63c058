"""Protobuf messages as plain JSON data and back, read from their descriptors alone.

What OpenEnv's clients and an LLM's tools see of a message: a dict of its fields by name,
with ints as ints (``json_format`` writes 64-bit ints as strings), floats as floats,
enums by name, bytes as base64, nested messages as dicts, and the fields of a bridged
OpenEnv env that hold JSON text (type ``openenv_grpc.openenv.v1.Json``) as the JSON value
itself. ``google.protobuf`` well-known types (Struct, Value, Timestamp...) use
``json_format``'s own mapping. Only protobuf is needed: TRL's tools use this without the
openenv extra, and the OpenEnv gateway uses it for native and bridged envs alike.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

__all__ = ["JSON_TYPE", "JsonViewError", "from_json", "is_json_field", "to_json"]

#: The message type a bridged OpenEnv env uses for a field protobuf cannot type
#: (``dict[str, Any]``, ``Any``, nested lists): its one ``json`` field holds JSON text.
JSON_TYPE = "openenv_grpc.openenv.v1.Json"

_F = FieldDescriptor
_INTS = frozenset(
    {
        _F.TYPE_INT32, _F.TYPE_INT64, _F.TYPE_UINT32, _F.TYPE_UINT64, _F.TYPE_SINT32,
        _F.TYPE_SINT64, _F.TYPE_FIXED32, _F.TYPE_FIXED64, _F.TYPE_SFIXED32, _F.TYPE_SFIXED64,
    }
)  # fmt: skip
_FLOATS = frozenset({_F.TYPE_DOUBLE, _F.TYPE_FLOAT})
#: Well-known types json_format maps itself (Struct as a dict, Timestamp as text...).
_WELL_KNOWN_PREFIX = "google.protobuf."


class JsonViewError(ValueError):
    """JSON data that does not fit the message; ``path`` names the field (``a.b[2]``)."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


def is_json_field(field: Any) -> bool:
    """True for a field that carries any JSON value (a bridged env's ``Json`` field, or a
    ``google.protobuf.Struct``/``Value``)."""
    message = field.message_type
    return message is not None and message.full_name in (
        JSON_TYPE,
        "google.protobuf.Struct",
        "google.protobuf.Value",
    )


def _json_name(field: Any, descriptor: Any) -> str:
    # A bridged env names a field "<name>_" where <name> would shadow a protobuf method.
    name: str = field.name
    bare = name.rstrip("_")
    if bare and bare != name and bare not in descriptor.fields_by_name:
        return bare
    return name


class _Layout:
    """What the JSON view reads off a message's descriptor, once per message type (every
    frame of a socket converts the same few types)."""

    __slots__ = ("by_name", "fields", "maps", "names", "union")

    def __init__(self, descriptor: Any) -> None:
        oneofs = descriptor.oneofs
        self.union = (
            len(oneofs) == 1
            and oneofs[0].name == "kind"
            and len(oneofs[0].fields) == len(descriptor.fields) > 0
            and all(f.message_type is not None for f in descriptor.fields)
        )
        #: Fields by their JSON names, then by their protobuf names.
        self.by_name: dict[str, Any] = {_json_name(f, descriptor): f for f in descriptor.fields}
        for field in descriptor.fields:
            self.by_name.setdefault(field.name, field)
        self.names = frozenset(descriptor.fields_by_name)
        #: The map fields' protobuf names.
        self.maps = frozenset(f.name for f in descriptor.fields if _is_map(f))
        #: (JSON name, field, how it is written: a map, a list, a plain scalar written as
        #: it is, or another value) of every field, in order.
        self.fields = [(_json_name(f, descriptor), f, _out_kind(f)) for f in descriptor.fields]


_LAYOUTS: dict[Any, _Layout] = {}


def _layout(descriptor: Any) -> _Layout:
    layout = _LAYOUTS.get(descriptor)
    if layout is None:
        layout = _LAYOUTS[descriptor] = _Layout(descriptor)
    return layout


def to_json(message: Message) -> dict[str, Any]:
    """Every field of ``message`` as JSON data (unset optional fields as None); a bridged
    union (oneof ``kind``) as the member it holds, as OpenEnv's JSON has it."""
    layout = _layout(message.DESCRIPTOR)
    if layout.union:
        chosen = message.WhichOneof("kind")
        return to_json(getattr(message, chosen)) if chosen else {}
    out: dict[str, Any] = {}
    for name, field, kind in layout.fields:
        value = getattr(message, field.name)
        if kind is _MAP:
            entry = field.message_type.fields_by_name["value"]
            out[name] = {key: _value_out(entry, item) for key, item in value.items()}
        elif kind is _LIST:
            out[name] = [_value_out(field, item) for item in value]
        elif field.has_presence and not message.HasField(field.name):
            out[name] = None
        else:
            out[name] = value if kind is _PLAIN else _value_out(field, value)
    return out


#: How :func:`to_json` writes a field (:func:`_out_kind`).
_MAP, _LIST, _PLAIN, _OTHER = "map", "list", "plain", "other"


def _out_kind(field: Any) -> str:
    if _is_map(field):
        return _MAP
    if field.is_repeated:
        return _LIST
    plain = field.message_type is None and field.enum_type is None
    if plain and field.type != _F.TYPE_BYTES and field.type not in _FLOATS:
        return _PLAIN  # a string, int or bool: JSON takes it as protobuf gives it
    return _OTHER


def _value_out(field: Any, value: Any) -> Any:
    if field.message_type is not None:
        full_name = field.message_type.full_name
        if full_name == JSON_TYPE:
            return json.loads(value.json) if value.json else None
        if full_name.startswith(_WELL_KNOWN_PREFIX):
            return json_format.MessageToDict(value, preserving_proto_field_name=True)
        return to_json(value)
    if field.enum_type is not None:
        known = field.enum_type.values_by_number.get(value)
        return known.name if known is not None else value
    if field.type == _F.TYPE_BYTES:
        return base64.b64encode(value).decode("ascii")
    if field.type in _FLOATS and not math.isfinite(value):
        return str(value)  # JSON has no NaN or infinity
    return value


def from_json(data: Any, message_class: type[Message], path: str = "action") -> Message:
    """A new ``message_class`` holding ``data`` (a dict of fields by name; an absent or
    None field stays unset).

    Raises:
        JsonViewError: ``data`` is not an object, names a field the message lacks, or a
            value does not fit its field (the path and what it accepts are named).
    """
    message = message_class()
    _fill(message, data, path)
    return message


def _fill(message: Message, data: Any, path: str) -> None:
    if type(data) is not dict and not isinstance(data, Mapping):
        raise JsonViewError(path, f"expected an object, got {_kind(data)}")
    descriptor: Any = message.DESCRIPTOR
    layout = _layout(descriptor)
    if layout.union and not layout.names.issuperset(data):
        _fill_member(message, descriptor, data, path)
        return
    by_name = layout.by_name
    for key, value in data.items():
        field = by_name.get(key)
        where = f"{path}.{key}"
        if field is None:
            known = ", ".join(sorted({_json_name(f, descriptor) for f in descriptor.fields}))
            raise JsonViewError(where, f"no such field (fields: {known or 'none'})")
        if value is None:
            continue
        if field.name in layout.maps:
            if not isinstance(value, Mapping):
                raise JsonViewError(where, f"expected an object, got {_kind(value)}")
            entry = field.message_type.fields_by_name["value"]
            target = getattr(message, field.name)
            for item_key, item in value.items():
                _set_map(target, entry, str(item_key), item, f"{where}.{item_key}")
        elif field.is_repeated:
            if not isinstance(value, list | tuple):
                raise JsonViewError(where, f"expected a list, got {_kind(value)}")
            target = getattr(message, field.name)
            for index, item in enumerate(value):
                if field.message_type is not None:
                    _set_message(target.add(), field, item, f"{where}[{index}]")
                else:
                    target.append(_scalar_in(field, item, f"{where}[{index}]"))
        elif field.message_type is not None:
            _set_message(getattr(message, field.name), field, value, where)
            getattr(message, field.name).SetInParent()
        else:
            setattr(message, field.name, _scalar_in(field, value, where))


def _fill_member(message: Message, descriptor: Any, data: Mapping[str, Any], path: str) -> None:
    """Fill the member of a union that ``data`` (one member's fields) is: the one its
    ``type`` names (OpenEnv's discriminator: ``call_tool`` -> ``call_tool_action``), else
    the first that takes every key."""
    members = list(descriptor.fields)
    kind = data.get("type")
    if isinstance(kind, str):
        named = [f for f in members if f.name == kind or f.name.startswith(f"{kind}_")]
        members = named + [f for f in members if f not in named]
    problems = []
    for member in members:
        target = getattr(message, member.name)
        try:
            _fill(target, data, path)
        except JsonViewError as exc:
            target.Clear()
            problems.append(f"as {member.message_type.name}: {exc.problem}")
            continue
        target.SetInParent()
        return
    raise JsonViewError(path, "fits none of the union's members (" + "; ".join(problems) + ")")


def _set_map(target: Any, entry: Any, key: str, item: Any, where: str) -> None:
    if entry.message_type is not None:
        _set_message(target[key], entry, item, where)
    else:
        target[key] = _scalar_in(entry, item, where)


def _set_message(target: Message, field: Any, value: Any, where: str) -> None:
    full_name = field.message_type.full_name
    if full_name == JSON_TYPE:
        try:
            target.json = json.dumps(value, allow_nan=False)  # type: ignore[attr-defined]
        except (TypeError, ValueError, RecursionError) as exc:  # too deep: RecursionError
            raise JsonViewError(where, f"not JSON: {exc}") from None
    elif full_name.startswith(_WELL_KNOWN_PREFIX):
        try:
            json_format.ParseDict(value, target)
        except json_format.ParseError as exc:
            raise JsonViewError(where, str(exc)) from None
    else:
        _fill(target, value, where)


def _scalar_in(field: Any, value: Any, where: str) -> Any:
    kind = field.type
    if field.enum_type is not None:
        names = field.enum_type.values_by_name
        if isinstance(value, str) and value in names:
            return names[value].number
        numbered = isinstance(value, int) and not isinstance(value, bool)
        if numbered and value in field.enum_type.values_by_number:
            return value
        choices = ", ".join(names)
        raise JsonViewError(where, f"expected one of {choices}, got {_kind(value)}")
    if kind == _F.TYPE_BOOL:
        if isinstance(value, bool):
            return value
        raise JsonViewError(where, f"expected true or false, got {_kind(value)}")
    if kind in _INTS:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise JsonViewError(where, f"expected an integer, got {_kind(value)}")
        low, high = _int_range(kind)
        if not low <= value <= high:
            raise JsonViewError(where, f"expected an integer from {low} to {high}, got {value}")
        return value
    if kind in _FLOATS:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise JsonViewError(where, f"expected a number, got {_kind(value)}")
    if kind == _F.TYPE_STRING:
        if isinstance(value, str):
            return value
        raise JsonViewError(where, f"expected a string, got {_kind(value)}")
    if kind == _F.TYPE_BYTES:
        if isinstance(value, str):
            try:
                return base64.b64decode(value, validate=True)
            except ValueError:
                return value.encode()
        raise JsonViewError(where, f"expected a base64 string, got {_kind(value)}")
    raise JsonViewError(where, f"unsupported field type {kind}")


def _int_range(kind: int) -> tuple[int, int]:
    if kind in (_F.TYPE_UINT32, _F.TYPE_FIXED32):
        return 0, 2**32 - 1
    if kind in (_F.TYPE_UINT64, _F.TYPE_FIXED64):
        return 0, 2**64 - 1
    if kind in (_F.TYPE_INT32, _F.TYPE_SINT32, _F.TYPE_SFIXED32):
        return -(2**31), 2**31 - 1
    return -(2**63), 2**63 - 1


def _is_map(field: Any) -> bool:
    message = field.message_type
    return bool(field.is_repeated and message is not None and message.GetOptions().map_entry)


def _kind(value: Any) -> str:
    shown = json.dumps(value) if _plain(value) else repr(value)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return f"{type(value).__name__} {shown}"


def _plain(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
