"""The EnvService: its three RPCs, and what backs each kind of stream's envs.

A ``VectorSession`` reads N and the autoreset mode from its metadata first, so a bad value
is refused (INVALID_ARGUMENT) before any slot is taken. Either kind of stream is then run
by the session manager; its envs are a batch in this process, or, with ``--isolated``,
blocks in the env processes.
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from openenv_grpc._version import __version__
from openenv_grpc.environment import AutoresetMode
from openenv_grpc.metadata import (
    AUTORESET_KEY,
    AUTORESET_VALUES,
    BATCH_KEY,
    INFO_JSON,
    INFO_KEY,
    NUM_ENVS_KEY,
    PROTOCOL,
    SERVICE_NAME,
)
from openenv_grpc.server.isolated.env_process import SESSION_BLOCK
from openenv_grpc.server.isolated.env_process_pool import EnvProcessPool
from openenv_grpc.server.isolated.spread import BlockPolicy, SpreadBatchCalls
from openenv_grpc.server.local.batch import natively_batched
from openenv_grpc.server.local.calls import BatchCalls
from openenv_grpc.server.model.phases import SESSION_WORDS, VECTOR_WORDS
from openenv_grpc.server.model.placement import CallPlacement, batch_threshold
from openenv_grpc.server.stream.backend import SessionBackend, exhausted, parse_request
from openenv_grpc.server.stream.driver import Driver
from openenv_grpc.server.stream.session import Held, SessionManager, StreamOpening
from openenv_grpc.server.stream.session_view import SessionView
from openenv_grpc.server.stream.vector_view import VectorView
from openenv_grpc.server.stream.wire import Wire
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc

__all__ = ["PROTOCOL", "SERVICE_NAME", "EnvServicer", "add_env_service", "read_open"]

_Context = grpc.aio.ServicerContext[bytes, bytes]

#: A Session's env with ``--isolated``. Its stream cannot be replayed (the client cannot
#: tell which request took effect), so a loss it did not cause ends it.
_SESSION_BLOCK = BlockPolicy(
    SESSION_BLOCK, prefer_ready=False, refuse_timed_out_call=True, lost_process_ends=True,
    words=SESSION_WORDS,
)  # fmt: skip
#: Vector sizes whose batch calls are measured apart (more go to the pool).
_MAX_PLACEMENTS = 64


class EnvServicer(pb_grpc.EnvServiceServicer):
    """Opens Session and VectorSession streams for the session manager; answers Info."""

    def __init__(self, sessions: SessionManager, processes: EnvProcessPool | None) -> None:
        self._sessions = sessions
        self._processes = processes
        spec = sessions.spec
        config = sessions.config
        self._native = natively_batched(spec.env_class)
        self._max_envs = config.max_vector_envs
        #: A measured env's batch calls, by N, shared by the streams of one size.
        self._placements: dict[int, CallPlacement] = {}
        # One per form of info the client reads: no allocation per open.
        self._one_env = _SessionOpening(self, info_json=False)
        self._one_env_json = _SessionOpening(self, info_json=True)
        # All but the capacity is fixed: built once, copied per call.
        self._info = pb.InfoResponse(
            env_name=spec.name,
            env_version=spec.version,
            env_description=spec.description,
            action_type=spec.types.action.DESCRIPTOR.full_name,
            observation_type=spec.types.observation.DESCRIPTOR.full_name,
            state_type=spec.types.state.DESCRIPTOR.full_name,
            reset_options_type=spec.types.reset_options.DESCRIPTOR.full_name,
            descriptors=spec.descriptors,
            server_version=__version__,
            protocol=PROTOCOL,
            server_pid=os.getpid(),
            vector=pb.VectorSupport(
                supported=True,
                native_batch=self._native,
                max_envs_per_stream=self._max_envs,
                autoreset_modes=AUTORESET_MODES,
                snapshots=True,
            ),
        )
        snapshots = self._info.snapshots
        snapshots.supported = spec.snapshots
        seal = sessions.snapshots
        if seal is not None:
            snapshots.max_bytes = seal.limit
            snapshots.signing_key_id = seal.keys.signing.id
            snapshots.ephemeral_key = seal.keys.ephemeral

    async def Session(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[bytes],
        context: _Context,
    ) -> None:
        json_info = reads_json_info(context.invocation_metadata())
        await self._sessions.run(context, self._one_env_json if json_info else self._one_env)

    def run_stream(self, context: Wire, opening: StreamOpening) -> Awaitable[None]:
        """Run a stream of another wire (the OpenEnv door) to its end, as the RPCs do."""
        return self._sessions.run(context, opening)

    async def open_session_view(self, held: Held, objects: bool = False) -> SessionView:
        """An admitted Session's env and its view, for a wire without envelopes;
        ``objects``: its observations stay the env's objects where the env runs in this
        process (``SessionView.objects`` says whether they do)."""
        return await self._one_env_json.open(held, objects)

    async def VectorSession(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[bytes],
        context: _Context,
    ) -> None:
        try:
            size, autoreset = read_open(context.invocation_metadata(), self._max_envs)
        except ValueError as exc:
            await self._sessions.refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        json_info = reads_json_info(context.invocation_metadata())
        await self._sessions.run(context, _VectorOpening(self, size, autoreset, json_info))

    async def Info(
        self,
        request: pb.InfoRequest,
        context: grpc.aio.ServicerContext[pb.InfoRequest, pb.InfoResponse],
    ) -> pb.InfoResponse:
        response = pb.InfoResponse()
        response.CopyFrom(self._info)
        limiter = self._sessions.limiter
        response.capacity.max_sessions = limiter.capacity
        response.capacity.active_sessions = limiter.active
        response.capacity.draining = limiter.draining
        response.capacity.workers = self._sessions.config.workers
        self._sessions.activity.fill(response.activity, limiter)
        return response

    def _placement(self, size: int) -> CallPlacement | None:
        """Where a measured env's batch calls of ``size`` envs run (None: the pool)."""
        measured = self._sessions.spec.placement
        if measured is None:
            return None
        found = self._placements.get(size)
        if found is None and len(self._placements) < _MAX_PLACEMENTS:
            name = f"{self._sessions.spec.name} (vector of {size})"
            threshold = batch_threshold(measured.threshold, size)
            found = self._placements[size] = CallPlacement(threshold, name)
        return found


