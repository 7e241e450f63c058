"""The transport-free half of a vector session: requests over env indices, and answers
decoded into :class:`~openenv_grpc.client.vector_outcome.VectorOutcome`.

Shared by ``VectorSession`` and ``AsyncVectorSession`` (as ``protocol.py`` is by the
one-env sessions); ids, notices, errors and payload decoding come from
:class:`~openenv_grpc.client.protocol.StreamProtocol`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf.message import DecodeError, Message

from openenv_grpc.client.errors import EnvError, InvalidRequest, PayloadTypeError, VectorEnvError
from openenv_grpc.client.outcome import Restored
from openenv_grpc.client.protocol import (
    SessionTypes,
    StreamProtocol,
    checked_seed,
    pack_typed,
    status_code,
)
from openenv_grpc.client.vector_outcome import VectorOutcome
from openenv_grpc.codec import infos_of, type_url
from openenv_grpc.v1 import session_pb2 as pb

__all__ = [
    "EpisodeIds",
    "Indices",
    "Options",
    "Seeds",
    "States",
    "VectorProtocol",
    "snapshot_bytes",
]

RowT = TypeVar("RowT")

#: Env indices a call is about: None means all, in order.
Indices = Sequence[int] | None
#: Seeds of a reset: None (unseeded), one int (env ``i`` gets ``seed + i``, as Gymnasium's
#: vector envs seed), or one per env named (None: unseeded).
Seeds = int | Sequence[int | None] | None
#: Reset options: None, one message for every env named, or one (or None) per env.
Options = Message | Sequence[Message | None] | None
#: Episode ids of a reset: None (the server makes them) or one (or None) per env named.
EpisodeIds = Sequence[str | None] | None


@dataclass(frozen=True, slots=True)
class States:
    """The answer to a state command: the states read and the envs' errors, by index."""

    states: dict[int, Any]
    errors: dict[int, EnvError]

    def one(self, index: int) -> Any:
        """The state of env ``index``.

        Raises:
            EnvError: that env's state() raised.
        """
        if index in self.errors:
            raise self.errors[index]
        return self.states[index]

    def all(self) -> list[Any]:
        """Every state, in index order.

        Raises:
            EnvError: an env's state() raised (the first such, its index in the message).
        """
        for index, error in sorted(self.errors.items()):
            raise type(error)(error.code, f"env {index}: {error.message}", error.exception_type)
        return [self.states[index] for index in sorted(self.states)]


