"""Form schemas from protobuf descriptors: what the console's page builds its forms from.

Every message type the page may need (the action, the reset options and everything they
contain) becomes a plain JSON object keyed by full name, so recursive types (a Value that
holds a dict of Values) are described once and expanded by the page only as far as a
person opens them. Scalars, enums, repeated fields, maps, nested messages, oneofs and
``optional`` fields are all described; well-known JSON types (Struct, Value, ListValue,
Any) are edited as JSON text, and the wrappers and Timestamp/Duration as their JSON
strings or scalars — all in protobuf's JSON mapping, which the server side parses with
``json_format.ParseDict``.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from openenv_grpc.console.tensors import is_tensor

__all__ = ["schemas"]

_SCALARS: dict[int, str] = {
    FieldDescriptor.TYPE_DOUBLE: "float",
    FieldDescriptor.TYPE_FLOAT: "float",
    FieldDescriptor.TYPE_INT64: "int64",
    FieldDescriptor.TYPE_SINT64: "int64",
    FieldDescriptor.TYPE_SFIXED64: "int64",
    FieldDescriptor.TYPE_UINT64: "uint64",
    FieldDescriptor.TYPE_FIXED64: "uint64",
    FieldDescriptor.TYPE_INT32: "int",
    FieldDescriptor.TYPE_SINT32: "int",
    FieldDescriptor.TYPE_SFIXED32: "int",
    FieldDescriptor.TYPE_UINT32: "uint",
    FieldDescriptor.TYPE_FIXED32: "uint",
    FieldDescriptor.TYPE_BOOL: "bool",
    FieldDescriptor.TYPE_STRING: "string",
    FieldDescriptor.TYPE_BYTES: "bytes",
}

#: Well-known types whose JSON form is free JSON: the page offers a JSON text box.
_JSON_TYPES = {
    "google.protobuf.Struct",
    "google.protobuf.Value",
    "google.protobuf.ListValue",
    "google.protobuf.Any",
}
#: Well-known types whose JSON form is a single string ("1.5s", RFC 3339, a field mask).
_STRING_TYPES = {
    "google.protobuf.Timestamp",
    "google.protobuf.Duration",
    "google.protobuf.FieldMask",
}
#: Wrapper types: their JSON form is the wrapped scalar.
_WRAPPERS = {
    "google.protobuf.DoubleValue": "float",
    "google.protobuf.FloatValue": "float",
    "google.protobuf.Int64Value": "int64",
    "google.protobuf.UInt64Value": "uint64",
    "google.protobuf.Int32Value": "int",
    "google.protobuf.UInt32Value": "uint",
    "google.protobuf.BoolValue": "bool",
    "google.protobuf.StringValue": "string",
    "google.protobuf.BytesValue": "bytes",
}


def schemas(*roots: Any) -> dict[str, dict[str, Any]]:
    """The schema of each message type reachable from ``roots``, keyed by full name.

    A type's schema is ``{"name", "fields": [...], "oneofs": [{"name", "fields"}],
    "tensor"}`` (``tensor``: it follows the data/shape/dtype convention); a
    field is ``{"name", "json_name", "kind", "repeated", "optional", "oneof"}`` plus
    ``"enum": [value names]``, ``"message": full name`` or, for a map, ``"key"`` and
    ``"value"`` (a field-like object without a name). ``kind`` is one of float, int,
    uint, int64, uint64, bool, string, bytes, enum, message, map, json, text.
    """
    found: dict[str, dict[str, Any]] = {}
    pending: list[Descriptor] = list(roots)
    while pending:
        descriptor = pending.pop()
        if descriptor.full_name in found:
            continue
        found[descriptor.full_name] = _message(descriptor, pending)
    return found


def _message(descriptor: Descriptor, pending: list[Descriptor]) -> dict[str, Any]:
    fields = [_field(field, pending) for field in descriptor.fields]
    oneofs = [
        {"name": oneof.name, "fields": [field.name for field in oneof.fields]}
        for oneof in descriptor.oneofs
        if not _synthetic(oneof.name, [field.name for field in oneof.fields])
    ]
    # Tensors (data/shape/dtype) get a values editor on the page instead of base64 bytes.
    return {
        "name": descriptor.full_name,
        "fields": fields,
        "oneofs": oneofs,
        "tensor": is_tensor(descriptor),
    }


def _synthetic(oneof_name: str, field_names: list[str]) -> bool:
    """A proto3 ``optional`` field lives in a oneof of its own named ``_<field>``."""
    return len(field_names) == 1 and oneof_name == f"_{field_names[0]}"


def _field(field: FieldDescriptor, pending: list[Descriptor]) -> dict[str, Any]:
    oneof = field.containing_oneof
    in_real_oneof = oneof is not None and not _synthetic(
        oneof.name, [member.name for member in oneof.fields]
    )
    spec: dict[str, Any] = {
        "name": field.name,
        "json_name": field.json_name,
        "repeated": False,
        # Presence without a oneof: an ``optional`` scalar or a message the form may omit.
        "optional": field.has_presence and not in_real_oneof,
        "oneof": oneof.name if oneof is not None and in_real_oneof else None,
    }
    message = field.message_type
    if field.is_repeated and message is not None and message.GetOptions().map_entry:
        spec["kind"] = "map"
        spec["key"] = _value_spec(message.fields_by_name["key"], pending)
        spec["value"] = _value_spec(message.fields_by_name["value"], pending)
        return spec
    spec["repeated"] = field.is_repeated
    spec.update(_value_spec(field, pending))
    return spec


def _value_spec(field: FieldDescriptor, pending: list[Descriptor]) -> dict[str, Any]:
    """What one value of ``field`` is (its kind, and its enum values or message type)."""
    if field.type == FieldDescriptor.TYPE_ENUM:
        enum_type: Any = field.enum_type
        return {"kind": "enum", "enum": [value.name for value in enum_type.values]}
    message = field.message_type
    if message is None:
        return {"kind": _SCALARS[field.type]}
    name = message.full_name
    if name in _JSON_TYPES:
        return {"kind": "json", "message": name}
    if name in _STRING_TYPES:
        return {"kind": "text", "message": name}
    if name in _WRAPPERS:
        return {"kind": _WRAPPERS[name], "message": name}
    pending.append(message)
    return {"kind": "message", "message": name}