class _GrpcOpening:
    """A gRPC stream's words: its requests and answers are its protobuf messages."""

    request_class: type[Message]
    response_class: type[Message]
    notices = True

    def command_of(self, raw: Any, strict: bool = False) -> tuple[int, str]:
        if strict:
            request: Any = parse_request(raw, self.request_class)
        else:
            try:
                request = self.request_class.FromString(raw)
            except DecodeError:  # parsed once already: kept total for safety
                request = self.request_class()
        return request.request_id, request.WhichOneof("command") or "request"

    def exhausted(self, request_id: int, message: str) -> bytes:
        response: Any = self.response_class()
        response.request_id = request_id
        return exhausted(response, message)


class _SessionOpening(_GrpcOpening):
    """A Session stream, for :meth:`SessionManager.run`: one slot, one env (a block of one
    in an env process when isolated, else a loop batch of one plain instance here)."""

    slots = 1
    in_flight = 0
    request_class = pb.SessionRequest
    response_class = pb.SessionResponse

    def __init__(self, service: EnvServicer, info_json: bool) -> None:
        self._service = service
        self._info_json = info_json

    async def open(self, held: Held, objects: bool = False) -> SessionView:
        manager, processes = self._service._sessions, self._service._processes
        if processes is not None:
            spread = await SpreadBatchCalls.open(
                processes, 1, AutoresetMode.DISABLED, False, _SESSION_BLOCK
            )
            return SessionView(
                manager.spec, spread, manager.snapshots, self._info_json, spread.replacing
            )
        # From here the runner frees the slot, once the env is closed or the factory fails.
        held.owns_slot = False
        calls = await manager.local_calls(
            1, AutoresetMode.DISABLED, manager.spec.placement, SESSION_WORDS, native=False,
            objects=objects,
        )  # fmt: skip
        return SessionView(manager.spec, calls, manager.snapshots, self._info_json, objects=objects)

    def headers(self) -> tuple[tuple[str, str], ...]:
        return ()


