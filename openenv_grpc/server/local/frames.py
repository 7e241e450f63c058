"""A batch's outcome in the columns of a ``VectorResult``, and the frames between the
front and an env process (``--isolated``).

The front sends a sub-batch's call as a pickle (:func:`command_frame`) of only what it
checked or chose: decoded messages, ids, a snapshot's authenticated env bytes and phase.
The env process answers by the type of what its batch returned (:func:`fill_answer`), in
a ``VectorSessionResponse``, never a pickle: infos as JSON text where JSON can write them,
``episode_ids`` only for the episodes it autoreset.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import operator
import pickle
import struct
import sys
from collections.abc import Sequence
from typing import Any

from google.protobuf import any_pb2, descriptor_pool, message_factory, struct_pb2
from google.protobuf.message import Message

from openenv_grpc.codec import info_from_json, info_to_json, info_to_struct
from openenv_grpc.server.errors import RowError
from openenv_grpc.server.local.batch import BatchOutcome
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
    "read_answer",
    "read_command",
    "read_errors",
    "read_outcome",
    "struct_info",
]

#: A query's room (before its frame), and the bytes an env process read past it.
ROOM = struct.Struct("<Q")


#: The first item of a packed argument: a list of messages as (mark, class name, bytes).
_PACKED = "\0messages"


def _packed(value: list[Message]) -> Any:
    """A list of messages of one class, packed (no Python call per message)."""
    kinds: set[type[Message]] = set(map(type, value))
    if len(kinds) != 1:
        return value
    kind = kinds.pop()
    name = _NAMES.get(kind) or _name(kind)
    return (_PACKED, name, list(map(kind.SerializeToString, value)))


def _name(kind: type[Message]) -> str:
    """A message class's name for the env process: module and name, or the descriptor's
    full name for a class made at run time."""
    name = _NAMES.get(kind)
    if name is None:
        where: Any = sys.modules.get(kind.__module__)
        for part in kind.__qualname__.split("."):
            where = getattr(where, part, None)
        found = where is kind
        name = _NAMES[kind] = (
            f"{kind.__module__}:{kind.__qualname__}" if found else kind.DESCRIPTOR.full_name
        )
    return name


#: Message class -> its name (front), and name -> ``FromString`` (env process).
_NAMES: dict[type, str] = {}
_PARSERS: dict[str, Any] = {}


def _parser(name: str) -> Any:
    parse = _PARSERS.get(name)
    if parse is None:
        module, _, qualname = name.partition(":")
        if qualname:
            kind: Any = sys.modules[module]
            for part in qualname.split("."):
                kind = getattr(kind, part)
        else:
            pool = descriptor_pool.Default()
            kind = message_factory.GetMessageClass(pool.FindMessageTypeByName(name))
        parse = _PARSERS[name] = kind.FromString
    return parse


def _parse(name: str, value: bytes) -> Message:
    return _parser(name)(value)  # type: ignore[no-any-return]


class _Reducers(dict[type, Any]):
    """The frames' pickle dispatch table, learning each type's reducer once: messages as
    their class's name and their bytes, dataclasses by their fields (not dataclasses'
    slow getstate)."""

    def __missing__(self, kind: type) -> Any:
        how: Any
        if issubclass(kind, Message):
            how = _reduce_message
        elif dataclasses.is_dataclass(kind) and all(f.init for f in dataclasses.fields(kind)):
            get = operator.attrgetter(*(f.name for f in dataclasses.fields(kind)))
            how = functools.partial(_reduce_fields, get)
        else:
            raise KeyError(kind)
        self[kind] = how
        return how


def _reduce_message(message: Message) -> Any:
    return _parse, (_name(type(message)), message.SerializeToString())


def _reduce_fields(get: Any, obj: Any) -> Any:
    fields = get(obj)
    return type(obj), fields if type(fields) is tuple else (fields,)


_REDUCERS = _Reducers()


def command_frame(what: str, method: str, envs: int, args: tuple[Any, ...]) -> bytes:
    """A sub-batch's call: the batch's ``method`` on ``args`` (local indices), for
    ``envs`` envs; ``what`` names it in errors."""
    out = io.BytesIO()
    pickler = pickle.Pickler(out, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _REDUCERS
    packed = tuple(
        [
            _packed(arg) if type(arg) is list and arg and isinstance(arg[0], Message) else arg
            for arg in args
        ]
    )
    pickler.dump((what, method, envs, packed))
    return out.getvalue()


def read_command(payload: bytes) -> tuple[str, str, int, tuple[Any, ...]]:
    """:func:`command_frame` read back (by the env process: from its own front only)."""
    what, method, envs, args = pickle.loads(payload)
    unpacked = [
        list(map(_parser(arg[1]), arg[2])) if type(arg) is tuple and arg[:1] == (_PACKED,) else arg
        for arg in args
    ]
    return what, method, envs, tuple(unpacked)


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