class VectorProtocol(StreamProtocol):
    """Requests, answers and each env's last known episode for one vector stream."""

    __slots__ = ("episode_ids", "num_envs", "step_counts")

    _request_class = pb.VectorSessionRequest

    def __init__(self, types: SessionTypes, num_envs: int) -> None:
        super().__init__(types)
        self.num_envs = num_envs
        #: Each env's episode, as the server last said ("" before its first reset).
        self.episode_ids = [""] * num_envs
        #: Each env's step count, as the server last said.
        self.step_counts = [0] * num_envs

    # -- requests ---------------------------------------------------------------------

    def reset_request(
        self,
        seeds: Seeds,
        options: Options,
        episode_ids: EpisodeIds,
        indices: Indices,
        batch: bool,
    ) -> pb.VectorSessionRequest:
        """A reset of the envs named (all by default).

        Raises:
            InvalidRequest: a sequence of seeds, options or ids does not have one entry
                per env named.
            PayloadTypeError: an options message is not of the pinned type.
        """
        request: pb.VectorSessionRequest = self._envelope()
        reset = request.reset
        reset.SetInParent()
        named = self._named(indices, reset.indices)
        reset.batch_observation = batch
        if seeds is None and options is None and episode_ids is None:
            return request  # the server resets each env unseeded, with a fresh id
        per_seed = _per_env(seeds, named, "seeds", "an int, one int or None per env, or None")
        per_id = _per_env(episode_ids, named, "episode_ids", "one str or None per env, or None")
        per_options = _per_env(
            options, named, "options", "a message, one message or None per env, or None"
        )
        if seeds is not None and hasattr(seeds, "__index__"):
            first = checked_seed(seeds, "seeds")  # env i gets seeds + i: all must fit
            checked_seed(first + max(named, default=0), f"seeds + {max(named, default=0)}")
            per_seed = [first + index for index in named]
        else:
            per_seed = [
                None if seed is None else checked_seed(seed, f"seeds[{i}]")
                for i, seed in enumerate(per_seed)
            ]
        if isinstance(options, Message):
            per_options = [options] * len(named)
        pinned = self._types.reset_options
        for seed, episode_id, option in zip(per_seed, per_id, per_options, strict=True):
            command = reset.envs.add()
            if seed is not None:
                command.seed = seed
            if episode_id is not None:
                command.episode_id = episode_id
            if option is not None:
                pack_typed(command.options, option, pinned, "options")
        return request

    def step_request(self, actions: Sequence[Message], indices: Indices) -> pb.VectorSessionRequest:
        """A step with one action per env named (all by default).

        Raises:
            PayloadTypeError: an action is not of the pinned type (nothing is sent).
        """
        if isinstance(actions, Message) or not hasattr(actions, "__len__"):
            raise PayloadTypeError(
                "actions must be a sequence of messages, one per env named, got "
                f"{type(actions).__qualname__}"
            )
        request: pb.VectorSessionRequest = self._envelope()
        step = request.step
        step.SetInParent()
        if indices is not None:
            _extend_indices(step.indices, indices)
        add, pinned = step.actions.add, self._types.action
        if pinned is not None and all(type(action) is pinned for action in actions):
            url = type_url(pinned)  # the common case: one type, checked once per call
            for action in actions:
                add(type_url=url, value=action.SerializeToString())
            return request
        for action in actions:
            pack_typed(add(), action, pinned, "action")
        return request

    def step_batch_request(self, action: Message, indices: Indices) -> pb.VectorSessionRequest:
        """A step with every action in one batch-form message."""
        request: pb.VectorSessionRequest = self._envelope()
        step = request.step
        if indices is not None:
            _extend_indices(step.indices, indices)
        pack_typed(step.batch_action, action, self._types.action, "batch action")
        return request

    def query_request(self, command: str, indices: Indices) -> pb.VectorSessionRequest:
        """A per-env query (``state``, ``snapshot``, ``render``: its command field) of the
        envs named (all by default).

        Raises:
            InvalidRequest: an index is no env index (nothing is sent).
        """
        request: pb.VectorSessionRequest = self._envelope()
        query = getattr(request, command)
        query.SetInParent()
        self._named(indices, query.indices)
        return request

    def restore_request(
        self, snapshots: Sequence[bytes], indices: Indices
    ) -> pb.VectorSessionRequest:
        """A restore of the envs named (all by default), one snapshot each.

        Raises:
            InvalidRequest: not one snapshot per env named (nothing is sent).
            TypeError: a snapshot is not bytes (nothing is sent).
        """
        request: pb.VectorSessionRequest = self._envelope()
        restore = request.restore
        restore.SetInParent()
        named = self._named(indices, restore.indices)
        if isinstance(snapshots, bytes | bytearray | memoryview) or len(snapshots) != len(named):
            count = "one snapshot" if isinstance(snapshots, bytes) else f"{len(snapshots)}"
            raise InvalidRequest(
                f"{count} for {len(named)} envs: give a list of one snapshot per env named"
            )
        for data in snapshots:
            if not isinstance(data, bytes | bytearray | memoryview):
                raise TypeError(f"a snapshot is bytes, got {type(data).__qualname__}")
            restore.snapshots.append(bytes(data))
        return request

    def _named(self, indices: Indices, target: Any) -> Sequence[int]:
        if indices is None:
            return range(self.num_envs)
        _extend_indices(target, indices)
        return indices

    # -- answers ----------------------------------------------------------------------

    def outcome(self, response: pb.VectorSessionResponse) -> VectorOutcome[Any]:
        """The answer to a reset or a step.

        Raises:
            EnvError: the whole request was refused (per-env errors are in the outcome).
            ProtocolError: the server answered something else.
        """
        result: pb.VectorResult = self._outcome(response, "result")
        # Slices, not list(): upb copies a repeated field into a list in one call.
        indices = result.indices[:]
        ids, counts = result.episode_ids[:], result.step_counts[:]
        if len(indices) == self.num_envs == len(ids) == len(counts):
            # Every env answered (rows in index order): the columns are the whole books.
            self.episode_ids, self.step_counts = ids[:], counts[:]
        else:
            episode_ids, step_counts = self.episode_ids, self.step_counts
            for index, episode_id, count in zip(indices, ids, counts, strict=True):
                episode_ids[index] = episode_id
                step_counts[index] = count
        decode = self._decode
        observations = self._observations(result.observations) if result.observations else []
        marks = result.autoreset[:]
        if marks:
            autoreset = marks
            finals = [index for index, auto in zip(indices, marks, strict=True) if auto]
        else:
            autoreset, finals = [False] * len(indices), []
        return VectorOutcome(
            indices=indices,
            observations=observations,
            rewards=result.rewards[:],
            no_reward=frozenset(result.no_reward) if result.no_reward else frozenset(),
            terminated=result.terminated[:],
            truncated=result.truncated[:],
            episode_ids=ids,
            step_counts=counts,
            infos=infos_of(result.infos, result.infos_json)
            if result.infos or result.infos_json
            else {},
            autoreset=autoreset,
            final_observations={
                index: decode(o, "observation")
                for index, o in zip(finals, result.final_observations, strict=False)
            },
            final_infos=infos_of(result.final_infos, result.final_infos_json)
            if result.final_infos or result.final_infos_json
            else {},
            errors=_errors(result.errors) if result.errors else {},
            batch_payload=result.batch_observation
            if result.HasField("batch_observation")
            else None,
            batch_final_payload=(
                result.batch_final_observation
                if result.HasField("batch_final_observation")
                else None
            ),
            _decode=lambda payload: decode(payload, "observation"),
        )

    def _observations(self, payloads: Any) -> list[Any]:
        """Each row's observation, decoded (in one pass when every url is the pinned
        type's, the common case)."""
        pinned = self._types.observation
        if pinned is not None:
            url = type_url(pinned)
            if all(payload.type_url == url for payload in payloads):
                parse = pinned.FromString
                try:
                    return [parse(payload.value) for payload in payloads]
                except DecodeError:
                    pass  # the slow path below says which one and why
        return [self._decode(payload, "observation") for payload in payloads]

    def states(self, response: pb.VectorSessionResponse) -> States:
        """The answer to a state command: states and errors, by env index.

        Raises:
            EnvError: the request was refused.
        """
        result: pb.VectorStates = self._outcome(response, "states")
        states = {
            index: self._decode(entry.state, "state")
            for index, entry in zip(result.indices, result.states, strict=True)
        }
        return States(states, _errors(result.errors))

    def rows(
        self,
        response: pb.VectorSessionResponse,
        expected: str,
        command: str,
        read: Callable[[Any], RowT],
    ) -> list[RowT]:
        """The answer to a query whose every env either answers or fails (a snapshot,
        a render): one ``read`` entry per env named, in index order.

        Raises:
            VectorEnvError: some envs failed (the others' entries are its ``results``,
                by index).
            EnvError: the request was refused.
        """
        result = self._outcome(response, expected)
        rows = [read(entry) for entry in getattr(result, expected)]
        if result.errors:
            done = list(result.indices)
            raise VectorEnvError(
                command, _errors(result.errors), done, dict(zip(done, rows, strict=False))
            )
        return rows

    def restored(self, response: pb.VectorSessionResponse) -> list[Restored]:
        """The answer to a restore command: where each env named now is, in index order.

        Raises:
            VectorEnvError: some envs were not restored (``done``: those that were).
            EnvError: the request was refused (nothing was restored).
        """
        result: pb.VectorRestored = self._outcome(response, "restored")
        episode_ids, step_counts = self.episode_ids, self.step_counts
        out = []
        for index, entry in zip(result.indices, result.restored, strict=True):
            episode_ids[index] = entry.episode_id
            step_counts[index] = entry.step_count
            out.append(
                Restored(entry.episode_id, entry.step_count, entry.terminated, entry.truncated)
            )
        if result.errors:
            raise VectorEnvError("restore", _errors(result.errors), list(result.indices))
        return out