class _VectorOpening(_GrpcOpening):
    """A VectorSession stream, for :meth:`SessionManager.run`: N slots, N envs (a batch
    built here, or blocks spread over the env processes)."""

    request_class = pb.VectorSessionRequest
    response_class = pb.VectorSessionResponse

    def __init__(
        self, service: EnvServicer, size: int, autoreset: AutoresetMode, info_json: bool
    ) -> None:
        self._service = service
        self._info_json = info_json
        self.slots = size
        self.in_flight = service._sessions.config.max_vector_in_flight
        self._autoreset = autoreset
        self._view: VectorView | None = None

    async def open(self, held: Held) -> SessionBackend:
        service, size, autoreset = self._service, self.slots, self._autoreset
        manager = service._sessions
        calls: BatchCalls
        if service._processes is not None:
            calls = await SpreadBatchCalls.open(
                service._processes, size, autoreset, service._native
            )
        else:
            held.owns_slot = False  # as for a Session
            calls = await manager.local_calls(
                size, autoreset, service._placement(size), VECTOR_WORDS
            )
        driver = Driver(
            manager.spec, size, autoreset, calls, VECTOR_WORDS, manager.snapshots,
            max_response=manager.config.max_message_bytes,
        )  # fmt: skip
        self._view = VectorView(driver, self._info_json)
        return self._view

    def headers(self) -> tuple[tuple[str, str], ...]:
        native = self._view is not None and self._view.native
        return ((BATCH_KEY, "native" if native else "loop"),)


_MODES = {mode.value: mode for mode in AutoresetMode}

#: The modes as Info lists them.
AUTORESET_MODES = (
    pb.AUTORESET_MODE_NEXT_STEP,
    pb.AUTORESET_MODE_SAME_STEP,
    pb.AUTORESET_MODE_DISABLED,
)


def read_open(metadata: Iterable[tuple[str, Any]] | None, most: int) -> tuple[int, AutoresetMode]:
    """N and the autoreset mode of a VectorSession open, from its call metadata; ValueError
    if N is missing, repeated, not ASCII digits or not in 1..``most``, or the mode is bad."""
    raw = _one(metadata, NUM_ENVS_KEY)
    if raw is None:
        raise ValueError(f"a VectorSession needs the number of envs in the {NUM_ENVS_KEY} metadata")
    if not _DIGITS.fullmatch(raw):
        raise ValueError(f"{NUM_ENVS_KEY} must be a whole number of envs, got {raw[:32]!r}")
    size = int(raw) if len(raw) <= _MAX_DIGITS else most + 1
    if size < 1 or size > most:
        shown = str(size) if len(raw) <= _MAX_DIGITS else f"{raw[:_MAX_DIGITS]}..."
        raise ValueError(
            f"{NUM_ENVS_KEY} is {shown}: a vector stream holds 1 to {most} envs on this server "
            "(--max-vector-envs)"
        )
    mode_text = _one(metadata, AUTORESET_KEY)
    if mode_text is None:
        mode_text = "next_step"
    if mode_text.lower() not in _MODES:
        raise ValueError(
            f"{AUTORESET_KEY} must be one of {', '.join(AUTORESET_VALUES)}, got {mode_text[:32]!r}"
        )
    return size, _MODES[mode_text.lower()]


def reads_json_info(metadata: Iterable[tuple[str, Any]] | None) -> bool:
    """Whether the client asked for infos as JSON text (``openenv-info: json``); any other
    value means the Struct (never refused: an old server ignores the key too)."""
    for name, value in metadata or ():
        if name == INFO_KEY:
            text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
            return text.strip().lower() == INFO_JSON
    return False


#: ASCII digits only (str.isdecimal would take other scripts' digits).
_DIGITS = re.compile(r"[0-9]+")
#: Digits beyond this are refused as too many envs before int() sees them.
_MAX_DIGITS = 10


def _one(metadata: Iterable[tuple[str, Any]] | None, key: str) -> str | None:
    """The one value of ``key`` in the call's metadata (None: absent); ValueError if it
    came more than once (which would win is a proxy's choice, so none does)."""
    values = [value for name, value in metadata or () if name == key]
    if len(values) > 1:
        raise ValueError(f"{key} was sent {len(values)} times: send it once")
    if not values:
        return None
    value = values[0]
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def add_env_service(servicer: EnvServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` like the generated ``add_EnvServiceServicer_to_server``, but
    with Session and VectorSession messages as bytes: the backend parses them (a bad
    request ends INVALID_ARGUMENT, not UNKNOWN) and an isolated worker's answer passes
    through unparsed."""
    handlers = {
        "Session": grpc.stream_stream_rpc_method_handler(servicer.Session),
        "VectorSession": grpc.stream_stream_rpc_method_handler(servicer.VectorSession),
        "Info": grpc.unary_unary_rpc_method_handler(
            servicer.Info,
            request_deserializer=pb.InfoRequest.FromString,
            response_serializer=pb.InfoResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
