"""Protobuf message types made at start-up from an OpenEnv env's pydantic models.

One ``.proto`` file per served env is built as a ``FileDescriptorProto`` (no ``.proto``
text, no protoc), added to the default descriptor pool (so server reflection finds it)
and turned into message classes. The env's Info then carries it like any other env's
file, and clients in any language decode it from there.

How a pydantic field's type becomes a protobuf field:

============================================  =========================================
pydantic                                      protobuf
============================================  =========================================
``str``, ``bool``, ``int``, ``float``,        ``string``, ``bool``, ``int64``, ``double``,
``bytes``; ``int | float``                    ``bytes``; ``double``
``Literal["a", "b"]`` (``Literal[1, 2]``)     ``string`` (``int64``)
an ``Enum`` subclass                          an enum (``<ENUM>_UNSPECIFIED = 0``, then
                                              the members in order)
a ``BaseModel`` subclass                      a message of its own, in the same file
``list[X]``, ``tuple[X, ...]``, ``set[X]``    ``repeated X`` (X one of the above)
``dict[str, X]``                              ``map<string, X>`` (X one of the above)
``Optional[X]`` (``X | None``)                X with presence (``optional``)
anything else: ``dict[str, Any]``, ``Any``,   ``openenv_grpc.openenv.v1.Json``: a message
other unions, nested containers               whose ``json`` string is the value as JSON
(``list[list[int]]``), fixed tuples,          text (``pydantic_core.to_jsonable_python``,
``datetime``, arrays, arbitrary types         then ``json.dumps``)
============================================  =========================================

Every singular scalar and enum field is ``optional`` (has presence), so a field the
client leaves unset reaches pydantic as *absent*: its default applies, or a required
field is reported missing, exactly as OpenEnv's JSON would. JSON is the fallback where
protobuf has no faithful type: a union's members cannot be told apart on the wire
without a tag pydantic does not declare, and repeated/map fields cannot nest.

Why JSON *text* and not ``google.protobuf.Struct`` / ``Value``: a Value's numbers are
doubles, so every int became a float on the way (an MCP tool argument ``5`` reached the
tool as ``5.0``, an index ``1`` could not index) and ints beyond 2**53 lost digits. JSON
text keeps what OpenEnv's own JSON carries -- ints as ints of any size, floats as floats
(``1.0`` stays ``1.0``), null, bool, str, list, dict -- and every language parses it. The
text sits in a message of its own type (not a bare ``string``) so that a client reading
only the descriptors (Node, Go, the console, TRL's tools) can tell a JSON field from a
string field by its type name, :data:`JSON_TYPE`.

A pydantic field whose name is also a method or attribute of protobuf's Python message
classes (``SerializeToString``, ``Clear``, ``DESCRIPTOR``, ``X_FIELD_NUMBER``...) would
shadow it in the generated class and break every Python client. Such a field is named
``<name>_`` in the message (more underscores until the name is free); the plan maps it
back to the pydantic name, so the env sees its own field.
"""

from __future__ import annotations

import collections.abc
import enum
import inspect
import keyword
import re
import types
import typing
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from google.protobuf import descriptor_pb2, descriptor_pool, empty_pb2, message_factory
from google.protobuf.message import Message
from pydantic import BaseModel

__all__ = [
    "JSON",
    "JSON_MESSAGE",
    "JSON_TYPE",
    "EnumPlan",
    "FieldPlan",
    "ModelPlan",
    "SchemaBuilder",
    "UnionPlan",
    "proto_field_name",
]

F = descriptor_pb2.FieldDescriptorProto
_SCALARS: dict[Any, int] = {
    str: F.TYPE_STRING,
    bool: F.TYPE_BOOL,
    int: F.TYPE_INT64,
    float: F.TYPE_DOUBLE,
    bytes: F.TYPE_BYTES,
}
_SEQUENCES = (list, tuple, set, frozenset, collections.abc.Sequence, collections.abc.Set)
_MAPPINGS = (dict, collections.abc.Mapping, collections.abc.MutableMapping)
JSON = "json"  # kind of a JSON-text field (dict[str, Any], Any, nested containers...)

#: The one message type of every JSON field: ``message Json { string json = 1; }``, in a
#: file of its own that every bridged env's file imports (Info carries it with them).
JSON_TYPE = "openenv_grpc.openenv.v1.Json"
_JSON_FILE = "openenv_grpc/openenv/v1/json.proto"


