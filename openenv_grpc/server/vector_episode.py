"""Answers the requests of one vector stream: reset, step, state, snapshot, restore and
close over N envs.

This is the per-request half of a vector stream (its lifecycle is in ``session.py`` and
``vector_session.py``), the vector twin of ``episode.py``. It validates each request
before any env is touched (indices in range, strictly increasing, one action or one reset
per index, payloads of the declared types, the size caps of ``episode.py`` per env) and
refuses a bad one as a whole with INVALID_ARGUMENT; it keeps each env's bookkeeping
(episode id, step count, whether it may step) and maps what the envs returned to the
columnar wire result, with per-env errors by index.

Snapshots and restores are per env and sealed here with ``snapshots.py``, exactly as a
one-env session seals them (``episode.py``): the same bytes either way, so a snapshot of
one env of a vector restores into a Session and the other way round; each snapshot is
authenticated before any env code sees it, and a refusal is that index's error only.

The envs themselves are behind :class:`BatchCalls`: one call per request, in this process
(:class:`LocalBatchCalls`, over a :class:`~openenv_grpc.server.vector_batch.VectorBatch`)
or spread over env processes (``vector_spread.py``).
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError, Message

from openenv_grpc.environment import AutoresetMode, InvalidAction
from openenv_grpc.server.backend import Answer, Outcome, UndecodableRequest
from openenv_grpc.server.episode import (
    MAX_EPISODE_ID_BYTES,
    MAX_RESET_OPTIONS_BYTES,
    PayloadRefused,
    decode_payload,
)
from openenv_grpc.server.limiter import NoSlot
from openenv_grpc.server.runner import EnvRunner, PoolSaturated
from openenv_grpc.server.snapshots import (
    Captured,
    SnapshotRefused,
    SnapshotSeal,
    default_seal,
    phase_codes,
    sealing,
)
from openenv_grpc.server.spec import EnvSpec
from openenv_grpc.server.vector_batch import BatchOutcome, BatchStates, RowError, VectorBatch
from openenv_grpc.server.vector_frames import fill_errors, fill_result, fill_states
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import snapshot_pb2

__all__ = [
    "BatchCalls",
    "BatchRefused",
    "LocalBatchCalls",
    "ResetArgs",
    "RestoreArgs",
    "StepArgs",
    "VectorDriver",
]

log = logging.getLogger(__name__)

_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
_INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
_INTERNAL = grpc.StatusCode.INTERNAL.value[0]
_DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED.value[0]
#: Per-env codes after which the env is a fresh one (its process died or was stopped).
_REPLACED = {_UNAVAILABLE, _DEADLINE_EXCEEDED}
_REQUEST_NAME = pb.VectorSessionRequest.DESCRIPTOR.full_name
_ANSWER_MODES = {pb.VECTOR_ANSWER_MODE_UNSPECIFIED, pb.VECTOR_ANSWER_MODE_ALL}
#: Envs whose states (or snapshots) a large command reads first, to measure their size.
_STATE_PROBE = 4


class _Phase(enum.IntEnum):
    NO_EPISODE = 0
    RUNNING = 1
    TERMINATED = 2
    TRUNCATED = 3
    BROKEN = 4  # the env raised mid-episode; only a reset may follow


_NEEDS_RESET = {
    _Phase.NO_EPISODE: "step before reset: reset it first",
    _Phase.TERMINATED: "the episode has terminated and no autoreset is due: reset it",
    _Phase.TRUNCATED: "the episode was truncated and no autoreset is due: reset it",
    _Phase.BROKEN: "the environment failed during this episode: reset it",
}


_CAPTURED_PHASE, _RESTORED_PHASE = phase_codes(_Phase)
_NOTHING_TO_CAPTURE = {
    _Phase.NO_EPISODE: "snapshot before reset: there is no episode to capture; reset it",
    _Phase.BROKEN: "the environment failed during this episode: there is nothing "
    "consistent to capture; reset it",
}


class BatchRefused(Exception):
    """A whole batch call failed; nothing of it has a row.

    Attributes:
        code, message, exception_type: the error the request gets.
        broken: every env the call named must be reset (a native batch raised).
        replaced: every env of the stream is a fresh one (the batch hung and was replaced).
        saturated: the call never ran (no env thread in time): the episodes are unchanged.
        ends: nothing is left to serve; the stream ends after this answer.
    """

    def __init__(
        self,
        code: int,
        message: str,
        exception_type: str = "",
        *,
        broken: bool = False,
        replaced: bool = False,
        saturated: bool = False,
        ends: bool = False,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.exception_type = exception_type
        self.broken = broken
        self.replaced = replaced
        self.saturated = saturated
        self.ends = ends


@dataclass(slots=True)
class StepArgs:
    """One step's actions, decoded and as received (the spread forwards these)."""

    #: Env indices, strictly increasing.
    indices: Sequence[int]
    #: One decoded action per index, or one batch-form message.
    actions: Any
    #: The same actions as they came on the wire: Anys, or one Any in batch form.
    wire: Any
    batch_form: bool


