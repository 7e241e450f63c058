"""Answers the requests of one session: reset, step, state, snapshot, restore, close.

This is the per-request half of a session (the stream's lifecycle is in ``session.py``).
It owns the episode bookkeeping the environment should not have to: the episode id, the
step count, and whether a step is allowed now. Every failure here becomes an in-band
``Error`` response; the stream and the neighbouring sessions are untouched.

Sizes a client chooses and the server would store or echo are capped here (the limits
below); the rest of a request is bounded by ``--max-message-bytes`` alone.

Snapshots carry this bookkeeping along with the env's own bytes, sealed and checked by
``snapshots.py``: a restored session is exactly where the captured one was, and no byte
of a refused snapshot ever reaches the env.
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from openenv_grpc.codec import MAX_TYPE_URL_BYTES, PayloadError, info_to_struct, unpack
from openenv_grpc.environment import InvalidAction, Transition
from openenv_grpc.server.backend import Answer, Outcome, UndecodableRequest
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
from openenv_grpc.v1 import session_pb2 as pb

__all__ = [
    "MAX_EPISODE_ID_BYTES",
    "MAX_RESET_OPTIONS_BYTES",
    "MAX_TYPE_URL_BYTES",
    "EpisodeDriver",
    "PayloadRefused",
    "decode_payload",
]

log = logging.getLogger(__name__)

_INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
_FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
_INTERNAL = grpc.StatusCode.INTERNAL.value[0]
_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
_UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED.value[0]

#: A client-chosen episode id is echoed in every result of its episode: at most this many
#: UTF-8 bytes (a UUID is 36; 8 MB ids once cost 8 MB per step and per session).
MAX_EPISODE_ID_BYTES = 256
#: Reset options are handed to the env, which may keep them for the whole episode; env
#: configs are small, so this bounds what a session can make an env store per reset.
MAX_RESET_OPTIONS_BYTES = 64 * 1024


class _Phase(enum.Enum):
    NO_EPISODE = "no episode yet"
    RUNNING = "running"
    TERMINATED = "terminated"
    TRUNCATED = "truncated"
    BROKEN = "broken"  # the env raised mid-episode; only a reset may follow


_NEEDS_RESET = {
    _Phase.NO_EPISODE: "step before reset: call reset first",
    _Phase.TERMINATED: "the episode has terminated: call reset to start a new one",
    _Phase.TRUNCATED: "the episode was truncated: call reset to start a new one",
    _Phase.BROKEN: "the environment failed during this episode: call reset",
}

_CAPTURED_PHASE, _RESTORED_PHASE = phase_codes(_Phase)
_NOTHING_TO_CAPTURE = {
    _Phase.NO_EPISODE: "snapshot before reset: there is no episode to capture; call reset",
    _Phase.BROKEN: "the environment failed during this episode: there is nothing "
    "consistent to capture; call reset",
}


class _RequestError(Exception):
    """A request failed; carried to the single place that turns it into a response."""

    def __init__(
        self, code: int, message: str, exception_type: str = "", *, saturated: bool = False
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.exception_type = exception_type
        #: The env call never ran: every env thread was busy (its own metric).
        self.saturated = saturated


_REQUEST_NAME = pb.SessionRequest.DESCRIPTOR.full_name
_OUTCOMES = {
    "reset": Outcome.RESET,
    "step": Outcome.STEPPED,
    "state": Outcome.STATE,
    "snapshot": Outcome.SNAPSHOT,
    "restore": Outcome.RESTORED,
}


class EpisodeDriver:
    """The request handler of one session, bound to one environment instance at a time:
    the in-process backend (``backend.SessionBackend``), also run inside env processes.

    It answers serialized requests with serialized responses and says what it answered
    (an :class:`~openenv_grpc.server.backend.Answer`); metrics are the caller's to record.

    An env call that exceeds ``call_timeout`` is answered with DEADLINE_EXCEEDED; the
    env is then abandoned (closed once its hung call returns) and replaced with a fresh
    instance, so the session lives on and the client must reset. A pooled call still
    waiting for a free thread when ``call_timeout`` passes never runs: RESOURCE_EXHAUSTED,
    and the env and the episode are unchanged.

    ``snapshots`` seals and opens this env's snapshots (the server's key ring and size
    limit); without it, this process's random key and the default limit.
    """

    __slots__ = (
        "_ends", "_make_runner", "_phase", "_seal", "_spec", "_timeout", "episode_id",
        "runner", "step_count",
    )  # fmt: skip

    def __init__(
        self,
        spec: EnvSpec,
        runner: EnvRunner,
        make_runner: Callable[[], Awaitable[EnvRunner]],
        call_timeout: float | None,
        snapshots: SnapshotSeal | None = None,
    ) -> None:
        self._spec = spec
        self._seal = snapshots if snapshots is not None else default_seal(spec.name, spec.version)
        #: The env instance in use now; the session closes this one when it ends.
        self.runner = runner
        self._make_runner = make_runner
        self._timeout = call_timeout
        self._phase = _Phase.NO_EPISODE
        self.episode_id = ""
        self.step_count = 0
        #: Set when nothing is left to serve (closed, or not replaceable): the stream ends.
        self._ends = False

    async def handle(self, raw: bytes) -> Answer:
        """Answer one serialized request. Never raises for anything the env did.

        Raises:
            UndecodableRequest: ``raw`` is not a SessionRequest (no id to answer to).
        """
        try:
            request = pb.SessionRequest.FromString(raw)
        except DecodeError as exc:
            raise UndecodableRequest(f"request is not a valid {_REQUEST_NAME}: {exc}") from None
        response = pb.SessionResponse(request_id=request.request_id)
        command = request.WhichOneof("command")
        seconds = 0.0
        try:
            if command == "step":
                seconds = await self._step(request.step, response.result)
            elif command == "reset":
                await self._reset(request.reset, response.result)
            elif command == "state":
                await self._state(response.state)
            elif command == "snapshot":
                await self._snapshot(response.snapshot)
            elif command == "restore":
                await self._restore(request.restore, response.restored)
            elif command == "close":
                await self._close()
                response.closed.SetInParent()
                return Answer(response.SerializeToString(), Outcome.CLOSED, ends=True)
            else:
                raise _RequestError(
                    _INVALID_ARGUMENT,
                    "empty request: set one of reset, step, state, snapshot, restore, close",
                )
        except _RequestError as err:
            response.ClearField("outcome")
            error = response.error
            error.code = err.code
            error.message = err.message
            error.exception_type = err.exception_type
            outcome = Outcome.SATURATED if err.saturated else Outcome.FAILED
            name = _CODE_NAMES.get(err.code, str(err.code))
            return Answer(response.SerializeToString(), outcome, 0.0, name, self._ends)
        return Answer(response.SerializeToString(), _OUTCOMES[command], seconds)

    async def close(self) -> None:
        """Close the env in use, once (``backend.SessionBackend``)."""
        await self.runner.close_quietly()

    async def _step(self, command: pb.StepCommand, result: pb.StepResult) -> float:
        """Take one step into ``result``; returns the seconds the env call took."""
        if self._phase is not _Phase.RUNNING:
            raise _RequestError(_FAILED_PRECONDITION, _NEEDS_RESET[self._phase])
        spec = self._spec
        action = _decode(command.action, spec.types.action, "action")
        started = time.perf_counter()
        transition = await self._call_env("step", self.runner.env.step, action)
        seconds = time.perf_counter() - started
        self.step_count += 1
        self._record(transition, result)
        return seconds

    async def _reset(self, command: pb.ResetCommand, result: pb.StepResult) -> None:
        spec = self._spec
        if command.HasField("episode_id"):
            size = len(command.episode_id.encode())
            if size > MAX_EPISODE_ID_BYTES:
                raise _RequestError(
                    _INVALID_ARGUMENT,
                    f"episode_id is {size} bytes; at most {MAX_EPISODE_ID_BYTES} are allowed "
                    "(the episode is unchanged)",
                )
        options: Message | None = None
        if command.HasField("options"):
            size = len(command.options.value)
            if size > MAX_RESET_OPTIONS_BYTES:
                raise _RequestError(
                    _INVALID_ARGUMENT,
                    f"reset options are {size} bytes; at most {MAX_RESET_OPTIONS_BYTES} are "
                    "allowed (the episode is unchanged)",
                )
            options = _decode(command.options, spec.types.reset_options, "reset options")
        episode_id = command.episode_id if command.HasField("episode_id") else uuid.uuid4().hex
        seed = command.seed if command.HasField("seed") else None
        transition = await self._call_env(
            "reset", self.runner.env.reset, seed=seed, episode_id=episode_id, options=options
        )
        self.episode_id = episode_id
        self.step_count = 0
        self._record(transition, result)

    async def _state(self, result: pb.StateResult) -> None:
        state = await self._call_env("state", self.runner.env.state, keep_phase=True)
        if not isinstance(state, self._spec.types.state):
            raise _RequestError(_INTERNAL, _wrong_type("state", state, self._spec.types.state))
        result.state.type_url = self._spec.state_url
        result.state.value = state.SerializeToString()
        result.episode_id = self.episode_id
        result.step_count = self.step_count

    async def _snapshot(self, result: pb.SnapshotResult) -> None:
        """Capture the episode into ``result``; the episode is never changed."""
        self._require_snapshots()
        phase = _CAPTURED_PHASE.get(self._phase)
        if phase is None:
            raise _RequestError(_FAILED_PRECONDITION, _NOTHING_TO_CAPTURE[self._phase])
        state = await self._call_env("snapshot", self.runner.env.snapshot, keep_phase=True)
        if not isinstance(state, bytes | bytearray):
            raise _RequestError(
                _INTERNAL,
                f"environment returned a {type(state).__qualname__} from snapshot(), not "
                "bytes; the episode goes on",
            )
        captured = Captured(self.episode_id, self.step_count, phase, bytes(state))
        result.snapshot = await self._sealed(self._seal.seal, captured, len(state))
        result.episode_id = self.episode_id
        result.step_count = self.step_count

    async def _restore(self, command: pb.RestoreCommand, result: pb.RestoreResult) -> None:
        """Check the snapshot completely, then hand the env its bytes and take over the
        captured bookkeeping. A refused snapshot leaves the episode as it was."""
        self._require_snapshots()
        data = command.snapshot
        captured: Captured = await self._sealed(self._seal.open, data, len(data))
        await self._call_env("restore", self.runner.env.restore, captured.env_state)
        self.episode_id = captured.episode_id
        self.step_count = captured.step_count
        self._phase = _RESTORED_PHASE[captured.phase]
        result.episode_id = self.episode_id
        result.step_count = self.step_count
        result.terminated = self._phase is _Phase.TERMINATED
        result.truncated = self._phase is _Phase.TRUNCATED

    def _require_snapshots(self) -> None:
        if not self._spec.snapshots:
            raise _RequestError(
                _UNIMPLEMENTED,
                f"environment {self._spec.name!r} does not support snapshots (it does not "
                "implement snapshot() and restore()); the session goes on",
            )

    @staticmethod
    async def _sealed(work: Callable[[Any], Any], argument: Any, size: int) -> Any:
        """``work(argument)``: a seal or an open, on a thread when it hashes megabytes.

        Raises:
            _RequestError: the snapshot was refused (its code and message).
        """
        try:
            return await sealing(lambda: work(argument), size)
        except SnapshotRefused as refused:
            raise _RequestError(refused.code, refused.message) from None

    async def _close(self) -> None:
        self._ends = True
        try:
            await self.runner.close()
        except Exception as exc:
            log.exception("environment close() raised")
            raise _RequestError(
                _INTERNAL, f"close failed: {_describe(exc)}", _qualname(exc)
            ) from None

    async def _call_env(
        self, what: str, method: Any, *args: Any, keep_phase: bool = False, **kwargs: Any
    ) -> Any:
        """Call into the env, mapping its exceptions to in-band errors."""
        try:
            return await self.runner.call_within(self._timeout, method, *args, **kwargs)
        except TimeoutError:
            await self._replace_env(what)
            raise _RequestError(
                _DEADLINE_EXCEEDED,
                f"{what} did not finish within {self._timeout:g}s; the environment was "
                "replaced with a fresh one: call reset",
            ) from None
        except PoolSaturated as exc:
            # Never ran: the env and the episode are as they were; nothing to replace.
            raise _RequestError(_RESOURCE_EXHAUSTED, str(exc), saturated=True) from None
        except InvalidAction as exc:
            raise _RequestError(_INVALID_ARGUMENT, str(exc), _qualname(exc)) from None
        except NotImplementedError as exc:
            if what in ("snapshot", "restore"):
                # An env that snapshots some configurations only says which it cannot do.
                why = str(exc) or "this environment cannot do it now"
                raise _RequestError(
                    _UNIMPLEMENTED, f"{what} is not supported: {why}; the episode goes on"
                ) from None
            raise self._failed(what, exc, keep_phase) from None
        except Exception as exc:
            raise self._failed(what, exc, keep_phase) from None

    def _failed(self, what: str, exc: Exception, keep_phase: bool) -> _RequestError:
        """The INTERNAL error for an exception the env raised (logged); unless
        ``keep_phase``, the episode is broken (only a reset may follow)."""
        log.exception("environment %s() raised", what, exc_info=exc)
        keep_phase |= what == "step" and not getattr(
            self._spec.env_class, "step_errors_end_episode", True
        )
        if not keep_phase:
            self._phase = _Phase.BROKEN
        return _RequestError(_INTERNAL, f"{what} failed: {_describe(exc)}", _qualname(exc))

    async def _replace_env(self, what: str) -> None:
        self.runner.abandon()
        self._phase = _Phase.NO_EPISODE
        self.episode_id = ""
        self.step_count = 0
        try:
            self.runner = await self._make_runner()
        except NoSlot as exc:
            # The hung instance keeps its slot until its call returns: the cap is on envs.
            self._ends = True
            raise _RequestError(
                _RESOURCE_EXHAUSTED,
                f"{what} did not finish within {self._timeout:g}s and no fresh environment "
                f"can be made: {exc}; the session ends",
            ) from None
        except Exception as exc:
            log.exception("environment factory raised while replacing a hung environment")
            self._ends = True  # nothing left to serve: the stream ends after this answer
            raise _RequestError(
                _INTERNAL,
                f"the environment hung and a new one could not be created: {_describe(exc)}",
                _qualname(exc),
            ) from None

    def _record(self, transition: Transition[Any], result: pb.StepResult) -> None:
        """Copy an env transition into ``result`` and advance the episode phase."""
        spec = self._spec
        if not isinstance(transition, Transition):
            self._phase = _Phase.BROKEN
            raise _RequestError(
                _INTERNAL,
                f"environment returned a {type(transition).__qualname__}, not a Transition",
            )
        observation = transition.observation
        if not isinstance(observation, spec.types.observation):
            self._phase = _Phase.BROKEN
            raise _RequestError(
                _INTERNAL, _wrong_type("observation", observation, spec.types.observation)
            )
        result.observation.type_url = spec.observation_url
        result.observation.value = observation.SerializeToString()
        result.reward = transition.reward
        result.terminated = transition.terminated
        result.truncated = transition.truncated
        result.episode_id = self.episode_id
        result.step_count = self.step_count
        if transition.info:
            info_to_struct(transition.info, result.info)
        if transition.terminated:
            self._phase = _Phase.TERMINATED
        elif transition.truncated:
            self._phase = _Phase.TRUNCATED
        else:
            self._phase = _Phase.RUNNING


class PayloadRefused(ValueError):
    """A payload is not of its declared type, does not parse, or has a type url over
    :data:`MAX_TYPE_URL_BYTES` (the message says which; the request is INVALID_ARGUMENT)."""


def decode_payload(payload: Any, message_class: type[Message], what: str) -> Message:
    """Decode a request's ``payload`` (``what``: "action", ...) as ``message_class``.

    Raises:
        PayloadRefused: it cannot be.
    """
    try:
        return unpack(payload, message_class, what)
    except PayloadError as exc:
        # Checked only here, off the hot path: a wrong type url is echoed in the error.
        size = len(payload.type_url.encode())
        if size > MAX_TYPE_URL_BYTES:
            raise PayloadRefused(
                f"{what} type_url is {size} bytes; at most {MAX_TYPE_URL_BYTES} are allowed"
            ) from None
        raise PayloadRefused(str(exc)) from None


def _decode(payload: Any, message_class: type[Message], what: str) -> Message:
    try:
        return decode_payload(payload, message_class, what)
    except PayloadRefused as exc:
        raise _RequestError(_INVALID_ARGUMENT, str(exc)) from None


def _wrong_type(what: str, value: object, expected: type[Message]) -> str:
    return (
        f"environment returned a {type(value).__qualname__} {what}, "
        f"declared {expected.DESCRIPTOR.full_name}"
    )


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _qualname(exc: BaseException) -> str:
    kind = type(exc)
    return f"{kind.__module__}.{kind.__qualname__}"