def _json_message() -> type[Message]:
    pool = descriptor_pool.Default()
    try:
        descriptor = pool.FindMessageTypeByName(JSON_TYPE)
    except KeyError:
        file = descriptor_pb2.FileDescriptorProto(
            name=_JSON_FILE, package=JSON_TYPE.rpartition(".")[0], syntax="proto3"
        )
        message = file.message_type.add(name="Json")
        message.field.add(name="json", number=1, label=F.LABEL_OPTIONAL, type=F.TYPE_STRING)
        pool.Add(file)
        descriptor = pool.FindMessageTypeByName(JSON_TYPE)
    return message_factory.GetMessageClass(descriptor)


#: The class of :data:`JSON_TYPE` (its ``json`` field holds the JSON text).
JSON_MESSAGE = _json_message()

#: Names a field of a Python message class cannot have: they would shadow the class's
#: own methods and attributes.
_TAKEN = frozenset(name for name in dir(empty_pb2.Empty) if not name.startswith("__"))


def proto_field_name(name: str, taken: set[str]) -> str:
    """``name`` as a message field: with ``_`` appended while it would shadow a protobuf
    message attribute or repeat a field of ``taken`` (deterministic: the same model gives
    the same names in every process)."""
    candidate = name
    while (
        candidate in _TAKEN
        or candidate.endswith("_FIELD_NUMBER")
        or keyword.iskeyword(candidate)
        or candidate in taken
    ):
        candidate += "_"
    taken.add(candidate)
    return candidate


@dataclass(eq=False)
class EnumPlan:
    """A Python enum as a protobuf enum: member i is number i + 1 (0 is "unspecified")."""

    python: type[enum.Enum]
    name: str
    members: list[enum.Enum]

    def number(self, value: Any) -> int:
        member = value if isinstance(value, self.python) else self.python(value)
        return self.members.index(member) + 1

    def member(self, number: int) -> enum.Enum | None:
        return self.members[number - 1] if 0 < number <= len(self.members) else None


@dataclass(eq=False)
class FieldPlan:
    """One field: its protobuf shape and what to convert its values with."""

    name: str  # the pydantic field's (or reset parameter's) name
    number: int
    kind: str  # "scalar", "enum", "message" or JSON
    scalar: int = 0  # FieldDescriptorProto.TYPE_* of a scalar
    enum: EnumPlan | None = None
    model: ModelPlan | None = None
    repeated: bool = False
    map: bool = False  # map<string, X>: X is scalar, enum or message
    required: bool = False  # pydantic requires it (no default)
    proto: str = ""  # the message field's name: ``name`` unless that would shadow a method
    #: One scalar or enum value (not a list, a map, a message or JSON).
    single: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.proto = self.proto or self.name
        self.single = self.kind in ("scalar", "enum") and not (self.repeated or self.map)


@dataclass(eq=False)
class ModelPlan:
    """A pydantic model as one message; ``exclude`` names fields that live elsewhere
    (an observation's reward, done and metadata go in the result's own fields)."""

    python: type[BaseModel]
    name: str
    fields: list[FieldPlan] = field(default_factory=list)
    message_class: type[Message] | None = None


@dataclass(eq=False)
class UnionPlan:
    """Several models as one message with a ``oneof kind`` of one field per model (the
    tools surface of an MCP env: list_tools or call_tool)."""

    name: str
    members: list[tuple[str, ModelPlan]]
    message_class: type[Message] | None = None


Plan = ModelPlan | UnionPlan


