"""Typed payloads in and out of ``google.protobuf.Any``, and info maps in and out of Struct
and of JSON text (``info_json``: the form that keeps ints ints).

The server, the clients and the console all pack and unpack payloads here, so the
type-url rule lives in one place: we send ``type.googleapis.com/<full message name>``,
and we accept any url whose last path segment is the expected full name (the protobuf
rule for ``Any``: everything up to the last ``/`` is the sender's business).
Packing writes the Any's two fields directly (cheaper than ``Any.Pack``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeVar

from google.protobuf import any_pb2, descriptor_pb2, struct_pb2
from google.protobuf.message import DecodeError, Message

__all__ = [
    "MAX_TYPE_URL_BYTES",
    "TYPE_URL_PREFIX",
    "PayloadError",
    "file_descriptor_set",
    "frame_array",
    "info_from_json",
    "info_from_struct",
    "info_of",
    "info_to_json",
    "info_to_struct",
    "infos_of",
    "pack",
    "type_name",
    "type_url",
    "unpack",
    "value_to_python",
]

#: What we put before the full name in the type urls we send.
TYPE_URL_PREFIX = "type.googleapis.com/"

M = TypeVar("M", bound=Message)


class PayloadError(ValueError):
    """An Any payload is missing, of the wrong type, or undecodable."""


_TYPE_URLS: dict[type[Message], str] = {}

#: Longest ``type_url`` accepted in a payload; a longer one is refused whatever it names.
MAX_TYPE_URL_BYTES = 256


def type_url(message_class: type[Message]) -> str:
    """The type url we send for ``message_class`` (computed once per class: clients pack
    every action through here)."""
    url = _TYPE_URLS.get(message_class)
    if url is None:
        url = _TYPE_URLS[message_class] = TYPE_URL_PREFIX + message_class.DESCRIPTOR.full_name
    return url


def type_name(url: str) -> str:
    """The full message name a type url names: its last path segment ("" for a url
    without a "/", which names nothing)."""
    _, slash, name = url.rpartition("/")
    return name if slash else ""


def pack(message: Message, target: any_pb2.Any | None = None) -> any_pb2.Any:
    """``message`` as an Any (written into ``target`` when given); returns the Any.

    An Any passes through unchanged (copied into ``target``): it is packed already.
    """
    if target is None:
        target = any_pb2.Any()
    if isinstance(message, any_pb2.Any):
        target.CopyFrom(message)
        return target
    target.type_url = type_url(type(message))
    target.value = message.SerializeToString()
    return target


def unpack(payload: any_pb2.Any, message_class: type[M], what: str) -> M:
    """Decode ``payload`` as ``message_class``.

    Raises:
        PayloadError: the url names another type, or the bytes do not parse; ``what``
            names the payload ("action", "reset options", ...) in the message, which also
            names the expected type and the url exactly as received.
    """
    url = payload.type_url
    # The exact url we send first: one dict lookup and a string compare per step.
    if url != type_url(message_class):
        size = len(url.encode())
        if size > MAX_TYPE_URL_BYTES:  # else any prefix before the name would pass
            raise PayloadError(
                f"{what} type_url is {size} bytes; at most {MAX_TYPE_URL_BYTES} are allowed"
            )
        name = message_class.DESCRIPTOR.full_name
        if type_name(url) != name:
            got = repr(url) if url else "nothing"
            raise PayloadError(f"{what} must be {name}, got {got}")
    try:
        return message_class.FromString(payload.value)
    except DecodeError as exc:
        name = message_class.DESCRIPTOR.full_name
        raise PayloadError(f"{what} is not a valid {name}: {exc}") from None


def info_to_struct(info: Mapping[str, Any], target: struct_pb2.Struct) -> None:
    """Copy an env's info map into ``target``; values that JSON cannot hold become strings.

    Nothing is dropped: numpy scalars and arrays go through ``tolist()``, and any other
    object is sent as its ``repr`` rather than failing the step.
    """
    try:
        target.update(info)
    except (TypeError, ValueError):
        target.Clear()
        target.update({str(key): _jsonable(value) for key, value in info.items()})


#: One encoder for every info: compact, and refusing NaN and infinities (JSON has none).
_ENCODE = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def info_to_json(info: Mapping[str, Any]) -> str | None:
    """An env's info map as the text of a JSON object with its types kept (ints of any
    size stay ints), or None when JSON cannot write it: a NaN or an infinity is in it
    (send it as a Struct, which can).

    As for the Struct, nothing is dropped: numpy scalars and arrays go through
    ``tolist()``, keys become strings, any other object is sent as its ``repr``.
    """
    try:
        return _ENCODE(info)
    except ValueError:  # a non-finite float (or a cycle, which the Struct path refuses)
        return None
    except TypeError:  # numpy values, odd keys or objects: convert, then try again
        try:
            return _ENCODE({str(key): _jsonable(value) for key, value in info.items()})
        except ValueError:
            return None


def info_from_json(text: str) -> dict[str, Any]:
    """The info map of a result sent as JSON text (``info_json``), types kept.

    Raises:
        PayloadError: the text is not a JSON object.
    """
    try:
        info = json.loads(text)
    except ValueError as exc:
        raise PayloadError(f"info_json is not valid JSON: {exc}") from None
    if not isinstance(info, dict):
        raise PayloadError(f"info_json must hold a JSON object, got {type(info).__name__}")
    return info


def info_of(struct: struct_pb2.Struct, text: str) -> dict[str, Any]:
    """A result's info: from its JSON text when the server sent it (types kept), else from
    its Struct (a server that predates ``info_json``, or an info holding NaN or infinity).

    Raises:
        PayloadError: the JSON text is not a JSON object.
    """
    return info_from_json(text) if text else info_from_struct(struct)


def infos_of(
    structs: Mapping[int, struct_pb2.Struct], texts: Mapping[int, str]
) -> dict[int, dict[str, Any]]:
    """A vector result's infos by env index, from both its maps (``infos`` and
    ``infos_json``, or their ``final_`` pair): each index is in one of them.

    Raises:
        PayloadError: a JSON text is not a JSON object.
    """
    infos = {index: info_from_struct(info) for index, info in structs.items()}
    for index, text in texts.items():
        infos[index] = info_from_json(text)
    return infos


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    tolist = getattr(value, "tolist", None)  # numpy scalars and arrays
    if callable(tolist):
        return _jsonable(tolist())
    return repr(value)


def info_from_struct(struct: struct_pb2.Struct) -> dict[str, Any]:
    """The info map of a result as plain Python values (NaN and infinities included,
    which JSON-based conversion would refuse)."""
    return {key: value_to_python(value) for key, value in struct.fields.items()}


def value_to_python(value: struct_pb2.Value) -> Any:
    """A ``google.protobuf.Value`` as None, bool, float, str, list or dict."""
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        return value.number_value
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "struct_value":
        return info_from_struct(value.struct_value)
    if kind == "list_value":
        return [value_to_python(item) for item in value.list_value.values]
    return None


def frame_array(frame: Any) -> Any:
    """A rendered image (a ``Frame`` from ``render()``) as a numpy array of dtype uint8,
    shape (height, width, channels), as Gymnasium's ``rgb_array`` render mode gives it.

    Raises:
        ValueError: the frame is text, or its pixels do not fill its shape.
    """
    import numpy as np  # numpy is no core dependency: only this needs it

    if frame.WhichOneof("content") != "image":
        raise ValueError("the frame is text, not an image: read frame.text")
    image = frame.image
    shape = (image.height, image.width, image.channels)
    if len(image.pixels) != image.height * image.width * image.channels:
        raise ValueError(f"{len(image.pixels)} pixel bytes do not fill an image of {shape}")
    return np.frombuffer(image.pixels, dtype=np.uint8).reshape(shape)


def file_descriptor_set(*message_classes: type[Message]) -> descriptor_pb2.FileDescriptorSet:
    """The files defining ``message_classes`` and all they import, dependencies first."""
    result = descriptor_pb2.FileDescriptorSet()
    seen: set[str] = set()

    def add(file: Any) -> None:  # a FileDescriptor (pure-Python or upb)
        if file.name in seen:
            return
        seen.add(file.name)
        for dependency in file.dependencies:
            add(dependency)
        file.CopyToProto(result.file.add())

    for message_class in message_classes:
        add(message_class.DESCRIPTOR.file)
    return result