@dataclass(slots=True)
class ResetArgs:
    """One reset's per-env arguments (the episode ids are chosen already)."""

    indices: Sequence[int]
    seeds: Sequence[int | None]
    episode_ids: Sequence[str]
    options: Sequence[Message | None]
    #: The same options as they came on the wire (None where none was given).
    wire_options: Sequence[any_pb2.Any | None]
    batch_form: bool


@dataclass(slots=True)
class RestoreArgs:
    """One restore's snapshots, authenticated and opened (the envs get ``env_state``)."""

    indices: Sequence[int]
    captured: Sequence[Captured]

    @property
    def states(self) -> list[bytes]:
        """Each env's own bytes."""
        return [one.env_state for one in self.captured]

    @property
    def ended(self) -> list[bool]:
        """Per env: the captured episode had ended (terminated or truncated)."""
        return [one.phase != snapshot_pb2.SNAPSHOT_PHASE_RUNNING for one in self.captured]


class BatchCalls(Protocol):
    """A vector stream's envs, wherever they run: one call per request.

    Each method raises :class:`BatchRefused` when the whole call failed, and
    :class:`~openenv_grpc.server.backend.SessionLostError` when the envs are gone.
    """

    @property
    def native(self) -> bool:
        """The envs answer in a native batch form."""
        ...

    async def reset(self, args: ResetArgs) -> BatchOutcome: ...

    async def step(self, args: StepArgs) -> BatchOutcome: ...

    async def state(self, indices: Sequence[int]) -> BatchStates: ...

    async def snapshot(self, indices: Sequence[int]) -> BatchStates:
        """Each env's own snapshot bytes (unsealed), or its error."""
        ...

    async def restore(self, args: RestoreArgs) -> dict[int, RowError]:
        """Hand each env its authenticated bytes; the envs that failed, by index."""
        ...

    async def close(self) -> None:
        """Close every env, once; never raises for what the envs' ``close`` did (logged)."""
        ...

    async def close_strictly(self) -> None:
        """Close every env for a close command.

        Raises:
            Exception: what an env's ``close`` raised (closed all the same).
        """
        ...


