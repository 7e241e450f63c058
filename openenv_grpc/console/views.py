"""Messages as the console's page shows them: JSON with images, tensors and bytes marked.

Generic for every env: a sub-message with ``data`` (bytes), ``shape`` (repeated integers)
and ``dtype`` (string) fields is a tensor, and a uint8 tensor shaped like a picture
(HxW, or HxWxC with 1, 3 or 4 channels) becomes a PNG the page shows as an image; other
small tensors become their numbers. Unset proto3 scalars show their defaults (a reward
of 0 or ``won: false`` is information), unset sub-messages are left out.
"""

from __future__ import annotations

import base64
import io
import math
from typing import Any

from google.protobuf import json_format, struct_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from openenv_grpc.codec import info_from_struct, value_to_python
from openenv_grpc.console.tensors import decode, is_tensor

__all__ = ["image_png", "json_safe", "to_view"]

#: Bytes fields show at most this many bytes (as base64) besides their size.
_MAX_BYTES_SHOWN = 1024
#: JavaScript numbers hold integers exactly up to 2**53; larger ones travel as strings.
_SAFE_INTEGER = 2**53
_WELL_KNOWN_PREFIX = "google.protobuf."


def to_view(message: Message) -> dict[str, Any]:
    """``message`` as a JSON-ready dict for display (see the module docstring)."""
    return _message(message)


def json_safe(value: Any) -> Any:
    """Plain Python data (a step's info map) made strict-JSON safe: non-finite floats and
    integers beyond 2**53 become strings, tuples lists, other objects their ``repr``."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, int):
        return value if abs(value) <= _SAFE_INTEGER else str(value)
    if isinstance(value, dict):
        return {str(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return repr(value)


def _message(message: Message) -> dict[str, Any]:
    descriptor: Any = message.DESCRIPTOR  # pure-Python or upb descriptor
    tensor = _tensor(message, descriptor)
    if tensor is not None:
        return tensor
    view: dict[str, Any] = {}
    for field in descriptor.fields:
        if field.is_repeated:
            values = getattr(message, field.name)
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                value_field = field.message_type.fields_by_name["value"]
                view[field.name] = {str(k): _value(value_field, v) for k, v in values.items()}
            else:
                view[field.name] = [_value(field, v) for v in values]
        elif field.message_type is not None or field.containing_oneof is not None:
            if message.HasField(field.name):
                view[field.name] = _value(field, getattr(message, field.name))
        else:
            view[field.name] = _value(field, getattr(message, field.name))
    return view


def _value(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_ENUM:
        enum_type: Any = field.enum_type
        found = enum_type.values_by_number.get(value)
        return found.name if found is not None else value
    if field.type == FieldDescriptor.TYPE_BYTES:
        return _bytes(value)
    if isinstance(value, Message):
        if value.DESCRIPTOR.full_name.startswith(_WELL_KNOWN_PREFIX):
            return _well_known(value)
        return _message(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)  # JSON has no NaN or inf
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _SAFE_INTEGER:
        return str(value)
    return value


def _well_known(value: Message) -> Any:
    # Struct-like values directly: json_format refuses NaN and infinities in them.
    if isinstance(value, struct_pb2.Struct):
        return json_safe(info_from_struct(value))
    if isinstance(value, struct_pb2.Value):
        return json_safe(value_to_python(value))
    if isinstance(value, struct_pb2.ListValue):
        return [json_safe(value_to_python(item)) for item in value.values]
    try:
        return json_format.MessageToDict(value, preserving_proto_field_name=True)
    except (TypeError, ValueError, KeyError):  # e.g. an Any of a type this process lacks
        return {"$unreadable": value.DESCRIPTOR.full_name}


def _bytes(value: bytes) -> dict[str, Any]:
    shown = base64.b64encode(value[:_MAX_BYTES_SHOWN]).decode()
    return {"$bytes": {"size": len(value), "base64": shown}}


def _tensor(message: Message, descriptor: Any) -> dict[str, Any] | None:
    """A tensor-shaped message (data, shape, dtype) as an image or its values; else None."""
    if not is_tensor(descriptor):
        return None
    tensor: Any = message  # generated or dynamic class: no attributes known statically
    raw: bytes = tensor.data
    dims = [int(d) for d in tensor.shape]
    kind: str = tensor.dtype
    png = image_png(raw, dims, kind)
    if png is not None:
        encoded = base64.b64encode(png).decode()
        return {"$image": {"shape": dims, "dtype": kind, "png": encoded}}
    view: dict[str, Any] = {"shape": dims, "dtype": kind, "size": len(raw)}
    values = decode(raw, kind, dims)  # None unless the shape holds the bytes
    if values is not None:
        view["values"] = values
    return {"$tensor": view}


def image_png(raw: bytes, dims: list[int], dtype: str) -> bytes | None:
    """A PNG of a uint8 picture-shaped tensor (HxW, HxWx1/3/4, at least 8x8 pixels); None
    for anything else or when Pillow (the console extra) is missing."""
    if dtype != "uint8" or len(dims) not in (2, 3):
        return None
    height, width = dims[0], dims[1]
    channels = dims[2] if len(dims) == 3 else 1
    modes = {1: "L", 3: "RGB", 4: "RGBA"}
    if channels not in modes or min(height, width) < 8 or len(raw) != height * width * channels:
        return None
    try:
        from PIL import Image
    except ImportError:
        return None
    picture = Image.frombytes(modes[channels], (width, height), raw)
    out = io.BytesIO()
    picture.save(out, format="PNG", compress_level=1)  # speed over size: one per step
    return out.getvalue()