def _per_env(values: Any, named: Sequence[int], what: str, accepts: str) -> Sequence[Any]:
    """``values`` as one entry per env named; a single value or None is spread later.

    Raises:
        PayloadTypeError: ``values`` is neither a single value nor a sequence.
        InvalidRequest: the sequence does not have one entry per env named.
    """
    if values is None or isinstance(values, Message) or hasattr(values, "__index__"):
        return [None] * len(named)
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__"):
        raise PayloadTypeError(f"{what} must be {accepts}, got {type(values).__qualname__}")
    if len(values) != len(named):
        raise InvalidRequest(
            f"{len(values)} {what} for {len(named)} envs: give one per env named, or one for all"
        )
    return list(values)


def snapshot_bytes(entry: pb.SnapshotResult) -> bytes:
    """A snapshot command's entry for one env (``VectorProtocol.rows``)."""
    return bytes(entry.snapshot)


def _errors(errors: Any) -> dict[int, EnvError]:
    return {
        index: EnvError(status_code(error.code), error.message, error.exception_type)
        for index, error in errors.items()
    }


def _extend_indices(target: Any, indices: Sequence[int]) -> None:
    """Put ``indices`` in a request's index list.

    Raises:
        InvalidRequest: one is no env index (negative, too large, not a whole number);
            nothing is sent.
    """
    try:
        target.extend(indices)
    except (TypeError, ValueError) as exc:
        shown = list(indices)[:8]
        raise InvalidRequest(
            f"indices must be env indices, whole numbers from 0, got {shown!r}: {exc}"
        ) from None