class LocalBatchCalls:
    """A batch in this process (or in an env process), called through one runner: the
    whole call runs where one env call of this env would run.

    A call gets ``call_timeout`` seconds per env it names. Past that the batch is
    abandoned (closed once its call returns) and replaced by a fresh one, as a single
    session's env is: every env of the stream starts over.
    """

    __slots__ = ("_batch", "_make", "_runner", "_timeout")

    def __init__(
        self,
        runner: EnvRunner,
        make: Callable[[], Awaitable[EnvRunner]],
        call_timeout: float | None,
    ) -> None:
        self._runner = runner
        self._batch: Any = runner.env  # a VectorBatch (see vector_batch.batch_spec)
        self._make = make
        self._timeout = call_timeout

    @classmethod
    async def create(
        cls, make: Callable[[], Awaitable[EnvRunner]], call_timeout: float | None
    ) -> LocalBatchCalls:
        """Build the batch with ``make`` (which owns the slots from then on).

        Raises:
            Exception: what building the batch raised.
        """
        return cls(await make(), make, call_timeout)

    @property
    def native(self) -> bool:
        batch: VectorBatch = self._batch
        return batch.native

    async def reset(self, args: ResetArgs) -> BatchOutcome:
        batch = self._batch
        result: BatchOutcome = await self._call(
            "reset", len(args.indices), batch.reset, args.indices, args.seeds,
            args.episode_ids, args.options, args.batch_form,
        )  # fmt: skip
        return result

    async def step(self, args: StepArgs) -> BatchOutcome:
        result: BatchOutcome = await self._call(
            "step", len(args.indices), self._batch.step, args.indices, args.actions,
            args.batch_form,
        )  # fmt: skip
        return result

    async def state(self, indices: Sequence[int]) -> BatchStates:
        result: BatchStates = await self._call("state", len(indices), self._batch.state, indices)
        return result

    async def snapshot(self, indices: Sequence[int]) -> BatchStates:
        batch = self._batch
        result: BatchStates = await self._call("snapshot", len(indices), batch.snapshot, indices)
        return result

    async def restore(self, args: RestoreArgs) -> dict[int, RowError]:
        result: dict[int, RowError] = await self._call(
            "restore", len(args.indices), self._batch.restore, args.indices, args.states,
            args.ended,
        )  # fmt: skip
        return result

    async def close(self) -> None:
        await self._runner.close_quietly()

    async def close_strictly(self) -> None:
        await self._runner.close()

    async def _call(self, what: str, envs: int, method: Any, *args: Any) -> Any:
        timeout = None if self._timeout is None else self._timeout * max(envs, 1)
        try:
            return await self._runner.call_within(timeout, method, *args)
        except TimeoutError:
            await self._replace(what, timeout or 0.0)
        except PoolSaturated as exc:
            raise BatchRefused(_RESOURCE_EXHAUSTED, str(exc), saturated=True) from None
        except InvalidAction as exc:
            raise BatchRefused(_INVALID_ARGUMENT, str(exc), _qualname(exc)) from None
        except Exception as exc:
            log.exception("the batch's %s() raised", what)
            raise BatchRefused(
                _INTERNAL, f"{what} failed: {_describe(exc)}", _qualname(exc), broken=True
            ) from None

    async def _replace(self, what: str, timeout: float) -> None:
        """Abandon the hung batch, make a fresh one, and refuse the call.

        Raises:
            BatchRefused: always (DEADLINE_EXCEEDED; or the end of the stream when no
                fresh batch can be made).
        """
        self._runner.abandon()
        try:
            self._runner = await self._make()
        except NoSlot as exc:
            raise BatchRefused(
                _RESOURCE_EXHAUSTED,
                f"{what} did not finish within {timeout:g}s and no fresh environments can "
                f"be made: {exc}; the session ends",
                ends=True,
            ) from None
        except Exception as exc:
            log.exception("building a batch to replace a hung one raised")
            raise BatchRefused(
                _INTERNAL,
                f"the environments hung and new ones could not be created: {_describe(exc)}",
                _qualname(exc),
                ends=True,
            ) from None
        self._batch = self._runner.env
        raise BatchRefused(
            _DEADLINE_EXCEEDED,
            f"{what} did not finish within {timeout:g}s; every environment of this stream "
            "was replaced with a fresh one: reset them",
            replaced=True,
        )


