"""A batch's outcome in the columns of a ``VectorResult``, and the frames between the
front and an env process (``--isolated``).

The front sends a sub-batch's call (:func:`command_frame`) as JSON with blobs beside it,
never a pickle: only what it checked or chose (decoded messages, by their type's name and
bytes; ids; a snapshot's authenticated env bytes and phase), and reading it back builds
nothing but JSON data, bytes, messages and the records :data:`_RECORDS` names. The env
process answers by the type of what its batch returned (:func:`fill_answer`), in a
``VectorSessionResponse``: infos as JSON text where JSON can write them, ``episode_ids``
only for the episodes it autoreset.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import struct
from collections.abc import Sequence
from typing import Any

from google.protobuf import any_pb2, descriptor_pool, message_factory, struct_pb2
from google.protobuf.message import Message

from openenv_grpc.codec import info_from_json, info_to_json, info_to_struct
from openenv_grpc.server.errors import RowError
from openenv_grpc.server.local.batch import Autoresets, BatchOutcome
from openenv_grpc.server.model.queries import BatchStates
from openenv_grpc.v1 import session_pb2 as pb

__all__ = [
    "ROOM",
    "command_frame",
    "fill_answer",
    "fill_errors",
    "fill_result",
    "fill_states",
    "info_text",
    "know_messages",
    "read_answer",
    "read_command",
    "read_errors",
    "read_outcome",
    "struct_info",
]

#: A query's room (before its frame), and the bytes an env process read past it.
ROOM = struct.Struct("<Q")


#: The classes of records a frame may carry, by name: nothing else is rebuilt from one.
_RECORDS: dict[str, type] = {"Autoresets": Autoresets}
#: A record class's field names and its default instance (sent without fields, and read
#: back as this one instance).
_FIELDS: dict[type, tuple[tuple[str, ...], Any]] = {
    kind: (tuple(f.name for f in dataclasses.fields(kind)), kind()) for kind in _RECORDS.values()
}
#: What JSON writes and reads back as it is (a list of only these is sent as it is).
_PLAIN = frozenset({int, str, bool, float, type(None)})
#: A frame's head: the length of its JSON part (the blobs follow it).
_FRAME_HEAD = struct.Struct("<I")


class _Writer:
    """A value as JSON data, with bytes and messages as blobs after it (each named by its
    offset and length). Only the front's own values are written (decoded messages, ids,
    seeds, authenticated snapshot bytes): a type it does not know is a bug (TypeError)."""

    __slots__ = ("blobs", "size")

    def __init__(self) -> None:
        self.blobs: list[bytes] = []
        self.size = 0

    def blob(self, data: bytes) -> list[int]:
        at = self.size
        self.blobs.append(data)
        self.size += len(data)
        return [at, len(data)]

    def value(self, value: Any) -> Any:
        kind = type(value)
        if kind in _PLAIN:
            return value
        if kind is range:
            return list(value)
        if kind is list or kind is tuple:
            kinds = set(map(type, value))
            if kinds <= _PLAIN:
                return value
            if len(kinds) == 1 and issubclass(first := kinds.pop(), Message):
                datas = list(map(first.SerializeToString, value))
                sizes = list(map(len, datas))
                at = self.size
                self.blobs += datas
                self.size += sum(sizes)
                return {"ms": _name(first), "at": at, "n": sizes}
            return {"l": [self.value(one) for one in value]}
        if kind is bytes or kind is bytearray:
            return {"b": self.blob(bytes(value))}
        if isinstance(value, dict):
            return {"d": [[self.value(key), self.value(one)] for key, one in value.items()]}
        if isinstance(value, Message):
            return {"m": _name(kind), "b": self.blob(value.SerializeToString())}
        known = _FIELDS.get(kind)
        if known is None:
            raise TypeError(f"a frame cannot carry a {kind.__qualname__}")
        names, default = known
        if value == default:  # the common case (a step without autoresets): no fields
            return {"r": kind.__name__, "f": {}}
        return {"r": kind.__name__, "f": {name: self.value(getattr(value, name)) for name in names}}


def _read(value: Any, blobs: memoryview) -> Any:
    """:meth:`_Writer.value` read back: only JSON data, bytes, messages of classes the env
    process has, and records of :data:`_RECORDS`."""
    if type(value) is not dict:
        return value  # JSON data as it was (a plain list included: not walked)
    if "ms" in value:
        parse = _parser(value["ms"])
        ends = itertools.accumulate(value["n"], initial=value["at"])
        return [parse(blobs[start:end]) for start, end in itertools.pairwise(ends)]
    if "m" in value:
        at, size = value["b"]
        return _parser(value["m"])(blobs[at : at + size])
    if "b" in value:
        at, size = value["b"]
        return bytes(blobs[at : at + size])
    if "l" in value:
        return [_read(one, blobs) for one in value["l"]]
    if "d" in value:
        return {_read(key, blobs): _read(one, blobs) for key, one in value["d"]}
    record = _RECORDS[value["r"]]
    fields = value["f"]
    if not fields:  # its default: the one instance, as NO_AUTORESETS is shared
        return _FIELDS[record][1]
    return record(**{name: _read(one, blobs) for name, one in fields.items()})


def _name(kind: type[Message]) -> str:
    """A message class's name for the env process: its descriptor's full name."""
    name = _NAMES.get(kind)
    if name is None:
        name = _NAMES[kind] = kind.DESCRIPTOR.full_name
        _CLASSES.setdefault(name, kind)
    return name


#: Message class -> its name (front); name -> its class (the classes this process made
#: or was sent, then the default descriptor pool's).
_NAMES: dict[type, str] = {}
_CLASSES: dict[str, type[Message]] = {}


def _parser(name: str) -> Any:
    kind = _CLASSES.get(name)
    if kind is None:
        descriptor = descriptor_pool.Default().FindMessageTypeByName(name)
        kind = _CLASSES[name] = message_factory.GetMessageClass(descriptor)
    return kind.FromString


def know_messages(*classes: type[Message] | None) -> None:
    """Classes the env process parses frames' messages into (its env's own: a class made
    at run time is in no descriptor pool the frame's name could find)."""
    for kind in classes:
        if kind is not None:
            _CLASSES.setdefault(kind.DESCRIPTOR.full_name, kind)


