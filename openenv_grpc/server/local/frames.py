"""The wire's vector messages as the frames of a sub-batch, and a batch's outcome in the
columns of a :class:`~openenv_grpc.v1.session_pb2.VectorResult`.

Two users: the vector view (``vector_view.py``) fills the answer to the client from a
batch's outcome and the driver's bookkeeping (:func:`fill_result`; the Session view takes
only the info forms, :func:`info_text` and :func:`struct_info`); with ``--isolated`` the
front sends each env process the part of a request that concerns its sub-batch as a
``VectorSessionRequest`` (local indices, payloads as received), the env process answers
with the sub-batch's outcome in a ``VectorResult``, and the front reads it back
(:func:`read_outcome`). Between front and env process, ``episode_ids`` holds only the ids
of episodes the sub-batch autoreset ("" for the other rows) and ``step_counts`` is empty:
the front keeps the books. The rows whose env gave no reward (``BatchOutcome.no_reward``)
travel in ``VectorResult.no_reward``, as to a vector client: a Session's
``StepResult.no_reward`` survives ``--isolated``. A step frame carries the autoresets the
driver decided (:func:`step_frame`): the sub-batch's envs to autoreset, each with its new
episode id and its options as received (``batch.Autoresets``); the env process keeps no
autoreset state.
Infos come back as JSON text where JSON can write them (types kept), and the front answers
each client in the form it asked for at open (``openenv-info``).

A per-env query (``queries.py``: state, snapshot, render) goes as its own command with
local indices, and every query's answer comes back as a ``VectorSnapshots``: each env's encoded
bytes in ``SnapshotResult.snapshot`` (a state serialized, an env's own snapshot bytes,
unsigned). Snapshots are sealed and opened in the front, which keeps the bookkeeping they
carry: a ``VectorRestore`` frame carries each env's authenticated part as an unsigned
``SnapshotBody`` (its ``env_state`` and ``phase``), never bytes the client sent that the
front did not check.

A query of a vector stream carries its room (:func:`room_frame`): the bytes its answers
may take, what is left of the message limit. The env process stops reading its envs once
their answers pass it and answers only how many bytes that was (:data:`ROOM`), so an
oversize query never makes either process hold much more than one message.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from google.protobuf import any_pb2, struct_pb2

from openenv_grpc.codec import info_from_json, info_to_json, info_to_struct
from openenv_grpc.server.errors import RowError
from openenv_grpc.server.local.batch import BatchOutcome
from openenv_grpc.server.model.queries import BatchStates
from openenv_grpc.server.model.snapshots import Captured
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import snapshot_pb2

__all__ = [
    "ROOM",
    "fill_errors",
    "fill_result",
    "fill_rows",
    "fill_states",
    "info_text",
    "query_frame",
    "read_errors",
    "read_outcome",
    "read_restore",
    "read_room_frame",
    "read_rows",
    "read_step_frame",
    "reset_frame",
    "restore_frame",
    "room_frame",
    "step_frame",
    "struct_info",
]

#: A query's room (front -> env process, before the query), and the bytes an env
#: process had read when its answers passed it (its whole answer then).
ROOM = struct.Struct("<Q")
#: A step frame's head: a first byte no serialized ``VectorSessionRequest`` starts with
#: (a field's tag is never 0), then the length of its step request.
STEP_HEAD = struct.Struct("<BI")
_STEP_MARK = 0


# -- a batch's outcome in the wire's columns --------------------------------------------------


def fill_result(
    result: pb.VectorResult,
    outcome: BatchOutcome,
    url: str,
    episode_ids: Sequence[str],
    step_counts: Sequence[int],
    info_json: bool = False,
) -> None:
    """Copy ``outcome`` into ``result``: ``url`` is the observation type's, and the ids and
    step counts are one per row (or empty); ``info_json``: infos go to ``infos_json`` where
    JSON can write them (the client asked for it, or this is an env process's answer)."""
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
    """A sub-batch's outcome from its env process, with its indices moved by ``offset``
    (infos stay ``Struct`` messages or JSON text, as sent)."""
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
    """Copy ``states`` into ``result``; ``ids`` and ``counts`` map an env index to its
    episode id and step count."""
    result.indices.extend(states.rows)
    add = result.states.add
    for index, state in zip(states.rows, states.states, strict=True):
        entry = add(episode_id=ids[index], step_count=counts[index])
        entry.state.type_url = url
        entry.state.value = state
    fill_errors(result.errors, states.errors)


def fill_rows(result: pb.VectorSnapshots, rows: BatchStates) -> None:
    """An env process's answer to a query frame: each env's encoded bytes."""
    result.indices.extend(rows.rows)
    add = result.snapshots.add
    for data in rows.states:
        add(snapshot=data)
    fill_errors(result.errors, rows.errors)


def read_rows(result: pb.VectorSnapshots, offset: int) -> BatchStates:
    """A sub-batch's answer to a query from its env process, indices moved by ``offset``."""
    return BatchStates(
        rows=[index + offset for index in result.indices],
        states=[entry.snapshot for entry in result.snapshots],
        errors=read_errors(result.errors, offset),
    )


def fill_errors(target: Any, errors: dict[int, RowError]) -> None:
    """Per-env errors into a wire map of Errors."""
    for index, error in errors.items():
        entry = target[index]
        entry.code = error.code
        entry.message = error.message
        entry.exception_type = error.exception_type


def read_errors(errors: Any, offset: int) -> dict[int, RowError]:
    """A wire map of Errors from an env process, indices moved by ``offset``."""
    return {
        index + offset: RowError(error.code, error.message, error.exception_type)
        for index, error in errors.items()
    }


def _put_observations(
    batch: any_pb2.Any, each: Any, batch_value: bytes | None, values: list[bytes], url: str
) -> None:
    """Serialized observations into the wire: one batch-form Any, or one Any per row."""
    if batch_value is not None:
        batch.type_url = url
        batch.value = batch_value
        return
    add = each.add
    for value in values:
        add(type_url=url, value=value)


def info_text(info: Any) -> str | None:
    """One row's info (an env's map, or what an env process sent: JSON text or a Struct)
    as JSON text; None when it must go as a Struct (a NaN or an infinity in it)."""
    if isinstance(info, str):
        return info
    if isinstance(info, struct_pb2.Struct):
        return None
    return info_to_json(info)


def struct_info(info: Any, target: struct_pb2.Struct) -> None:
    """One row's info (as for :func:`info_text`) into ``target``, for a client that reads
    the Struct."""
    if isinstance(info, str):  # JSON text from an env process
        info_to_struct(info_from_json(info), target)
    elif isinstance(info, struct_pb2.Struct):
        target.CopyFrom(info)
    else:
        info_to_struct(info, target)


def _fill_infos(structs: Any, texts: Any, infos: dict[int, Any], as_json: bool) -> None:
    """Infos into a result's Struct map, or its JSON map where ``as_json`` and JSON can
    write them (an index lands in one map only)."""
    for index, info in infos.items():
        text = info_text(info) if as_json else None
        if text is not None:
            texts[index] = text
        else:
            struct_info(info, structs[index])


def _read_infos(structs: Any, texts: Any, offset: int) -> dict[int, Any]:
    """An env process's infos (Structs and JSON text), indices moved by ``offset``."""
    out: dict[int, Any] = {index + offset: info for index, info in structs.items()}
    if texts:
        out.update((index + offset, text) for index, text in texts.items())
    return out


# -- requests for a sub-batch -----------------------------------------------------------------


def step_frame(
    indices: Sequence[int],
    actions: Any,
    batch_form: bool,
    autoresets: Sequence[tuple[int, str, any_pb2.Any | None]] = (),
) -> bytes:
    """A step of a sub-batch: local ``indices`` and their actions as received (Anys, or
    one batch-form Any), and its autoresets: (local index, new episode id, options as
    received or None) each. The frame is :data:`STEP_HEAD`, the step's
    ``VectorSessionRequest``, then the autoresets as a ``VectorReset`` (its indices and
    one ``ResetCommand`` each, with the id and the options)."""
    request = pb.VectorSessionRequest(request_id=1)
    step = request.step
    step.indices.extend(indices)
    if batch_form:
        step.batch_action.CopyFrom(actions)
    else:
        step.actions.extend(actions)
    body = request.SerializeToString()
    restarts = pb.VectorReset()
    add = restarts.envs.add
    for index, episode_id, option in autoresets:
        restarts.indices.append(index)
        command = add(episode_id=episode_id)
        if option is not None:
            command.options.CopyFrom(option)
    return STEP_HEAD.pack(_STEP_MARK, len(body)) + body + restarts.SerializeToString()


def read_step_frame(payload: bytes) -> tuple[pb.VectorSessionRequest, pb.VectorReset | None]:
    """The env process's side of a request frame: the request, and a step's autoresets
    (:func:`step_frame`; None for any other frame)."""
    if payload[:1] != bytes((_STEP_MARK,)):
        return pb.VectorSessionRequest.FromString(payload), None
    _, length = STEP_HEAD.unpack_from(payload)
    start = STEP_HEAD.size
    request = pb.VectorSessionRequest.FromString(payload[start : start + length])
    return request, pb.VectorReset.FromString(payload[start + length :])


def reset_frame(
    indices: Sequence[int],
    seeds: Sequence[int | None],
    episode_ids: Sequence[str],
    options: Sequence[any_pb2.Any | None],
    batch_form: bool,
) -> bytes:
    """A reset of a sub-batch: local ``indices``, one seed, id and options (as received)
    each; the episode ids are chosen already."""
    request = pb.VectorSessionRequest(request_id=1)
    reset = request.reset
    reset.indices.extend(indices)
    reset.batch_observation = batch_form
    for seed, episode_id, option in zip(seeds, episode_ids, options, strict=True):
        command = reset.envs.add(episode_id=episode_id)
        if seed is not None:
            command.seed = seed
        if option is not None:
            command.options.CopyFrom(option)
    return request.SerializeToString()


def query_frame(name: str, indices: Sequence[int]) -> bytes:
    """Query ``name`` (its command field) for a sub-batch's local ``indices``."""
    request = pb.VectorSessionRequest(request_id=1)
    command = getattr(request, name)
    command.SetInParent()
    command.indices.extend(indices)
    return request.SerializeToString()


def room_frame(name: str, indices: Sequence[int], room: int) -> bytes:
    """Query ``name`` for a sub-batch's local ``indices``, whose answers may take at most
    ``room`` bytes: the room, then the query's frame (:func:`query_frame`)."""
    return ROOM.pack(room) + query_frame(name, indices)


def read_room_frame(payload: bytes) -> tuple[int, pb.VectorSessionRequest]:
    """The env process's side of :func:`room_frame`: the room and the query."""
    (room,) = ROOM.unpack_from(payload)
    return room, pb.VectorSessionRequest.FromString(payload[ROOM.size :])


def restore_frame(indices: Sequence[int], captured: Sequence[Captured]) -> bytes:
    """A restore of a sub-batch: local ``indices`` and, for each, the authenticated part
    of its snapshot as an unsigned ``SnapshotBody`` (env bytes and phase)."""
    request = pb.VectorSessionRequest(request_id=1)
    restore = request.restore
    restore.indices.extend(indices)
    for one in captured:
        body = snapshot_pb2.SnapshotBody(phase=one.phase, env_state=one.env_state)  # type: ignore[arg-type]
        restore.snapshots.append(body.SerializeToString())
    return request.SerializeToString()


def read_restore(restore: pb.VectorRestore) -> tuple[list[int], list[Captured]]:
    """The env process's side of :func:`restore_frame`: local indices and what to restore
    (only the env bytes and the phase are set)."""
    captured = []
    for data in restore.snapshots:
        body = snapshot_pb2.SnapshotBody.FromString(data)
        captured.append(Captured("", 0, body.phase, body.env_state))
    return list(restore.indices), captured