class _Refused(Exception):
    """A request refused as a whole before any env was called."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class VectorDriver:
    """The request handler of one vector stream of ``size`` envs (``backend.SessionBackend``)."""

    __slots__ = (
        "_action_url", "_all", "_calling", "_calls", "_ends", "_max_response", "_mode",
        "_obs_url", "_seal", "_size", "_spec", "_state_url", "_steppable", "episode_ids",
        "phases", "step_counts",
    )  # fmt: skip

    def __init__(
        self,
        spec: EnvSpec,
        size: int,
        autoreset: AutoresetMode,
        calls: BatchCalls,
        snapshots: SnapshotSeal | None = None,
        *,
        max_response: int | None = None,
    ) -> None:
        self._spec = spec
        #: Seals and opens the envs' snapshots (the server's key ring and size limit).
        self._seal = snapshots if snapshots is not None else default_seal(spec.name, spec.version)
        #: The largest response the stream may send (--max-message-bytes); None: no check
        #: here (the session still checks the serialized answer).
        self._max_response = max_response
        self._size = size
        self._mode = autoreset
        self._calls = calls
        self._obs_url = spec.observation_url
        self._state_url = spec.state_url
        self._action_url = spec.action_url
        #: Every index, in order: what an empty index list means (never mutated).
        self._all: Sequence[int] = range(size)
        #: The phases in which an env may be stepped: under NEXT_STEP an ended episode
        #: steps into an autoreset.
        self._steppable = {_Phase.RUNNING}
        if autoreset is AutoresetMode.NEXT_STEP:
            self._steppable |= {_Phase.TERMINATED, _Phase.TRUNCATED}
        self.phases = [_Phase.NO_EPISODE] * size
        self.episode_ids = [""] * size
        self.step_counts = [0] * size
        self._ends = False
        #: The indices of the reset or step under way (a refused batch call breaks them).
        self._calling: Sequence[int] = ()

    @property
    def native(self) -> bool:
        """The stream's envs answer in a native batch form."""
        return self._calls.native

    async def handle(self, raw: bytes) -> Answer:
        """Answer one serialized request. Never raises for anything the envs did.

        Raises:
            UndecodableRequest: ``raw`` is not a VectorSessionRequest (no id to answer to).
            SessionLostError: the envs are gone (their env processes died for good).
        """
        try:
            request = pb.VectorSessionRequest.FromString(raw)
        except DecodeError as exc:
            raise UndecodableRequest(f"request is not a valid {_REQUEST_NAME}: {exc}") from None
        response = pb.VectorSessionResponse(request_id=request.request_id)
        command = request.WhichOneof("command")
        try:
            if command == "step":
                return await self._step(request.step, response)
            if command == "reset":
                return await self._reset(request.reset, response)
            if command == "state":
                return await self._state(request.state, response)
            if command == "snapshot":
                return await self._snapshot(request.snapshot, response)
            if command == "restore":
                return await self._restore(request.restore, response)
            if command == "close":
                self._ends = True
                try:
                    await self._calls.close_strictly()
                except Exception as exc:
                    log.exception("environment close() raised")
                    raise _Refused(_INTERNAL, f"close failed: {_describe(exc)}") from None
                response.closed.SetInParent()
                return Answer(response.SerializeToString(), Outcome.CLOSED, ends=True)
            raise _Refused(
                _INVALID_ARGUMENT,
                "empty request: set one of reset, step, state, snapshot, restore, close",
            )
        except _Refused as err:
            return self._refusal(response, err.code, err.message)
        except BatchRefused as err:
            self._after_refusal(err, command)
            return self._refusal(response, err.code, err.message, err)

    async def close(self) -> None:
        """Close every env, once (``backend.SessionBackend``)."""
        await self._calls.close()

    # -- commands -------------------------------------------------------------------------

    async def _step(self, command: pb.VectorStep, response: pb.VectorSessionResponse) -> Answer:
        if command.answer_mode not in _ANSWER_MODES:
            raise _Refused(
                _INVALID_ARGUMENT,
                f"answer_mode {command.answer_mode} is not known to this server "
                "(VECTOR_ANSWER_MODE_ALL is)",
            )
        indices = self._indices(command.indices)
        action_class = self._spec.types.action
        phases, steppable = self.phases, self._steppable
        blocked: dict[int, RowError] = {}
        if command.HasField("batch_action"):
            if command.actions:
                raise _Refused(_INVALID_ARGUMENT, "give actions or batch_action, not both")
            self._need_native("batch_action")
            decoded: Any = _decode(command.batch_action, action_class, "batch_action")
            cannot = [i for i in indices if phases[i] not in steppable]
            if cannot:  # a batch-form action cannot leave out a row: refuse it all
                raise _Refused(
                    _FAILED_PRECONDITION,
                    "with batch_action every env named must be able to step; "
                    + "; ".join(f"env {i}: {_NEEDS_RESET[phases[i]]}" for i in cannot[:8])
                    + ("; ..." if len(cannot) > 8 else ""),
                )
            args = StepArgs(indices, decoded, command.batch_action, True)
        else:
            actions = command.actions
            if len(actions) != len(indices):
                raise _Refused(
                    _INVALID_ARGUMENT,
                    f"{len(actions)} actions for {len(indices)} envs: give one action per "
                    "env named (all envs when indices is empty), or batch_action",
                )
            url, parse = self._action_url, action_class.FromString
            try:  # the common case: every url is the one we send, every payload parses
                decoded = [parse(a.value) if a.type_url == url else None for a in actions]
            except DecodeError:
                decoded = [None] * len(actions)
            if None in decoded:  # find the culprit, and say what is wrong with it
                decoded = [
                    _decode(action, action_class, f"action {k} (env {index})")
                    for k, (index, action) in enumerate(zip(indices, actions, strict=True))
                ]
            wire: Any = actions
            # The phases of the envs named, as a set: one pass in C for the common case
            # where every one may step.
            named = set(phases) if indices is self._all else {phases[i] for i in indices}
            if not named <= steppable:
                for index in indices:
                    if phases[index] not in steppable:
                        blocked[index] = RowError(
                            _FAILED_PRECONDITION, f"env {index}: {_NEEDS_RESET[phases[index]]}"
                        )
            if blocked:  # the others step; these answer their own errors
                keep = [k for k, index in enumerate(indices) if index not in blocked]
                indices = [indices[k] for k in keep]
                decoded = [decoded[k] for k in keep]
                wire = [actions[k] for k in keep]
            args = StepArgs(indices, decoded, wire, False)
        started = time.perf_counter()
        self._calling = indices
        outcome = await self._calls.step(args) if indices else BatchOutcome()
        seconds = time.perf_counter() - started
        outcome.errors.update(blocked)
        stepped = self._book_step(outcome)
        too_large = self._too_large("step", _result_bytes(outcome))
        if too_large is not None:
            return self._oversize(
                response, too_large, Outcome.STEPPED, outcome.errors, seconds, stepped
            )
        self._fill(response.result, outcome)
        return self._answer(response, Outcome.STEPPED, outcome.errors, seconds, stepped)

    async def _reset(self, command: pb.VectorReset, response: pb.VectorSessionResponse) -> Answer:
        indices = self._indices(command.indices)
        batch_form = command.batch_observation
        if batch_form:
            self._need_native("batch_observation")
        count = len(indices)
        commands = command.envs
        if commands and len(commands) != count:
            raise _Refused(
                _INVALID_ARGUMENT,
                f"{len(commands)} resets for {count} envs: give one per env named (all envs "
                "when indices is empty), or none",
            )
        seeds: list[int | None] = [None] * count
        episode_ids = [uuid.uuid4().hex for _ in range(count)]
        options: list[Message | None] = [None] * count
        wire: list[any_pb2.Any | None] = [None] * count
        options_class = self._spec.types.reset_options
        for k, reset in enumerate(commands):
            index = indices[k]
            if reset.HasField("seed"):
                seeds[k] = reset.seed
            if reset.HasField("episode_id"):
                size = len(reset.episode_id.encode())
                if size > MAX_EPISODE_ID_BYTES:
                    raise _Refused(
                        _INVALID_ARGUMENT,
                        f"env {index}: episode_id is {size} bytes; at most "
                        f"{MAX_EPISODE_ID_BYTES} are allowed (nothing was reset)",
                    )
                episode_ids[k] = reset.episode_id
            if reset.HasField("options"):
                size = len(reset.options.value)
                if size > MAX_RESET_OPTIONS_BYTES:
                    raise _Refused(
                        _INVALID_ARGUMENT,
                        f"env {index}: reset options are {size} bytes; at most "
                        f"{MAX_RESET_OPTIONS_BYTES} are allowed (nothing was reset)",
                    )
                options[k] = _decode(
                    reset.options, options_class, f"reset options {k} (env {index})"
                )
                wire[k] = reset.options
        args = ResetArgs(indices, seeds, episode_ids, options, wire, batch_form)
        self._calling = indices
        outcome = await self._calls.reset(args)
        chosen = dict(zip(indices, episode_ids, strict=True))
        phases, ids, counts = self.phases, self.episode_ids, self.step_counts
        for index, terminated, truncated in zip(
            outcome.rows, outcome.terminated, outcome.truncated, strict=True
        ):
            ids[index] = chosen[index]
            counts[index] = 0
            phases[index] = _ended_phase(terminated, truncated)
        self._book_errors(outcome.errors)
        too_large = self._too_large("reset", _result_bytes(outcome))
        if too_large is not None:
            return self._oversize(response, too_large, Outcome.RESET, outcome.errors)
        self._fill(response.result, outcome)
        return self._answer(response, Outcome.RESET, outcome.errors)

    async def _state(self, command: pb.VectorState, response: pb.VectorSessionResponse) -> Answer:
        indices = self._indices(command.indices)
        states, payload = await self._states_within(indices)
        too_large = self._too_large("state", payload)
        if too_large is not None:
            return self._oversize(response, too_large, Outcome.STATE, states.errors)
        fill_states(response.states, states, self._state_url, self.episode_ids, self.step_counts)
        return self._answer(response, Outcome.STATE, states.errors)

    async def _snapshot(
        self, command: pb.VectorSnapshot, response: pb.VectorSessionResponse
    ) -> Answer:
        """Capture each env named, sealed with its bookkeeping; no episode changes."""
        indices = self._indices(command.indices)
        answer = response.snapshots
        answer.SetInParent()
        errors = self._without_snapshots(indices)
        if errors is None:
            errors = {}
            phases = self.phases
            capture = [i for i in indices if phases[i] in _CAPTURED_PHASE]
            for index in indices:
                if phases[index] not in _CAPTURED_PHASE:
                    errors[index] = RowError(
                        _FAILED_PRECONDITION, f"env {index}: {_NOTHING_TO_CAPTURE[phases[index]]}"
                    )
            self._calling = capture
            got, payload = (
                await self._states_within(capture, self._calls.snapshot)
                if capture
                else (BatchStates(), 0)
            )
            too_large = self._too_large("snapshot", payload)
            if too_large is not None:
                errors.update(got.errors)
                return self._oversize(response, too_large, Outcome.SNAPSHOT, errors)
            errors.update(got.errors)
            ids, counts = self.episode_ids, self.step_counts
            captured = [
                Captured(ids[i], counts[i], _CAPTURED_PHASE[phases[i]], data)
                for i, data in zip(got.rows, got.states, strict=True)
            ]
            size = sum(len(data) for data in got.states)
            sealed = await sealing(lambda: self._seal.seal_each(captured), size)
            for index, one in zip(got.rows, sealed, strict=True):
                if isinstance(one, SnapshotRefused):
                    errors[index] = RowError(one.code, f"env {index}: {one.message}")
                    continue
                answer.indices.append(index)
                answer.snapshots.add(snapshot=one, episode_id=ids[index], step_count=counts[index])
        fill_errors(answer.errors, errors)
        return self._answer(response, Outcome.SNAPSHOT, errors)

    async def _restore(
        self, command: pb.VectorRestore, response: pb.VectorSessionResponse
    ) -> Answer:
        """Authenticate each snapshot, hand the envs theirs, and take over the captured
        bookkeeping; a refused snapshot leaves that env's episode as it was."""
        indices = self._indices(command.indices)
        data = command.snapshots
        if len(data) != len(indices):
            raise _Refused(
                _INVALID_ARGUMENT,
                f"{len(data)} snapshots for {len(indices)} envs: give one per env named (all "
                "envs when indices is empty); nothing was restored",
            )
        answer = response.restored
        answer.SetInParent()
        errors = self._without_snapshots(indices)
        if errors is None:
            errors = {}
            size = sum(len(one) for one in data)
            opened = await sealing(lambda: self._seal.open_each(data), size)
            named: list[int] = []
            captured: list[Captured] = []
            for index, one in zip(indices, opened, strict=True):
                if isinstance(one, SnapshotRefused):
                    errors[index] = RowError(one.code, f"env {index}: {one.message}")
                else:
                    named.append(index)
                    captured.append(one)
            self._calling = named
            failed = await self._calls.restore(RestoreArgs(named, captured)) if named else {}
            phases, ids, counts = self.phases, self.episode_ids, self.step_counts
            for index, one in zip(named, captured, strict=True):
                if index in failed:
                    continue
                ids[index] = one.episode_id
                counts[index] = one.step_count
                phase = phases[index] = _RESTORED_PHASE[one.phase]
                answer.indices.append(index)
                answer.restored.add(
                    episode_id=one.episode_id,
                    step_count=one.step_count,
                    terminated=phase is _Phase.TERMINATED,
                    truncated=phase is _Phase.TRUNCATED,
                )
            self._book_errors(failed)
            errors.update(failed)
        fill_errors(answer.errors, errors)
        return self._answer(response, Outcome.RESTORED, errors)

    def _without_snapshots(self, indices: Sequence[int]) -> dict[int, RowError] | None:
        """UNIMPLEMENTED for every env named when the env has no snapshots; else None."""
        if self._spec.snapshots:
            return None
        error = RowError(
            _UNIMPLEMENTED,
            f"environment {self._spec.name!r} does not support snapshots (it does not "
            "implement snapshot() and restore()); the stream goes on",
        )
        return dict.fromkeys(indices, error)

    async def _states_within(
        self,
        indices: Sequence[int],
        read: Callable[[Sequence[int]], Awaitable[BatchStates]] | None = None,
    ) -> tuple[BatchStates, int]:
        """The states (or, with ``read=self._calls.snapshot``, the snapshots) of
        ``indices`` and their bytes, read no further than the message limit: a first call
        about a few envs measures one's size, the next ones name as many envs as fit in
        what is left of the limit (all the others, usually). Once over the limit the envs
        not read yet are left alone, so one small request never makes the envs build much
        more than one message of them (N envs' frames or snapshots would be N times one)."""
        read = read or self._calls.state
        limit, count = self._max_response, len(indices)
        if limit is None or count <= _STATE_PROBE:
            states = await read(indices)
            return states, sum(map(len, states.states))
        out = BatchStates()
        payload = start = 0
        chunk = _STATE_PROBE
        while start < count:
            part = await read(indices[start : start + chunk])
            out.rows.extend(part.rows)
            out.states.extend(part.states)
            out.errors.update(part.errors)
            payload += sum(map(len, part.states))
            start += chunk
            if payload > limit:
                break
            per_env = payload / start
            chunk = count if not per_env else int((limit - payload) / per_env) + 1
        return out, payload

    # -- bookkeeping ----------------------------------------------------------------------

    def _book_step(self, outcome: BatchOutcome) -> int:
        """Advance each env's episode from a step's rows; returns the env steps taken
        (a NEXT_STEP autoreset row took none)."""
        # Every env answered: the rows are 0 .. size - 1, booked as whole columns.
        full = len(outcome.rows) == self._size
        stepped = self._book_all(outcome) if full else self._book_rows(outcome)
        self._book_errors(outcome.errors, stepping=True)
        return stepped

    def _book_all(self, outcome: BatchOutcome) -> int:
        """:meth:`_book_step` when every env has a row: whole columns at once."""
        terminated, truncated, marks = outcome.terminated, outcome.truncated, outcome.autoreset
        running, ended, cut = _Phase.RUNNING, _Phase.TERMINATED, _Phase.TRUNCATED
        if marks is None:
            self.step_counts = [count + 1 for count in self.step_counts]
            if True in terminated or True in truncated:
                self.phases = [
                    ended if term else cut if trunc else running
                    for term, trunc in zip(terminated, truncated, strict=True)
                ]
            else:
                self.phases = [running] * self._size
            return self._size
        self.step_counts = [
            0 if auto else count + 1 for count, auto in zip(self.step_counts, marks, strict=True)
        ]
        self.phases = [
            running if auto else ended if term else cut if trunc else running
            for term, trunc, auto in zip(terminated, truncated, marks, strict=True)
        ]
        ids, new_ids = self.episode_ids, outcome.new_episode_ids
        autoreset = [index for index, auto in enumerate(marks) if auto]
        for index in autoreset:  # a new episode began: the row's observation is its first
            ids[index] = new_ids.get(index) or uuid.uuid4().hex
        if self._mode is AutoresetMode.SAME_STEP:
            return self._size  # SAME_STEP's autoreset rows also took the ending step
        return self._size - len(autoreset)

    def _book_rows(self, outcome: BatchOutcome) -> int:
        """:meth:`_book_step` for some envs' rows, one by one."""
        phases, ids, counts = self.phases, self.episode_ids, self.step_counts
        marks = outcome.autoreset
        stepped = 0
        if marks is None:
            for index, terminated, truncated in zip(
                outcome.rows, outcome.terminated, outcome.truncated, strict=True
            ):
                counts[index] += 1
                phases[index] = _ended_phase(terminated, truncated)
            return len(outcome.rows)
        same_step = self._mode is AutoresetMode.SAME_STEP
        new_ids = outcome.new_episode_ids
        for index, terminated, truncated, auto in zip(
            outcome.rows, outcome.terminated, outcome.truncated, marks, strict=True
        ):
            if auto:  # a new episode began: the row's observation is its first
                ids[index] = new_ids.get(index) or uuid.uuid4().hex
                counts[index] = 0
                phases[index] = _Phase.RUNNING
                stepped += same_step  # SAME_STEP's row also took the ending step
            else:
                counts[index] += 1
                phases[index] = _ended_phase(terminated, truncated)
                stepped += 1
        return stepped

    def _book_errors(self, errors: dict[int, RowError], stepping: bool = False) -> None:
        # An env may keep its episode after a step that raised (step_errors_end_episode).
        keep = stepping and not getattr(self._spec.env_class, "step_errors_end_episode", True)
        for index, error in errors.items():
            if error.code == _INTERNAL:
                if not keep:
                    self.phases[index] = _Phase.BROKEN
            elif error.code in _REPLACED:  # a fresh env took its place
                self._forget(index)

    def _forget(self, index: int) -> None:
        self.phases[index] = _Phase.NO_EPISODE
        self.episode_ids[index] = ""
        self.step_counts[index] = 0

    def _after_refusal(self, err: BatchRefused, command: str | None) -> None:
        if err.ends:
            self._ends = True
        if err.replaced or err.ends:
            for index in range(self._size):
                self._forget(index)
        elif err.broken and command not in ("state", "snapshot"):  # those change nothing
            for index in self._calling:
                if self.phases[index] is not _Phase.NO_EPISODE:
                    self.phases[index] = _Phase.BROKEN

    # -- the wire ---------------------------------------------------------------------------

    def _fill(self, result: pb.VectorResult, outcome: BatchOutcome) -> None:
        """Copy a batch's outcome and the envs' bookkeeping into the wire's columns."""
        ids, counts = self.episode_ids, self.step_counts
        rows = outcome.rows
        if len(rows) != self._size:  # else rows are every env in order: the lists as they are
            ids, counts = [ids[i] for i in rows], [counts[i] for i in rows]
        fill_result(result, outcome, self._obs_url, ids, counts)

    def _answer(
        self,
        response: pb.VectorSessionResponse,
        outcome: Outcome,
        errors: dict[int, RowError],
        seconds: float = 0.0,
        steps: int = 0,
    ) -> Answer:
        codes = tuple(_CODE_NAMES.get(e.code, str(e.code)) for e in errors.values())
        return Answer(response.SerializeToString(), outcome, seconds, steps=steps, env_errors=codes)

    def _too_large(self, command: str, payload: int) -> str | None:
        """The in-band message for a result whose payloads alone (``payload`` bytes: a lower
        bound of its size) are over the message limit; None when they are not.

        Checked before the columns are filled: an over-large answer would only be built
        and serialized on the event loop to be thrown away (N frames of N envs' states
        are hundreds of MB from one small request). The session checks the serialized
        answer too, for what this bound does not see (infos, ids, framing)."""
        limit = self._max_response
        if limit is None or payload <= limit:
            return None
        return (
            f"the {command} response is at least {payload} bytes, over the server's message "
            f"limit of {limit} bytes (--max-message-bytes): the {command} took effect but "
            "its result cannot be sent (name fewer envs per request, by indices); the "
            "session goes on"
        )

    def _oversize(
        self,
        response: pb.VectorSessionResponse,
        message: str,
        outcome: Outcome,
        errors: dict[int, RowError],
        seconds: float = 0.0,
        steps: int = 0,
    ) -> Answer:
        """The RESOURCE_EXHAUSTED answer of a call that took effect but whose result is
        over the limit; counted as the session counts such an answer: the call's steps
        and per-env errors, and one RESOURCE_EXHAUSTED."""
        response.ClearField("outcome")
        response.error.code = _RESOURCE_EXHAUSTED
        response.error.message = message
        codes = tuple(_CODE_NAMES.get(e.code, str(e.code)) for e in errors.values())
        return Answer(
            response.SerializeToString(), outcome, seconds, steps=steps,
            env_errors=(*codes, grpc.StatusCode.RESOURCE_EXHAUSTED.name),
        )  # fmt: skip

    def _refusal(
        self,
        response: pb.VectorSessionResponse,
        code: int,
        message: str,
        err: BatchRefused | None = None,
    ) -> Answer:
        response.ClearField("outcome")
        error = response.error
        error.code = code
        error.message = message
        if err is not None:
            error.exception_type = err.exception_type
        saturated = err is not None and err.saturated
        name = _CODE_NAMES.get(code, str(code))
        return Answer(
            response.SerializeToString(),
            Outcome.SATURATED if saturated else Outcome.FAILED,
            0.0,
            name,
            self._ends,
        )

    # -- validation -------------------------------------------------------------------------

    def _indices(self, given: Sequence[int]) -> Sequence[int]:
        """The env indices a request names (all when empty), checked.

        Raises:
            _Refused: an index is out of range, repeated or out of order.
        """
        if not given:
            return self._all
        size = self._size
        if len(given) > size:  # before copying: a few MB of indices would hold the loop
            raise _Refused(
                _INVALID_ARGUMENT,
                f"{len(given)} indices for a stream of {size} envs: each env at most once, "
                "strictly increasing; nothing was done",
            )
        indices = list(given)
        previous = -1
        for index in indices:
            if index <= previous or index >= size:
                raise _Refused(_INVALID_ARGUMENT, _bad_indices(indices, size))
            previous = index
        return indices

    def _need_native(self, what: str) -> None:
        if not self._calls.native:
            raise _Refused(
                _INVALID_ARGUMENT,
                f"{what} needs envs that batch natively, and this stream's envs are a loop "
                "over plain instances (the openenv-batch header said 'loop'): give one "
                "payload per env instead",
            )