class SchemaBuilder:
    """Builds one file of messages; :meth:`build` adds it to the pool and fills in the
    plans' message classes."""

    def __init__(self, file_name: str, package: str) -> None:
        self.file = descriptor_pb2.FileDescriptorProto(
            name=file_name, package=package, syntax="proto3"
        )
        self.file.dependency.append(_JSON_FILE)
        self._names: set[str] = set()
        self._models: dict[tuple[type[BaseModel], frozenset[str]], ModelPlan] = {}
        self._enums: dict[type[enum.Enum], EnumPlan] = {}
        self._plans: list[Plan] = []

    # -- what an env needs ----------------------------------------------------------

    def model(self, python: type[BaseModel], exclude: frozenset[str] = frozenset()) -> ModelPlan:
        """The message of ``python`` (made once per model and exclusion set)."""
        key = (python, exclude)
        known = self._models.get(key)
        if known is not None:
            return known
        plan = ModelPlan(python, self._unique(python.__name__))
        self._models[key] = plan  # before the fields: a model may refer to itself
        self._plans.append(plan)
        message = self.file.message_type.add(name=plan.name)
        names = [name for name in python.model_fields if name not in exclude]
        taken = {name for name in names if proto_field_name(name, set()) == name}
        for number, name in enumerate(names, start=1):
            info = python.model_fields[name]
            plan.fields.append(
                self._field(message, name, number, info.annotation, info.is_required(), taken)
            )
        return plan

    def union(
        self, name: str, members: list[type[BaseModel]], exclude: frozenset[str]
    ) -> UnionPlan:
        """One message holding any of ``members`` (a ``oneof kind``)."""
        plans = [self.model(member, exclude) for member in members]
        plan = UnionPlan(self._unique(name), [(_snake(p.name), p) for p in plans])
        self._plans.append(plan)
        message = self.file.message_type.add(name=plan.name)
        message.oneof_decl.add(name="kind")
        for number, (field_name, member) in enumerate(plan.members, start=1):
            message.field.add(
                name=field_name, number=number, label=F.LABEL_OPTIONAL, type=F.TYPE_MESSAGE,
                type_name=self._type_name(member.name), oneof_index=0,
            )  # fmt: skip
        return plan

    def parameters(
        self,
        name: str,
        parameters: list[inspect.Parameter],
        hints: dict[str, Any],
        var_keyword: bool,
    ) -> ModelPlan:
        """A message of keyword arguments (reset options); ``var_keyword`` adds a Struct
        field ``kwargs`` for a ``**kwargs`` parameter."""
        plan = ModelPlan(BaseModel, self._unique(name))
        self._plans.append(plan)
        message = self.file.message_type.add(name=plan.name)
        number = 0
        names = [p.name for p in parameters]
        if var_keyword:
            names.append("kwargs" if "kwargs" not in names else "extra_kwargs")
        taken = {name for name in names if proto_field_name(name, set()) == name}
        for parameter in parameters:
            number += 1
            annotation = hints.get(parameter.name, Any)
            required = parameter.default is inspect.Parameter.empty
            plan.fields.append(
                self._field(message, parameter.name, number, annotation, required, taken)
            )
        if var_keyword:
            plan.fields.append(
                self._field(message, names[-1], number + 1, dict[str, Any], False, taken)
            )
        return plan

    def build(self) -> descriptor_pb2.FileDescriptorProto:
        """Add the file to the default pool (reflection serves it from there) and make the
        message classes.

        Raises:
            TypeError: the pool refused the file (a name clash with another file).
        """
        for message in self.file.message_type:
            _distinct_json_names(message)
        pool = descriptor_pool.Default()
        try:
            pool.Add(self.file)
        except TypeError as exc:
            raise TypeError(f"cannot add {self.file.name} to the descriptor pool: {exc}") from exc
        for plan in self._plans:
            full_name = f"{self.file.package}.{plan.name}"
            plan.message_class = message_factory.GetMessageClass(
                pool.FindMessageTypeByName(full_name)
            )
        return self.file

    # -- fields -----------------------------------------------------------------------

    def _field(
        self,
        message: descriptor_pb2.DescriptorProto,
        name: str,
        number: int,
        annotation: Any,
        required: bool,
        taken: set[str],
    ) -> FieldPlan:
        annotation, optional = _strip_optional(annotation)
        plan = self._shape(name, number, annotation)
        plan.required = required and not optional
        if proto_field_name(name, set()) != name:
            plan.proto = proto_field_name(name, taken)
        name = plan.proto
        proto = message.field.add(name=name, number=number, label=F.LABEL_OPTIONAL)
        if plan.map:
            entry = message.nested_type.add(name=f"{_camel(name)}Entry")
            entry.options.map_entry = True
            entry.field.add(name="key", number=1, label=F.LABEL_OPTIONAL, type=F.TYPE_STRING)
            value = entry.field.add(name="value", number=2, label=F.LABEL_OPTIONAL)
            self._set_type(value, plan)
            proto.label = F.LABEL_REPEATED
            proto.type = F.TYPE_MESSAGE
            proto.type_name = f"{self._type_name(message.name)}.{entry.name}"
            return plan
        self._set_type(proto, plan)
        if plan.repeated:
            proto.label = F.LABEL_REPEATED
        elif plan.kind in ("scalar", "enum"):
            # proto3 `optional`: presence, in a synthetic oneof of its own.
            proto.proto3_optional = True
            proto.oneof_index = len(message.oneof_decl)
            message.oneof_decl.add(name=f"_{name}")
        return plan

    def _shape(self, name: str, number: int, annotation: Any) -> FieldPlan:
        """What ``annotation`` (no longer Optional) becomes; JSON where nothing fits."""
        single = self._single(name, number, annotation)
        if single is not None:
            return single
        origin = typing.get_origin(annotation) or annotation
        args = typing.get_args(annotation)
        if origin in _SEQUENCES:
            if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
                args = ()  # a fixed-length tuple has no repeated form
            item = self._single(name, number, args[0]) if len(args) in (1, 2) else None
            if item is not None:
                return replace(item, repeated=True)
        elif origin in _MAPPINGS and (not args or args[0] is str):
            value = self._single(name, number, args[1]) if args else None
            if value is not None:
                return replace(value, map=True)
        return FieldPlan(name, number, JSON)

    def _single(self, name: str, number: int, annotation: Any) -> FieldPlan | None:
        """A scalar, enum or model type as a singular field; None for anything else."""
        if annotation in _SCALARS:
            return FieldPlan(name, number, "scalar", scalar=_SCALARS[annotation])
        if _is_number_union(annotation):
            return FieldPlan(name, number, "scalar", scalar=F.TYPE_DOUBLE)
        if typing.get_origin(annotation) is Literal:
            values = typing.get_args(annotation)
            kinds = {type(v) for v in values}
            if len(kinds) == 1 and kinds.pop() in (str, int, bool):
                return FieldPlan(name, number, "scalar", scalar=_SCALARS[type(values[0])])
            return None
        if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
            return FieldPlan(name, number, "enum", enum=self._enum(annotation))
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return FieldPlan(name, number, "message", model=self.model(annotation))
        return None

    def _set_type(self, proto: descriptor_pb2.FieldDescriptorProto, plan: FieldPlan) -> None:
        if plan.kind == "scalar":
            proto.type = plan.scalar  # type: ignore[assignment]
        elif plan.kind == "enum":
            assert plan.enum is not None
            proto.type = F.TYPE_ENUM
            proto.type_name = self._type_name(plan.enum.name)
        elif plan.kind == "message":
            assert plan.model is not None
            proto.type = F.TYPE_MESSAGE
            proto.type_name = self._type_name(plan.model.name)
        else:
            proto.type = F.TYPE_MESSAGE
            proto.type_name = f".{JSON_TYPE}"

    def _enum(self, python: type[enum.Enum]) -> EnumPlan:
        known = self._enums.get(python)
        if known is not None:
            return known
        plan = EnumPlan(python, self._unique(python.__name__), list(python))
        self._enums[python] = plan
        proto = self.file.enum_type.add(name=plan.name)
        # Enum values are scoped like siblings of the enum: prefix them, as buf asks.
        prefix = _snake(plan.name).upper()
        proto.value.add(name=f"{prefix}_UNSPECIFIED", number=0)
        for number, member in enumerate(plan.members, start=1):
            proto.value.add(name=f"{prefix}_{_snake(member.name).upper()}", number=number)
        return plan

    def _unique(self, name: str) -> str:
        candidate, n = name, 1
        while candidate in self._names:
            n += 1
            candidate = f"{name}{n}"
        self._names.add(candidate)
        return candidate

    def _type_name(self, name: str) -> str:
        return f".{self.file.package}.{name}"


