"""Errors that name the field: a typed message built with a wrong value says which message,
which field, what was given and what the field takes.

protobuf's own errors name nothing (``EchoAction(message=5)`` raises ``bad argument type
for built-in operation``). :func:`name_field_errors` wraps a generated class's constructor
so its errors are rewritten (typed clients call it on their four message classes, see
``SessionTypes.from_generic``); :func:`set_field` assigns one field the same way, for
code that fills a message from a mapping (the Gymnasium adapters' reset options).

The rewritten errors are :class:`PayloadTypeError` (a ``TypeError``) for a value of the
wrong type and :class:`InvalidRequest` (a ``ValueError``) for one out of range or a field
that does not exist, so code catching protobuf's ``TypeError``/``ValueError`` still works.
"""

from __future__ import annotations

import functools
import reprlib
from collections.abc import Callable
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from openenv_grpc.client.errors import InvalidRequest, OpenEnvError, PayloadTypeError

__all__ = ["expected_value", "field_error", "name_field_errors", "set_field"]

#: Marks a constructor already wrapped, so a class shared by several clients is wrapped once.
_WRAPPED = "__openenv_names_fields__"

# What protobuf raises for a refused value (AttributeError: a Struct given a non-mapping).
_REFUSALS = (TypeError, ValueError, AttributeError)

_SHORT = reprlib.Repr()
_SHORT.maxstring = 40
_SHORT.maxother = 40

_SCALARS = {
    FieldDescriptor.CPPTYPE_INT32: "an int (int32)",
    FieldDescriptor.CPPTYPE_INT64: "an int (int64)",
    FieldDescriptor.CPPTYPE_UINT32: "an int >= 0 (uint32)",
    FieldDescriptor.CPPTYPE_UINT64: "an int >= 0 (uint64)",
    FieldDescriptor.CPPTYPE_DOUBLE: "a number (float or int)",
    FieldDescriptor.CPPTYPE_FLOAT: "a number (float or int)",
    FieldDescriptor.CPPTYPE_BOOL: "a bool",
}


def expected_value(field: FieldDescriptor) -> str:
    """What ``field`` takes, in words: ``"a str"``, ``"a list of int (int32)"``, ...

    Returns:
        A short phrase for an error message.
    """
    message = field.message_type
    if message is not None and message.GetOptions().map_entry:
        key, value = message.fields_by_name["key"], message.fields_by_name["value"]
        return f"a dict of {_singular(key)} to {_singular(value)}"
    if field.is_repeated:
        return f"a list of {_singular(field)}"
    return _singular(field)


def _singular(field: FieldDescriptor) -> str:
    if field.cpp_type == FieldDescriptor.CPPTYPE_STRING:
        return "bytes" if field.type == FieldDescriptor.TYPE_BYTES else "a str"
    enum, message = field.enum_type, field.message_type
    if enum is not None:
        names = [value.name for value in enum.values]
        shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
        return f"a {enum.full_name} value (an int or a name: {shown})"
    if message is not None:
        full_name = message.full_name
        if full_name == "google.protobuf.Struct":
            return "a dict of JSON-like values"
        return f"a {full_name} message (or a dict of its fields)"
    return _SCALARS.get(field.cpp_type, "a value of the field's type")


def field_error(descriptor: Any, name: str, value: object, cause: Exception) -> OpenEnvError:
    """The error naming the field ``name`` of the message ``descriptor`` (a protobuf
    ``Descriptor``) that refused ``value``.

    Returns:
        :class:`PayloadTypeError` when ``cause`` is a ``TypeError`` or ``AttributeError``
        (the value's type is wrong), else :class:`InvalidRequest` (out of range, or no such field).
    """
    field = descriptor.fields_by_name.get(name)
    if field is None:
        fields = ", ".join(descriptor.fields_by_name) or "none"
        return InvalidRequest(f"{descriptor.name} has no field {name!r} (its fields: {fields})")
    given = f"{type(value).__name__} {_SHORT.repr(value)}"
    text = f"{descriptor.name}.{name} takes {expected_value(field)}, got {given}"
    if isinstance(cause, (TypeError, AttributeError)):
        return PayloadTypeError(text)
    return InvalidRequest(f"{text} ({cause})")


def set_field(message: Message, name: str, value: object) -> None:
    """Set ``message.name`` to ``value`` (a scalar, or a message/dict for a message field).

    Raises:
        PayloadTypeError: the value's type does not fit the field.
        InvalidRequest: the value is out of the field's range, or there is no such field.
    """
    descriptor = message.DESCRIPTOR
    field = descriptor.fields_by_name.get(name)
    try:
        if field is None:
            raise ValueError(name)
        if field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE or field.is_repeated:
            # Message and repeated fields cannot be assigned: build the value alone first.
            built = type(message)(**{name: value})
            message.ClearField(name)
            message.MergeFrom(built)
        else:
            setattr(message, name, value)
    except (PayloadTypeError, InvalidRequest):
        raise  # already named, by the wrapped constructor
    except _REFUSALS as exc:
        raise field_error(descriptor, name, value, exc) from exc


def name_field_errors(message_class: type[Message]) -> None:
    """Wrap ``message_class``'s constructor so a bad keyword names its field (once per
    class; later calls do nothing). Construction that succeeds is unchanged.

    Raises:
        Nothing itself; the wrapped constructor raises :class:`PayloadTypeError` or
        :class:`InvalidRequest` (see :func:`field_error`) where protobuf raised a bare
        ``TypeError`` or ``ValueError`` for a keyword argument.
    """
    original: Callable[..., None] = message_class.__init__
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def __init__(self: Message, *args: Any, **kwargs: Any) -> None:
        try:
            original(self, *args, **kwargs)
        except _REFUSALS as exc:
            named = _named(message_class, original, kwargs)
            if named is None:
                raise
            raise named from exc

    setattr(__init__, _WRAPPED, True)
    # Generated classes take new attributes like any class; subclassing them is refused.
    setattr(message_class, "__init__", __init__)  # noqa: B010


def _named(
    message_class: type[Message],
    original: Callable[..., None],
    kwargs: dict[str, Any],
) -> OpenEnvError | None:
    """The named error for the first keyword that fails alone, else None (positional
    arguments, or a failure no single field explains)."""
    for name, value in kwargs.items():
        try:
            original(message_class(), **{name: value})
        except _REFUSALS as exc:
            return field_error(message_class.DESCRIPTOR, name, value, exc)
    return None
