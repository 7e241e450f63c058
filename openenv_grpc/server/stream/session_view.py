"""A Session stream's requests and answers: row 0 of a driver of one env (autoreset
disabled), in the Session's words (``phases.SESSION_WORDS``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message

from openenv_grpc.codec import PayloadError, unpack
from openenv_grpc.environment import AutoresetMode
from openenv_grpc.server.errors import RequestError, RowError
from openenv_grpc.server.local.batch import BatchOutcome
from openenv_grpc.server.local.calls import BatchCalls, BatchRefused, ResetArgs, StepArgs
from openenv_grpc.server.local.frames import info_text, struct_info
from openenv_grpc.server.model.commands import command_table, empty_request
from openenv_grpc.server.model.payloads import reset_problem
from openenv_grpc.server.model.phases import SESSION_WORDS, Phase, new_episode_id
from openenv_grpc.server.model.snapshots import SnapshotSeal
from openenv_grpc.server.model.spec import EnvSpec
from openenv_grpc.server.stream.backend import Answer, Outcome, error_answer, parse_request
from openenv_grpc.server.stream.driver import Driver
from openenv_grpc.v1 import session_pb2 as pb

__all__ = ["SessionView"]

_INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
_EMPTY = empty_request(pb.SessionRequest)
#: The one row a Session's commands name.
_ROW = (0,)
#: The results that carry row 0's books.
_Result = pb.StepResult | pb.StateResult | pb.SnapshotResult | pb.RestoreResult | pb.RenderResult


@dataclass(frozen=True, slots=True)
class _Command:
    """One command of a Session: what fills its response (returning a step's seconds),
    and what its answer is to the session."""

    run: Callable[[SessionView, pb.SessionRequest, pb.SessionResponse], Awaitable[float]]
    outcome: Outcome = Outcome.ANSWERED
    ends: bool = False  # the stream ends after this answer


class SessionView:
    """The request handler of one Session (``backend.SessionBackend``)."""

    __slots__ = (
        "_action_class", "_driver", "_info_json", "_obs_url", "_options_class", "_state_url",
        "objects", "replacing",
    )  # fmt: skip

    def __init__(
        self,
        spec: EnvSpec,
        calls: BatchCalls,
        snapshots: SnapshotSeal | None = None,
        info_json: bool = False,
        replacing: Callable[[], Awaitable[None] | None] | None = None,
        *,
        objects: bool = False,
    ) -> None:
        self._info_json = info_json  # the client reads info as JSON text
        #: Observations are the env's objects, not serialized (only :meth:`step` and
        #: :meth:`reset` read them then; their caller serializes).
        self.objects = objects
        # The session checks the serialized answer against the message limit itself.
        self._driver = Driver(spec, 1, AutoresetMode.DISABLED, calls, SESSION_WORDS, snapshots)
        #: What to await before the next request, if anything: an env replacing a hung one
        #: (``--isolated``); None: there never is.
        self.replacing = replacing
        self._obs_url = spec.observation_url
        self._state_url = spec.state_url
        self._action_class = spec.types.action
        self._options_class = spec.types.reset_options

    @property
    def driver(self) -> Driver:
        return self._driver

    async def handle(self, raw: bytes) -> Answer:
        """Answer one serialized request; raises UndecodableRequest or SessionLostError
        (the env is gone), never for anything the env did."""
        request = parse_request(raw, pb.SessionRequest)
        response = pb.SessionResponse(request_id=request.request_id)
        command = request.WhichOneof("command")
        entry = _COMMANDS[command]
        try:
            if self.replacing is not None and (waiting := self.replacing()) is not None:
                await waiting
            seconds = await entry.run(self, request, response)
        except RequestError as err:
            return error_answer(response, err, self._driver.ends)
        except BatchRefused as err:
            self._driver.refused(err, command)
            return error_answer(response, err, self._driver.ends)
        return Answer(response.SerializeToString(), entry.outcome, seconds, "", entry.ends)

    async def close(self) -> None:
        await self._driver.close()

    # -- the commands a wire without envelopes calls (the OpenEnv door) --------------------
    # Each raises RequestError or BatchRefused (the caller books it: ``driver.refused``).

    async def step(self, action: Any) -> tuple[BatchOutcome, float]:
        """Step the env: its row 0, and the env call's seconds."""
        driver = self._driver
        why = driver.cannot_step(0)
        if why is not None:
            raise RequestError(_FAILED_PRECONDITION, why)
        outcome, _, seconds = await driver.step(StepArgs(_ROW, (action,), False))
        if outcome.errors:
            _raise(outcome.errors)
        return outcome, seconds

    async def reset(self, command: pb.ResetCommand) -> BatchOutcome:
        """Reset the env as ``command`` says: its row 0."""
        problem = reset_problem(command)
        if problem is not None:
            raise RequestError(_INVALID_ARGUMENT, f"{problem} (the episode is unchanged)")
        options: Message | None = None
        if command.HasField("options"):
            options = _decode(command.options, self._options_class, "reset options")
        episode_id = command.episode_id if command.HasField("episode_id") else new_episode_id()
        seed = command.seed if command.HasField("seed") else None
        args = ResetArgs(_ROW, (seed,), (episode_id,), (options,), False)
        outcome = await self._driver.reset(args)
        _raise(outcome.errors)
        return outcome

    async def state(self) -> bytes:
        """The env's state message, serialized."""
        states, _ = await self._driver.query("state", _ROW)
        _raise(states.errors)
        return states.states[0]

    # -- commands -------------------------------------------------------------------------

    async def _step(self, request: pb.SessionRequest, response: pb.SessionResponse) -> float:
        driver = self._driver
        why = driver.cannot_step(0)  # before the action is read: a step before a reset says so
        if why is not None:
            raise RequestError(_FAILED_PRECONDITION, why)
        action = _decode(request.step.action, self._action_class, "action")
        outcome, _, seconds = await driver.step(StepArgs(_ROW, (action,), False))
        self._fill(outcome, response.result)  # raises row 0's error
        return seconds

    async def _reset(self, request: pb.SessionRequest, response: pb.SessionResponse) -> float:
        self._fill(await self.reset(request.reset), response.result)
        return 0.0

    async def _state(self, request: pb.SessionRequest, response: pb.SessionResponse) -> float:
        result = response.state
        state = await self.state()
        self._books({}, result)
        result.state.type_url = self._state_url
        result.state.value = state
        return 0.0

    async def _snapshot(self, request: pb.SessionRequest, response: pb.SessionResponse) -> float:
        result = response.snapshot
        sealed = await self._driver.snapshot(_ROW)
        self._books(sealed.errors, result)
        result.snapshot = sealed.snapshots[0]
        return 0.0

    async def _render(self, request: pb.SessionRequest, response: pb.SessionResponse) -> float:
        result = response.rendered
        frames, _ = await self._driver.query("render", _ROW)
        self._books(frames.errors, result)
        result.frame.MergeFromString(frames.states[0])
        return 0.0

    async def _restore(self, request: pb.SessionRequest, response: pb.SessionResponse) -> float:
        result = response.restored
        restored = await self._driver.restore(_ROW, (request.restore.snapshot,))
        self._books(restored.errors, result)
        phase = self._driver.known_phase(0)
        result.terminated = phase is Phase.TERMINATED
        result.truncated = phase is Phase.TRUNCATED
        return 0.0

    async def _close(self, request: pb.SessionRequest, response: pb.SessionResponse) -> float:
        await self._driver.close_command()
        response.closed.SetInParent()
        return 0.0

    async def _empty(self, request: pb.SessionRequest, response: pb.SessionResponse) -> float:
        raise RequestError(_INVALID_ARGUMENT, _EMPTY)

    # -- the wire ---------------------------------------------------------------------------

    def _fill(self, outcome: BatchOutcome, result: pb.StepResult) -> None:
        """Copy row 0 of a reset or step into ``result``, or raise its error."""
        self._books(outcome.errors, result)
        observation = result.observation
        observation.type_url = self._obs_url
        observation.value = outcome.observations[0]
        result.reward = outcome.rewards[0]
        if outcome.no_reward:  # the env gave None (its one row): reward 0, said so
            result.no_reward = True
        result.terminated = outcome.terminated[0]
        result.truncated = outcome.truncated[0]
        info: Any = outcome.infos.get(0)
        if info:
            text = info_text(info) if self._info_json else None
            if text is not None:
                result.info_json = text
            else:
                struct_info(info, result.info)

    def _books(self, errors: dict[int, RowError], result: _Result) -> None:
        """Raise row 0's error, if it has one, as the request's; else put its books (episode
        id and step count) in ``result``."""
        _raise(errors)
        driver = self._driver
        result.episode_id = driver.episode_ids[0]
        result.step_count = driver.step_counts[0]


#: Each command by its field (``None``: none set); one left out fails the import.
_COMMANDS = command_table(
    pb.SessionRequest,
    {
        "step": _Command(SessionView._step, Outcome.STEPPED),
        "reset": _Command(SessionView._reset),
        "state": _Command(SessionView._state),
        "snapshot": _Command(SessionView._snapshot),
        "restore": _Command(SessionView._restore),
        "render": _Command(SessionView._render),
        "close": _Command(SessionView._close, Outcome.CLOSED, ends=True),
    },
    empty=_Command(SessionView._empty),
)


def _raise(errors: dict[int, RowError]) -> None:
    """Raise row 0's error, if it has one, as the request's."""
    if errors:
        error = errors[0]
        raise RequestError(error.code, error.message, error.exception_type)


def _decode(payload: Any, message_class: type[Message], what: str) -> Message:
    # ``unpack``, not ``payloads.decode_payload``: one call less per step, the same message.
    try:
        return unpack(payload, message_class, what)
    except PayloadError as exc:
        raise RequestError(_INVALID_ARGUMENT, str(exc)) from None