def _distinct_json_names(message: descriptor_pb2.DescriptorProto) -> None:
    """Fields whose default JSON names collide (``a_b`` and ``aB``, ``Clear_`` and
    ``Clear__``: protobuf drops underscores) keep their own names in JSON; else protobuf
    refuses the file."""
    seen: dict[str, int] = {}
    for proto in message.field:
        seen[_default_json_name(proto.name)] = seen.get(_default_json_name(proto.name), 0) + 1
    for proto in message.field:
        if seen[_default_json_name(proto.name)] > 1:
            proto.json_name = proto.name
    for nested in message.nested_type:
        _distinct_json_names(nested)


def _default_json_name(name: str) -> str:
    """protoc's ToJsonName: underscores dropped, the letter after one capitalized."""
    out, upper = [], False
    for char in name:
        if char == "_":
            upper = True
        else:
            out.append(char.upper() if upper else char)
            upper = False
    return "".join(out)


def _strip_optional(annotation: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); ``Annotated[X, ...]`` -> X."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        if len(args) == 1:
            return _strip_optional(args[0])[0], optional
        return typing.Union[tuple(args)], optional  # noqa: UP007 -- rebuilt from a tuple
    return annotation, False


def _is_number_union(annotation: Any) -> bool:
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return False
    return set(typing.get_args(annotation)) <= {int, float}


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))
