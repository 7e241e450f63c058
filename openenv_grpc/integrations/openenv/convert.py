"""Values between pydantic models and the messages :mod:`.schema` made for them.

``to_message`` reads the model's attributes (so enums, nested models and bytes keep
their types); ``to_python`` returns plain data for ``Model.model_validate``, leaving out
what the client did not set so that pydantic's defaults and required checks apply.
JSON fields (see :mod:`.schema`) hold ``json.dumps`` of the value as pydantic serializes
it by field name, as OpenEnv's ``model_dump()`` does; they are read back with
``json.loads``, so ints stay ints (of any size) and floats floats. What the bridge could
not carry back is refused on the way in and replaced on the way out
(:mod:`.json_checks`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pydantic_core
from google.protobuf.message import Message
from pydantic import BaseModel

from openenv_grpc.integrations.openenv.json_checks import (
    Warnings,
    check_in,
    fallback,
    has_lone_surrogate,
    safe_dumps,
)
from openenv_grpc.integrations.openenv.schema import JSON, FieldPlan, ModelPlan, UnionPlan

__all__ = ["from_data", "jsonable", "loads", "to_message", "to_python"]


def to_message(
    plan: ModelPlan | UnionPlan,
    value: BaseModel,
    warnings: Warnings | None = None,
    where: str = "observation",
) -> Message:
    """A new message of ``plan``'s class holding ``value``; what protobuf or JSON cannot
    hold (a lone surrogate, NaN in a JSON field, a value nested too deep) is left unset or
    written as null, and noted in ``warnings`` as ``where.field: ...``.

    Raises:
        TypeError: ``value`` is none of the models ``plan`` holds.
    """
    assert plan.message_class is not None
    noted = Warnings() if warnings is None else warnings
    message = plan.message_class()
    if isinstance(plan, UnionPlan):
        name, member = _member_for(plan, value)
        _fill(getattr(message, name), member, value, where, noted)
        getattr(message, name).SetInParent()
    else:
        if not isinstance(value, plan.python):
            raise TypeError(f"expected a {plan.python.__name__}, got {type(value).__name__}")
        _fill(message, plan, value, where, noted)
    return message


def from_data(plan: ModelPlan, data: Mapping[str, Any]) -> Message:
    """A new message of ``plan``'s class holding plain ``data`` (reset keyword arguments)."""
    assert plan.message_class is not None
    message = plan.message_class()
    _fill(message, plan, data, "options", Warnings())
    return message


def to_python(
    plan: ModelPlan | UnionPlan, message: Message
) -> tuple[type[BaseModel], dict[str, Any]]:
    """The model class to validate with and the data of ``message``.

    Raises:
        ValueError: a union message holds none of its members.
    """
    if isinstance(plan, UnionPlan):
        chosen = message.WhichOneof("kind")
        for name, member in plan.members:
            if name == chosen:
                return member.python, _read(getattr(message, name), member)
        names = ", ".join(name for name, _ in plan.members)
        raise ValueError(f"{plan.name} must set one of: {names}")
    return plan.python, _read(message, plan)


def jsonable(value: Any) -> Any:
    """``value`` as JSON data, as pydantic's ``model_dump(mode="json")`` serializes it:
    models by field name (``meta``, not its alias ``_meta``), dataclasses, enums,
    datetimes...; what pydantic cannot serialize becomes its ``tolist()`` or ``repr``."""
    return pydantic_core.to_jsonable_python(value, by_alias=False, fallback=fallback)


def loads(text: str, name: str) -> Any:
    """The JSON text of field ``name``, checked as :func:`.json_checks.check_in` does.

    Raises:
        ValueError: it is not JSON, is nested too deep or holds a lone surrogate (the
            message names the field).
    """
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{name}: not JSON text ({exc})") from None
    check_in(value, name)
    return value


def _member_for(plan: UnionPlan, value: BaseModel) -> tuple[str, ModelPlan]:
    """The union member for ``value``: its own class, else its nearest base."""
    for klass in type(value).__mro__:
        for name, member in plan.members:
            if member.python is klass:
                return name, member
    names = ", ".join(member.python.__name__ for _, member in plan.members)
    raise TypeError(f"{type(value).__name__} is none of {names}")


# -- python -> message -------------------------------------------------------------------


def _fill(message: Message, plan: ModelPlan, value: Any, where: str, warnings: Warnings) -> None:
    mapping = isinstance(value, Mapping)
    for field in plan.fields:
        item = value.get(field.name) if mapping else getattr(value, field.name)
        if item is not None:
            _set(message, field, item, f"{where}.{field.name}", warnings)


def _set(message: Message, field: FieldPlan, value: Any, where: str, warnings: Warnings) -> None:
    if field.single:  # the common case first, with no call it does not need
        if not isinstance(value, str) or value.isascii() or _writable(value, where, warnings):
            setattr(message, field.proto, _scalar_out(field, value))
        return
    target = getattr(message, field.proto)
    if field.kind == JSON:
        # Set even when empty: {} arrives as {}, not unset.
        target.json = safe_dumps(value, where, warnings)
    elif field.map:
        for key, item in value.items():
            at = f"{where}[{key!r}]"
            if isinstance(key, str) and has_lone_surrogate(key):
                warnings.add(at, "a key with a lone surrogate is left out")
            elif field.kind == "message":
                assert field.model is not None
                _fill(target[key], field.model, item, at, warnings)
                target[key].SetInParent()
            elif _writable(item, at, warnings):
                target[key] = _scalar_out(field, item)
    elif field.repeated:
        for index, item in enumerate(value):
            at = f"{where}[{index}]"
            if field.kind == "message":
                assert field.model is not None
                _fill(target.add(), field.model, item, at, warnings)
            elif _writable(item, at, warnings):
                target.append(_scalar_out(field, item))
            else:
                target.append(_scalar_out(field, ""))  # keep the list's positions
    elif field.kind == "message":
        assert field.model is not None
        target.SetInParent()
        _fill(target, field.model, value, where, warnings)
    elif _writable(value, where, warnings):
        setattr(message, field.proto, _scalar_out(field, value))


def _writable(value: Any, where: str, warnings: Warnings) -> bool:
    """False (noted) for a string protobuf cannot hold: one with a lone surrogate."""
    if isinstance(value, str) and has_lone_surrogate(value):
        warnings.add(where, "a lone surrogate is not Unicode text")
        return False
    return True


def _scalar_out(field: FieldPlan, value: Any) -> Any:
    if field.enum is not None:
        return field.enum.number(value)
    return value


# -- message -> python -------------------------------------------------------------------


def _read(message: Message, plan: ModelPlan) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for field in plan.fields:
        target = getattr(message, field.proto)
        if field.map:
            mapping = {key: _item_in(field, item) for key, item in target.items()}
            if mapping or field.required:
                data[field.name] = mapping
        elif field.repeated:
            items = [_item_in(field, item) for item in target]
            if items or field.required:
                data[field.name] = items
        elif field.kind == JSON:
            if target.json:  # "" (or unset): absent; the text "null" is None
                data[field.name] = _item_in(field, target)
        elif message.HasField(field.proto):
            item = _item_in(field, target)
            if item is not None:  # enum 0 ("unspecified"): as if unset
                data[field.name] = item
    return data


def _item_in(field: FieldPlan, item: Any) -> Any:
    if field.kind == JSON:
        return loads(item.json, field.proto)
    if field.kind == "message":
        assert field.model is not None
        return _read(item, field.model)
    if field.enum is not None:
        member = field.enum.member(item)
        return None if member is None else member.value
    return item