def _bad_indices(indices: list[int], size: int) -> str:
    """What is wrong with a list of indices that failed the check."""
    seen: set[int] = set()
    previous = -1
    for index in indices:
        if index >= size:
            return (
                f"index {index} is out of range: this stream holds {size} envs "
                f"(0..{size - 1}); nothing was done"
            )
        if index in seen:
            return f"index {index} is repeated; nothing was done"
        if index < previous:
            return (
                f"indices must be strictly increasing: {index} after {previous}; nothing was done"
            )
        seen.add(index)
        previous = index
    return "bad indices"


def _result_bytes(outcome: BatchOutcome) -> int:
    """The bytes of a result's observations: a lower bound of its serialized size."""
    size = sum(map(len, outcome.observations)) + sum(map(len, outcome.final_observations))
    for batch in (outcome.batch_observation, outcome.batch_final_observation):
        if batch is not None:
            size += len(batch)
    return size


def _ended_phase(terminated: bool, truncated: bool) -> _Phase:
    if terminated:
        return _Phase.TERMINATED
    if truncated:
        return _Phase.TRUNCATED
    return _Phase.RUNNING


def _decode(payload: any_pb2.Any, message_class: type[Message], what: str) -> Message:
    try:
        return decode_payload(payload, message_class, what)
    except PayloadRefused as exc:
        raise _Refused(_INVALID_ARGUMENT, f"{exc}; nothing was done") from None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _qualname(exc: BaseException) -> str:
    kind = type(exc)
    return f"{kind.__module__}.{kind.__qualname__}"