def command_frame(what: str, method: str, envs: int, args: tuple[Any, ...]) -> bytes:
    """A sub-batch's call: the batch's ``method`` on ``args`` (local indices), for
    ``envs`` envs; ``what`` names it in errors. JSON with blobs, never a pickle."""
    writer = _Writer()
    head = [what, method, envs, [writer.value(arg) for arg in args]]
    text = json.dumps(head, separators=(",", ":")).encode()
    return b"".join([_FRAME_HEAD.pack(len(text)), text, *writer.blobs])


def read_command(payload: bytes) -> tuple[str, str, int, tuple[Any, ...]]:
    """:func:`command_frame` read back (by the env process: from its own front only)."""
    (size,) = _FRAME_HEAD.unpack_from(payload)
    start = _FRAME_HEAD.size
    what, method, envs, args = json.loads(payload[start : start + size])
    blobs = memoryview(payload)[start + size :]
    return what, method, envs, tuple([_read(arg, blobs) for arg in args])


def fill_answer(response: pb.VectorSessionResponse, result: Any, url: str) -> None:
    """What a sub-batch's call returned, into ``response`` by its type."""
    if isinstance(result, BatchOutcome):
        new_ids, rows = result.new_episode_ids, result.rows
        ids = [new_ids.get(index, "") for index in rows] if result.autoreset is not None else []
        fill_result(response.result, result, url, ids, (), info_json=True)
    elif isinstance(result, BatchStates):
        response.snapshots.indices.extend(result.rows)
        add = response.snapshots.snapshots.add
        for data in result.states:
            add(snapshot=data)
        fill_errors(response.snapshots.errors, result.errors)
    else:  # per-env errors: every other env was done
        response.restored.SetInParent()
        fill_errors(response.restored.errors, result)


def read_answer(response: pb.VectorSessionResponse, offset: int) -> Any:
    """:func:`fill_answer`'s result, its indices moved by ``offset``."""
    field = response.WhichOneof("outcome")
    if field == "result":
        return read_outcome(response.result, offset)
    if field == "snapshots":
        rows = response.snapshots
        return BatchStates(
            rows=[index + offset for index in rows.indices],
            states=[entry.snapshot for entry in rows.snapshots],
            errors=read_errors(rows.errors, offset),
        )
    return read_errors(response.restored.errors, offset)


