"""A VectorSession stream's requests and answers, over the driver's N envs: each request
is checked before any env is touched (indices, one payload per env, payload types and
caps) and refused as a whole with INVALID_ARGUMENT; the envs' results become the wire's
columns, with per-env errors by index."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError, Message

from openenv_grpc.server.errors import CODE_NAMES, RequestError, RowError
from openenv_grpc.server.local.batch import BatchOutcome
from openenv_grpc.server.local.calls import BatchRefused, ResetArgs, StepArgs
from openenv_grpc.server.local.frames import fill_errors, fill_result, fill_states
from openenv_grpc.server.model.commands import command_table, empty_request
from openenv_grpc.server.model.payloads import PayloadRefused, decode_payload, reset_problem
from openenv_grpc.server.model.phases import Phase, new_episode_id
from openenv_grpc.server.stream.backend import (
    Answer,
    Outcome,
    error_answer,
    exhausted,
    parse_request,
)
from openenv_grpc.server.stream.driver import Driver
from openenv_grpc.v1 import session_pb2 as pb

__all__ = ["VectorView"]

_INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
_ANSWER_MODES = {pb.VECTOR_ANSWER_MODE_UNSPECIFIED, pb.VECTOR_ANSWER_MODE_ALL}
_EMPTY = empty_request(pb.VectorSessionRequest)
_Req = pb.VectorSessionRequest
_Resp = pb.VectorSessionResponse


class _Done(NamedTuple):
    """What a command did, for its answer: the per-env errors, a step's seconds and steps,
    and the message of a result that took effect but is over the message limit."""

    errors: dict[int, RowError]
    seconds: float = 0.0
    steps: int = 0
    too_large: str | None = None


@dataclass(frozen=True, slots=True)
class _Command:
    """One command of a vector stream: what answers it (on the env indices it names,
    checked and held for it when ``holds``), and what its answer is to the session."""

    run: Callable[[VectorView, _Req, Sequence[int], _Resp], Awaitable[_Done]]
    outcome: Outcome = Outcome.ANSWERED
    holds: bool = True
    ends: bool = False  # the stream ends after this answer


class VectorView:
    """The request handler of one vector stream (``backend.SessionBackend``)."""

    __slots__ = ("_action_url", "_driver", "_info_json", "_obs_url", "_spec", "_state_url")

    def __init__(self, driver: Driver, info_json: bool = False) -> None:
        self._driver = driver
        self._info_json = info_json  # the client reads infos as JSON text
        spec = self._spec = driver.spec
        self._obs_url = spec.observation_url
        self._state_url = spec.state_url
        self._action_url = spec.action_url

    @property
    def driver(self) -> Driver:
        return self._driver

    @property
    def native(self) -> bool:
        return self._driver.native

    async def handle(self, raw: bytes) -> Answer:
        """Answer one serialized request; raises UndecodableRequest or SessionLostError
        (the envs are gone), never for anything the envs did."""
        request = parse_request(raw, pb.VectorSessionRequest)
        request_id = request.request_id
        response = pb.VectorSessionResponse(request_id=request_id)
        command = request.WhichOneof("command")
        entry = _COMMANDS[command]
        driver = self._driver
        held: Sequence[int] = ()
        try:
            if entry.holds:
                indices = self._indices(getattr(request, str(command)).indices)
                driver.hold(indices, request_id)
                held = indices  # once held: a refused hold lets go of nothing
            done = await entry.run(self, request, held, response)
        except RequestError as err:
            return error_answer(response, err, driver.ends)
        except BatchRefused as err:
            driver.refused(err, command)
            return error_answer(response, err, driver.ends)
        finally:
            if held:
                driver.let_go(held)
        errors = done.errors
        codes = (
            tuple(CODE_NAMES.get(e.code, str(e.code)) for e in errors.values()) if errors else ()
        )
        if done.too_large is None:
            serialized = response.SerializeToString()
            return Answer(
                serialized, entry.outcome, done.seconds, "", entry.ends, done.steps, codes
            )
        # It took effect: counted as its steps, its per-env errors and a RESOURCE_EXHAUSTED.
        return Answer(
            exhausted(response, done.too_large), entry.outcome, done.seconds, steps=done.steps,
            env_errors=(*codes, grpc.StatusCode.RESOURCE_EXHAUSTED.name),
        )  # fmt: skip

    async def close(self) -> None:
        await self._driver.close()

    # -- commands -------------------------------------------------------------------------

    async def _step(self, request: _Req, indices: Sequence[int], response: _Resp) -> _Done:
        command = request.step
        driver = self._driver
        if command.answer_mode not in _ANSWER_MODES:
            raise RequestError(
                _INVALID_ARGUMENT,
                f"answer_mode {command.answer_mode} is not known to this server "
                "(VECTOR_ANSWER_MODE_ALL is)",
            )
        action_class = self._spec.types.action
        blocked: dict[int, RowError] = {}
        if command.HasField("batch_action"):
            if command.actions:
                raise RequestError(_INVALID_ARGUMENT, "give actions or batch_action, not both")
            self._need_native("batch_action")
            decoded: Any = _decode(command.batch_action, action_class, "batch_action")
            # One pass in C for the common case where every env named may step.
            cannot = (
                [(i, why) for i in indices if (why := driver.cannot_step(i)) is not None]
                if driver.blocked(indices)
                else []
            )
            if cannot:  # a batch-form action cannot leave out a row: refuse it all
                raise RequestError(
                    _FAILED_PRECONDITION,
                    "with batch_action every env named must be able to step; "
                    + "; ".join(f"env {i}: {why}" for i, why in cannot[:8])
                    + ("; ..." if len(cannot) > 8 else ""),
                )
            args = StepArgs(indices, decoded, True)
        else:
            actions = command.actions
            if len(actions) != len(indices):
                raise RequestError(
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
            blocked = driver.blocked(indices)
            if blocked:  # the others step; these answer their own errors
                keep = [k for k, index in enumerate(indices) if index not in blocked]
                indices = [indices[k] for k in keep]
                decoded = [decoded[k] for k in keep]
            args = StepArgs(indices, decoded, False)
        outcome, stepped, seconds = await driver.step(args)
        outcome.errors.update(blocked)
        too_large = driver.too_large("step", _result_bytes(outcome))
        if too_large is None:
            self._fill(response.result, outcome)
        return _Done(outcome.errors, seconds, stepped, too_large)

    async def _reset(self, request: _Req, indices: Sequence[int], response: _Resp) -> _Done:
        command = request.reset
        batch_form = command.batch_observation
        if batch_form:
            self._need_native("batch_observation")
        count = len(indices)
        commands = command.envs
        if commands and len(commands) != count:
            raise RequestError(
                _INVALID_ARGUMENT,
                f"{len(commands)} resets for {count} envs: give one per env named (all envs "
                "when indices is empty), or none",
            )
        seeds: list[int | None] = [None] * count
        episode_ids = [new_episode_id() for _ in range(count)]
        options: list[Message | None] = [None] * count
        options_class = self._spec.types.reset_options
        for k, reset in enumerate(commands):
            index = indices[k]
            problem = reset_problem(reset)
            if problem is not None:
                raise RequestError(_INVALID_ARGUMENT, f"env {index}: {problem} (nothing was reset)")
            if reset.HasField("seed"):
                seeds[k] = reset.seed
            if reset.HasField("episode_id"):
                episode_ids[k] = reset.episode_id
            if reset.HasField("options"):
                what = f"reset options {k} (env {index})"
                options[k] = _decode(reset.options, options_class, what)
        args = ResetArgs(indices, seeds, episode_ids, options, batch_form)
        outcome = await self._driver.reset(args)
        too_large = self._driver.too_large("reset", _result_bytes(outcome))
        if too_large is None:
            self._fill(response.result, outcome)
        return _Done(outcome.errors, too_large=too_large)

    async def _state(self, request: _Req, indices: Sequence[int], response: _Resp) -> _Done:
        driver = self._driver
        states, payload = await driver.query("state", indices)
        too_large = driver.too_large("state", payload)
        if too_large is None:
            ids, counts = driver.episode_ids, driver.step_counts
            fill_states(response.states, states, self._state_url, ids, counts)
        return _Done(states.errors, too_large=too_large)

    async def _snapshot(self, request: _Req, indices: Sequence[int], response: _Resp) -> _Done:
        driver = self._driver
        answer = response.snapshots
        answer.SetInParent()
        sealed = await driver.snapshot(indices)
        if sealed.too_large is not None:
            return _Done(sealed.errors, too_large=sealed.too_large)
        ids, counts = driver.episode_ids, driver.step_counts
        for index, one in zip(sealed.rows, sealed.snapshots, strict=True):
            answer.indices.append(index)
            answer.snapshots.add(snapshot=one, episode_id=ids[index], step_count=counts[index])
        fill_errors(answer.errors, sealed.errors)
        return _Done(sealed.errors)

    async def _render(self, request: _Req, indices: Sequence[int], response: _Resp) -> _Done:
        driver = self._driver
        frames, payload = await driver.query("render", indices)
        too_large = driver.too_large("render", payload)
        if too_large is not None:
            return _Done(frames.errors, too_large=too_large)
        answer = response.frames
        answer.SetInParent()
        ids, counts = driver.episode_ids, driver.step_counts
        for index, frame in zip(frames.rows, frames.states, strict=True):
            answer.indices.append(index)
            entry = answer.frames.add(episode_id=ids[index], step_count=counts[index])
            entry.frame.MergeFromString(frame)
        fill_errors(answer.errors, frames.errors)
        return _Done(frames.errors)

    async def _restore(self, request: _Req, indices: Sequence[int], response: _Resp) -> _Done:
        data = request.restore.snapshots
        if len(data) != len(indices):
            raise RequestError(
                _INVALID_ARGUMENT,
                f"{len(data)} snapshots for {len(indices)} envs: give one per env named (all "
                "envs when indices is empty); nothing was restored",
            )
        driver = self._driver
        answer = response.restored
        answer.SetInParent()
        restored = await driver.restore(indices, data)
        ids, counts = driver.episode_ids, driver.step_counts
        for index in restored.rows:
            # As the client knows it: an env lost meanwhile is told at its next request.
            phase = driver.known_phase(index)
            answer.indices.append(index)
            answer.restored.add(
                episode_id=ids[index],
                step_count=counts[index],
                terminated=phase is Phase.TERMINATED,
                truncated=phase is Phase.TRUNCATED,
            )
        fill_errors(answer.errors, restored.errors)
        return _Done(restored.errors)

    async def _close(self, request: _Req, indices: Sequence[int], response: _Resp) -> _Done:
        driver = self._driver
        await driver.closing(request.request_id)  # the requests in flight are answered first
        await driver.close_command()
        response.closed.SetInParent()
        return _Done({})

    async def _empty(self, request: _Req, indices: Sequence[int], response: _Resp) -> _Done:
        raise RequestError(_INVALID_ARGUMENT, _EMPTY)

    # -- the wire and validation ----------------------------------------------------------

    def _fill(self, result: pb.VectorResult, outcome: BatchOutcome) -> None:
        """Copy a batch's outcome and the envs' books into the wire's columns."""
        driver = self._driver
        ids, counts = driver.episode_ids, driver.step_counts
        rows = outcome.rows
        if len(rows) != driver.size:  # else rows are every env in order: the lists as they are
            ids, counts = [ids[i] for i in rows], [counts[i] for i in rows]
        fill_result(result, outcome, self._obs_url, ids, counts, self._info_json)

    def _indices(self, given: Sequence[int]) -> Sequence[int]:
        """The env indices a request names (all when empty); raises RequestError."""
        driver = self._driver
        if not given:
            return driver.all
        size = driver.size
        if len(given) > size:  # before copying: a few MB of indices would hold the loop
            raise RequestError(
                _INVALID_ARGUMENT,
                f"{len(given)} indices for a stream of {size} envs: each env at most once, "
                "strictly increasing; nothing was done",
            )
        indices = list(given)
        previous = -1
        for index in indices:
            if previous < index < size:
                previous = index
                continue
            if index >= size:
                why = (
                    f"index {index} is out of range: this stream holds {size} envs (0..{size - 1})"
                )
            elif index in indices[: indices.index(previous) + 1]:  # those before it increase
                why = f"index {index} is repeated"
            else:
                why = f"indices must be strictly increasing: {index} after {previous}"
            raise RequestError(_INVALID_ARGUMENT, f"{why}; nothing was done")
        return indices

    def _need_native(self, what: str) -> None:
        if not self._driver.native:
            raise RequestError(
                _INVALID_ARGUMENT,
                f"{what} needs envs that batch natively, and this stream's envs are a loop "
                "over plain instances (the openenv-batch header said 'loop'): give one "
                "payload per env instead",
            )


#: Each command by its field (``None``: none set); one left out fails the import.
_COMMANDS = command_table(
    pb.VectorSessionRequest,
    {
        "step": _Command(VectorView._step, Outcome.STEPPED),
        "reset": _Command(VectorView._reset),
        "state": _Command(VectorView._state),
        "snapshot": _Command(VectorView._snapshot),
        "restore": _Command(VectorView._restore),
        "render": _Command(VectorView._render),
        "close": _Command(VectorView._close, Outcome.CLOSED, holds=False, ends=True),
    },
    empty=_Command(VectorView._empty, holds=False),
)


def _result_bytes(outcome: BatchOutcome) -> int:
    """The bytes of a result's observations: a lower bound of its serialized size."""
    size = sum(map(len, outcome.observations)) + sum(map(len, outcome.final_observations))
    for batch in (outcome.batch_observation, outcome.batch_final_observation):
        if batch is not None:
            size += len(batch)
    return size


def _decode(payload: any_pb2.Any, message_class: type[Message], what: str) -> Message:
    try:
        return decode_payload(payload, message_class, what)
    except PayloadRefused as exc:
        raise RequestError(_INVALID_ARGUMENT, f"{exc}; nothing was done") from None