def fill_result(
    result: pb.VectorResult,
    outcome: BatchOutcome,
    url: str,
    episode_ids: Sequence[str],
    step_counts: Sequence[int],
    info_json: bool = False,
) -> None:
    """Copy ``outcome`` into ``result`` (ids and step counts: one per row, or none);
    ``info_json``: infos go to ``infos_json`` where JSON can write them."""
    rows = outcome.rows
    result.indices.extend(rows)
    _put_observations(
        result.batch_observation, result.observations, outcome.batch_observation,
        outcome.observations, url,
    )  # fmt: skip
    result.rewards.extend(outcome.rewards)
    result.terminated.extend(outcome.terminated)
    result.truncated.extend(outcome.truncated)
    result.episode_ids.extend(episode_ids)
    result.step_counts.extend(step_counts)
    if outcome.infos:
        _fill_infos(result.infos, result.infos_json, outcome.infos, info_json)
    if outcome.autoreset is not None:
        result.autoreset.extend(outcome.autoreset)
        _put_observations(
            result.batch_final_observation, result.final_observations,
            outcome.batch_final_observation, outcome.final_observations, url,
        )  # fmt: skip
        if outcome.final_infos:
            _fill_infos(result.final_infos, result.final_infos_json, outcome.final_infos, info_json)
    if outcome.errors:
        fill_errors(result.errors, outcome.errors)
    if outcome.no_reward:
        result.no_reward.extend(sorted(outcome.no_reward))


def read_outcome(result: pb.VectorResult, offset: int) -> BatchOutcome:
    """A sub-batch's outcome, its indices moved by ``offset`` (infos as sent)."""
    rows = [index + offset for index in result.indices]
    out = BatchOutcome(rows=rows)
    out.no_reward = {index + offset for index in result.no_reward}
    if result.HasField("batch_observation"):
        out.batch_observation = result.batch_observation.value
    else:
        out.observations = [payload.value for payload in result.observations]
    out.rewards = list(result.rewards)
    out.terminated = list(result.terminated)
    out.truncated = list(result.truncated)
    out.infos = _read_infos(result.infos, result.infos_json, offset)
    if result.autoreset:
        out.autoreset = list(result.autoreset)
        out.new_episode_ids = {
            index: episode_id
            for index, episode_id in zip(rows, result.episode_ids, strict=True)
            if episode_id
        }
        if result.HasField("batch_final_observation"):
            out.batch_final_observation = result.batch_final_observation.value
        else:
            out.final_observations = [payload.value for payload in result.final_observations]
        out.final_infos = _read_infos(result.final_infos, result.final_infos_json, offset)
    out.errors = read_errors(result.errors, offset)
    return out


def fill_states(
    result: pb.VectorStates, states: BatchStates, url: str, ids: Any, counts: Any
) -> None:
    """Copy ``states`` into ``result``, with each env's episode id and step count."""
    result.indices.extend(states.rows)
    add = result.states.add
    for index, state in zip(states.rows, states.states, strict=True):
        entry = add(episode_id=ids[index], step_count=counts[index])
        entry.state.type_url = url
        entry.state.value = state
    fill_errors(result.errors, states.errors)


def fill_errors(target: Any, errors: dict[int, RowError]) -> None:
    for index, error in errors.items():
        entry = target[index]
        entry.code = error.code
        entry.message = error.message
        entry.exception_type = error.exception_type


def read_errors(errors: Any, offset: int) -> dict[int, RowError]:
    return {
        index + offset: RowError(error.code, error.message, error.exception_type)
        for index, error in errors.items()
    }


def _put_observations(
    batch: any_pb2.Any, each: Any, batch_value: bytes | None, values: list[bytes], url: str
) -> None:
    if batch_value is not None:
        batch.type_url = url
        batch.value = batch_value
        return
    add = each.add
    for value in values:
        add(type_url=url, value=value)


def info_text(info: Any) -> str | None:
    """One row's info (a map, or an env process's JSON text or Struct) as JSON text;
    None when it must go as a Struct (a NaN or an infinity in it)."""
    if isinstance(info, str):
        return info
    if isinstance(info, struct_pb2.Struct):
        return None
    return info_to_json(info)


def struct_info(info: Any, target: struct_pb2.Struct) -> None:
    """One row's info (as for :func:`info_text`) into ``target``."""
    if isinstance(info, str):  # JSON text from an env process
        info_to_struct(info_from_json(info), target)
    elif isinstance(info, struct_pb2.Struct):
        target.CopyFrom(info)
    else:
        info_to_struct(info, target)


def _fill_infos(structs: Any, texts: Any, infos: dict[int, Any], as_json: bool) -> None:
    """Infos into the Struct map, or the JSON map where ``as_json`` and JSON can."""
    for index, info in infos.items():
        text = info_text(info) if as_json else None
        if text is not None:
            texts[index] = text
        else:
            struct_info(info, structs[index])


def _read_infos(structs: Any, texts: Any, offset: int) -> dict[int, Any]:
    out: dict[int, Any] = {index + offset: info for index, info in structs.items()}
    if texts:
        out.update((index + offset, text) for index, text in texts.items())
    return out
