"""An env process of ``--isolated`` (the env process pool's worker), and the frames it
exchanges with the front.

An env process hosts envs for the front (``env_process_pool.py``) and answers one frame at
a time, in the order the frames arrive. It talks to the front over one socket pair with
asyncio streams; nothing is pickled after start-up (only the factory reference, once, to
spawn the process).

A frame is a fixed header and a payload of ``length`` bytes::

    length: u32 | env id: u64 | operation (front) or status (worker): u8

The worker answers every frame it reads with exactly one frame, in the order it read
them, so the front matches answers to calls by their order and knows which call a worker
is busy with. The only other frame is READY, sent once when the worker is up.

Every env here is a block of a stream (``CREATE``, then ``REQUEST`` frames): a vector
stream's sub-batch, or a Session's one env (a block of one). The front keeps the stream's
books -- the driver runs there, for both kinds -- and sends each env process the part of a
request that concerns its envs (``frames.py``); the env process runs it on a
:class:`~openenv_grpc.server.local.batch.VectorBatch`, inline, and answers the outcome.
So the env process speaks one protocol, and no client command is decoded twice. A step
frame carries the autoresets the front's driver decided (which envs, their new episode
ids and options): the env process keeps no autoreset state.

A vector stream's query comes as ``QUERY``: the query with its room (``frames.py``).
The env process reads its envs one by one and stops once their answers pass the room,
answering ``TOO_LARGE`` and how many bytes that was, never the answers themselves.

With a per-env memory ceiling (``--max-env-bytes``), each env's construction is measured
here, by this process's resident memory right before and after its factory: an env that
grew it past the ceiling is closed at once, the block's other envs too, and the create is
refused naming the env and the ceiling (INVALID_ARGUMENT for the open: the env cannot be
opened on this server however often it is asked, so no "server full" retry).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import inspect
import logging
import os
import signal
import socket
import struct
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from openenv_grpc.codec import PayloadError, unpack
from openenv_grpc.environment import AutoresetMode, InvalidAction
from openenv_grpc.server.errors import describe, qualname
from openenv_grpc.server.local.batch import Autoresets
from openenv_grpc.server.local.calls import (
    BatchRefused,
    LocalBatchCalls,
    ResetArgs,
    RestoreArgs,
    StepArgs,
    local_calls,
)
from openenv_grpc.server.local.frames import (
    ROOM,
    fill_errors,
    fill_result,
    fill_rows,
    read_restore,
    read_room_frame,
    read_step_frame,
)
from openenv_grpc.server.local.runner import contain_tasks
from openenv_grpc.server.model.commands import command_table, complete_table
from openenv_grpc.server.model.phases import SESSION_WORDS, VECTOR_WORDS
from openenv_grpc.server.model.queries import QUERIES, BatchStates
from openenv_grpc.server.model.spec import EnvSpec, ExecutionMode
from openenv_grpc.v1 import session_pb2 as pb

__all__ = [
    "AUTORESET_MODES",
    "BLOCK_OPEN",
    "HEADER",
    "READ_LIMIT",
    "REFUSAL_FLAGS",
    "SIDE_CLOSE",
    "SIDE_CLOSED",
    "Op",
    "Status",
    "refusal_flags",
    "worker_main",
]

log = logging.getLogger(__name__)

#: Payload length, env id, operation or status.
HEADER = struct.Struct("<IQB")
#: Stream buffer size: large frames are read in big chunks, not 64 KiB ones.
READ_LIMIT = 1 << 20
#: Answers smaller than this are joined to their header and written in one piece.
_JOIN_BELOW = 64 * 1024
#: CREATE's payload: the block's size, its autoreset mode (an index of
#: :data:`AUTORESET_MODES`) and whether it is a Session's one env (:data:`SESSION_BLOCK`).
BLOCK_OPEN = struct.Struct("<IBB")
AUTORESET_MODES = (AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED)
#: BLOCK_OPEN's last field: a Session's env (a plain instance, never the env's native
#: batch; its own env-call timeout here, in the Session's words), or a vector's block.
VECTOR_BLOCK, SESSION_BLOCK = 0, 1
#: CLOSE's payload for a close command: a raising ``close`` is answered FAILED.
STRICT_CLOSE = b"strict"


class Op(enum.IntEnum):
    """Front -> worker operations, about one block (its env id). QUERY is a REQUEST that
    is a query with its room (``frames.room_frame``). Each has one handler in the worker's
    table (``_OPS``)."""

    CREATE = 1
    REQUEST = 2
    CLOSE = 3
    QUERY = 4


class Status:
    """Worker -> front statuses. OK: a block was created (the payload says ``native`` or
    ``loop``) or closed; FAILED: its factory (or its strict close) raised, the payload
    says what; REFUSED: ``make_batch`` refused (InvalidAction), or an env passed the memory
    ceiling; BLOCK_GONE: a REQUEST or QUERY named a block this process no longer holds
    (closed on the side while the frame was queued; the payload says so, in plain text);
    READY: sent once, when the worker is up, env id 0. An answered request is ANSWER (a
    VectorSessionResponse), or ``CALL_REFUSED + flags`` (:func:`refusal_flags`) when the
    whole call failed; a QUERY whose answers passed its room is TOO_LARGE (the bytes read
    then, as ``frames.ROOM``). UNKEPT is the front's own, never sent: an answer the
    server's byte budget could not hold, read and dropped. (Only this front and the
    processes it spawns speak these, from the same code: the numbers are kept nowhere.)"""

    OK, FAILED, BLOCK_GONE, READY, REFUSED, TOO_LARGE, UNKEPT, ANSWER = 0, 1, 2, 3, 4, 5, 6, 7
    #: The first of the ``REFUSAL_FLAGS`` statuses of a refused call.
    CALL_REFUSED = 8


#: ``CALL_REFUSED + flags`` for flags below this (:func:`refusal_flags`' four bits).
REFUSAL_FLAGS = 16


def refusal_flags(refused: BatchRefused) -> int:
    """The flags of a refused block call, added to ``Status.CALL_REFUSED``."""
    return refused.broken | refused.replaced << 1 | refused.saturated << 2 | refused.ends << 3


#: A side close (front -> worker): the env id. The answer adds a status byte.
SIDE_CLOSE = struct.Struct("<Q")
SIDE_CLOSED = struct.Struct("<QB")


def worker_main(
    sock: socket.socket,
    factory: Callable[[], Any],
    call_timeout: float | None,
    side: socket.socket | None = None,
    max_env_bytes: int = 0,
) -> None:
    """Entry point of a worker process: serve frames until the front goes away. (No
    snapshot keys come here: the front seals and opens every snapshot.) ``max_env_bytes``:
    the per-env memory ceiling (0: none)."""
    # Ctrl-C reaches the whole process group: the front drains and then ends its workers,
    # so a worker must not die first and take its envs with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    asyncio.run(_serve(sock, factory, call_timeout, side, max_env_bytes))


async def _serve(
    sock: socket.socket,
    factory: Callable[[], Any],
    call_timeout: float | None,
    side: socket.socket | None = None,
    max_env_bytes: int = 0,
) -> None:
    contain_tasks(asyncio.get_running_loop())  # env code's own tasks cannot stop it
    spec = EnvSpec.from_factory(factory)
    if max_env_bytes:
        spec = dataclasses.replace(spec, factory=_Measured(spec, max_env_bytes))
    # Pooled envs are thread-safe across instances (in-process, their calls run on a
    # pool): those may be closed on the side while another instance's call runs.
    threaded = spec.mode in (ExecutionMode.POOL, ExecutionMode.MEASURED)
    if threaded:
        # The worker is the env's own process: blocking calls run inline, one at a time.
        spec = dataclasses.replace(spec, mode=ExecutionMode.INLINE)
    reader, writer = await asyncio.open_unix_connection(sock=sock, limit=READ_LIMIT)
    worker = _Worker(spec, call_timeout, max_env_bytes)
    blocks = worker.blocks
    if side is not None:
        threading.Thread(
            target=_serve_side, args=(side, blocks, threaded),
            name="openenv-side-closes", daemon=True,
        ).start()  # fmt: skip

    async def answer(env_id: int, status: int, payload: bytes = b"") -> None:
        header = HEADER.pack(len(payload), env_id, status)
        if len(payload) < _JOIN_BELOW:
            writer.write(header + payload)
        else:  # never copied into one buffer; what the socket does not take is queued
            writer.write(header)
            writer.write(payload)
        del payload  # the transport holds what it has not sent: not held twice meanwhile
        await writer.drain()

    ops = _OPS
    try:
        await answer(0, Status.READY)
        while True:
            length, env_id, op = HEADER.unpack(await reader.readexactly(HEADER.size))
            payload = await reader.readexactly(length) if length else b""
            run = ops.get(op)
            if run is not None:  # a frame of no known op is read and left unanswered
                await answer(env_id, *await run(worker, env_id, payload))
    except (asyncio.IncompleteReadError, ConnectionError):
        pass  # the front is gone (or ended this worker): close what is left
    finally:
        # popitem, not a loop over values(): the side thread may pop meanwhile.
        while blocks:
            await blocks.popitem()[1].close()


class _Worker:
    """One env process's blocks, and the handler of each frame the front sends (``_OPS``:
    each takes the frame's env id and payload, and returns the status and payload of its
    one answer)."""

    __slots__ = ("blocks", "call_timeout", "max_env_bytes", "spec")

    def __init__(self, spec: EnvSpec, call_timeout: float | None, max_env_bytes: int) -> None:
        self.spec = spec
        self.call_timeout = call_timeout
        self.max_env_bytes = max_env_bytes
        #: The blocks by env id (the side thread may pop a thread-safe env's).
        self.blocks: dict[int, LocalBatchCalls] = {}

    async def create(self, env_id: int, payload: bytes) -> tuple[int, bytes]:
        size, mode, kind = BLOCK_OPEN.unpack(payload)
        status, text = await _create(
            self.spec, size, AUTORESET_MODES[mode], kind, self.call_timeout, self.max_env_bytes
        )
        if isinstance(text, LocalBatchCalls):
            self.blocks[env_id] = text
            text = b"native" if text.native else b"loop"
        return status, text

    async def request(self, env_id: int, payload: bytes) -> tuple[int, bytes]:
        block = self.blocks.get(env_id)
        if block is None:  # closed on the side while this frame was queued
            return _BLOCK_GONE
        return await _block_answer(block, self.spec, payload)

    async def query(self, env_id: int, payload: bytes) -> tuple[int, bytes]:
        block = self.blocks.get(env_id)
        if block is None:  # closed on the side while this frame was queued
            return _BLOCK_GONE
        return await _query_answer(block, payload)

    async def close(self, env_id: int, payload: bytes) -> tuple[int, bytes]:
        return await _close(self.blocks.pop(env_id, None), payload)


_BLOCK_GONE = (Status.BLOCK_GONE, b"the environment was closed")

#: The handler of each operation (a method of :class:`_Worker`); an ``Op`` added without
#: one fails this module's import.
_OPS: dict[int, Callable[[_Worker, int, bytes], Awaitable[tuple[int, bytes]]]] = complete_table(
    "the env process's frame table",
    Op,
    {
        Op.CREATE: _Worker.create,
        Op.REQUEST: _Worker.request,
        Op.CLOSE: _Worker.close,
        Op.QUERY: _Worker.query,
    },
)


async def _close(block: LocalBatchCalls | None, payload: bytes) -> tuple[int, bytes]:
    """Close a block; a strict close answers what its ``close`` raised: FAILED, with
    the description and the exception's type on two lines."""
    if block is None:
        return Status.OK, b""
    if payload != STRICT_CLOSE:
        await block.close()
        return Status.OK, b""
    try:
        await block.close_strictly()
    except Exception as exc:
        log.exception("environment close() raised")
        return Status.FAILED, f"{describe(exc)}\n{qualname(exc)}".encode()
    return Status.OK, b""


def _serve_side(side: socket.socket, blocks: dict[int, LocalBatchCalls], threaded: bool) -> None:
    """Close envs the front names on the side socket, on this thread, while the main one
    may be stuck in another env's call (the front sends only envs with no call in
    flight). Answers 1 when closed, 0 when not done here (unknown env, or an env that is
    not thread-safe): the front then sends the usual CLOSE frame."""
    with contextlib.suppress(OSError):
        while True:
            data = _read_exactly(side, SIDE_CLOSE.size)
            if data is None:
                return  # the front is gone
            (env_id,) = SIDE_CLOSE.unpack(data)
            closing: LocalBatchCalls | None = None
            if threaded:  # dict.pop is atomic: the main thread never sees it again
                closing = blocks.pop(env_id, None)
            if closing is not None:
                asyncio.run(closing.close())  # an inline env's close, on this thread
            side.sendall(SIDE_CLOSED.pack(env_id, closing is not None))


def _read_exactly(sock: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


async def _create(
    spec: EnvSpec,
    size: int,
    autoreset: AutoresetMode,
    kind: int,
    call_timeout: float | None,
    max_env_bytes: int = 0,
) -> tuple[int, LocalBatchCalls | bytes]:
    """Build a block of ``size`` envs; returns the status to answer and the block (or the
    failure's text). Each env instance is measured as it is made (:class:`_Measured`); a
    native batch, made in one piece, is measured as a whole, per env."""
    session = kind == SESSION_BLOCK
    before = _resident_bytes()
    try:
        # A vector block's inline envs get no step timeout here: the front's watchdog
        # stops this process. A Session's async env is cancelled here, past its timeout.
        block = await local_calls(
            spec, size, autoreset, _NO_POOL, native=not session,
            words=SESSION_WORDS if session else VECTOR_WORDS,
            call_timeout=call_timeout if session else None,
        )  # fmt: skip
    except InvalidAction as exc:
        return Status.REFUSED, str(exc).encode()
    except Exception as exc:
        log.exception("environment factory raised")
        return Status.FAILED, describe(exc).encode()
    if max_env_bytes and block.native:
        grew = (_resident_bytes() - before) // size
        if grew > max_env_bytes:
            await block.close()
            return Status.REFUSED, _over_ceiling(spec.name, grew, max_env_bytes, size).encode()
    return Status.OK, block


#: Bytes per page of resident memory (``/proc/self/statm`` counts pages).
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _resident_bytes() -> int:
    """This process's resident memory (0 where ``/proc`` has none: nothing is measured)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _over_ceiling(name: str, grew: int, ceiling: int, batch: int = 0) -> str:
    made = f"a native batch of {batch} grew" if batch else "grew"
    each = " per env" if batch else ""
    return (
        f"environment {name!r}: building one env {made} its env process by {grew} bytes"
        f"{each}, over the per-env memory ceiling of {ceiling} bytes (--max-env-bytes); it "
        "was closed and nothing was opened"
    )


class _Measured:
    """The env's factory, measured: an instance whose construction grew this process's
    resident memory past ``ceiling`` bytes is closed and refused (InvalidAction), so a
    block's loop stops there and closes the envs it made before."""

    def __init__(self, spec: EnvSpec, ceiling: int) -> None:
        self._factory = spec.factory
        self._name = spec.name
        self._ceiling = ceiling

    def __call__(self) -> Any:
        before = _resident_bytes()
        env = self._factory()
        grew = _resident_bytes() - before
        if grew > self._ceiling:
            _close_now(env)
            raise InvalidAction(_over_ceiling(self._name, grew, self._ceiling))
        return env


#: Closes of async envs refused at creation, kept until they finish.
_CLOSING: set[asyncio.Future[Any]] = set()


def _close_now(env: Any) -> None:
    """Close an env that is not kept (an async env's close runs as a task of its own)."""
    try:
        closing = env.close()
        if inspect.isawaitable(closing):
            task = asyncio.ensure_future(closing)
            _CLOSING.add(task)
            task.add_done_callback(_CLOSING.discard)
    except Exception:
        log.exception("environment close() raised")


async def _block_answer(calls: LocalBatchCalls, spec: EnvSpec, payload: bytes) -> tuple[int, bytes]:
    """Run one block's frame (checked by the front already); returns the status and the
    answer (a VectorSessionResponse)."""
    request, autoresets = read_step_frame(payload)
    response = pb.VectorSessionResponse(request_id=request.request_id)
    command = request.WhichOneof("command")
    run = _BLOCK_COMMANDS[command]
    try:
        await run(calls, spec, str(command), request, response, autoresets)
    except PayloadError as exc:  # the front checked the payloads: not expected
        response.ClearField("outcome")
        response.error.code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
        response.error.message = str(exc)
        return Status.CALL_REFUSED, response.SerializeToString()
    except BatchRefused as refused:
        return _refused(response, refused)
    return Status.ANSWER, response.SerializeToString()


async def _block_step(
    calls: LocalBatchCalls,
    spec: EnvSpec,
    command: str,
    request: pb.VectorSessionRequest,
    response: pb.VectorSessionResponse,
    autoresets: pb.VectorReset | None,
) -> None:
    step = request.step
    types = spec.types
    indices = list(step.indices)
    if step.HasField("batch_action"):
        action = unpack(step.batch_action, types.action, "batch action")
        args = StepArgs(indices, action, step.batch_action, True)
    else:
        actions = [unpack(a, types.action, "action") for a in step.actions]
        args = StepArgs(indices, actions, step.actions, False)
    if autoresets is not None and autoresets.indices:
        # The autoresets the front's driver decided: ids and options as it sent them.
        commands = autoresets.envs
        args.autoresets = Autoresets(
            {i: c.episode_id for i, c in zip(autoresets.indices, commands, strict=True)},
            {
                i: unpack(c.options, types.reset_options, "reset options")
                for i, c in zip(autoresets.indices, commands, strict=True)
                if c.HasField("options")
            },
        )
    outcome = await calls.step(args)
    # Only the ids of episodes autoreset here: the front keeps the other books.
    new_ids = outcome.new_episode_ids
    autoreset = outcome.autoreset is not None
    ids = [new_ids.get(index, "") for index in outcome.rows] if autoreset else []
    # Infos as JSON text (types kept); the front answers each client's form.
    fill_result(response.result, outcome, spec.observation_url, ids, (), info_json=True)


async def _block_reset(
    calls: LocalBatchCalls,
    spec: EnvSpec,
    command: str,
    request: pb.VectorSessionRequest,
    response: pb.VectorSessionResponse,
    autoresets: pb.VectorReset | None,
) -> None:
    reset = request.reset
    commands = reset.envs
    options = [
        unpack(c.options, spec.types.reset_options, "reset options")
        if c.HasField("options")
        else None
        for c in commands
    ]
    args = ResetArgs(
        list(reset.indices),
        [c.seed if c.HasField("seed") else None for c in commands],
        [c.episode_id for c in commands],
        options,
        [c.options if c.HasField("options") else None for c in commands],
        reset.batch_observation,
    )
    outcome = await calls.reset(args)
    fill_result(response.result, outcome, spec.observation_url, (), (), info_json=True)


async def _block_restore(
    calls: LocalBatchCalls,
    spec: EnvSpec,
    command: str,
    request: pb.VectorSessionRequest,
    response: pb.VectorSessionResponse,
    autoresets: pb.VectorReset | None,
) -> None:
    """Restore the block's envs (the snapshots were authenticated by the front)."""
    indices, captured = read_restore(request.restore)
    failed = await calls.restore(RestoreArgs(indices, captured))
    response.restored.SetInParent()
    fill_errors(response.restored.errors, failed)


async def _block_query(
    calls: LocalBatchCalls,
    spec: EnvSpec,
    command: str,
    request: pb.VectorSessionRequest,
    response: pb.VectorSessionResponse,
    autoresets: pb.VectorReset | None,
) -> None:
    """Any query (``queries.py``), by its name; a snapshot's bytes are sealed by the
    front."""
    rows = await calls.query(command, list(getattr(request, command).indices))
    fill_rows(response.snapshots, rows)


#: The handler of each command a block's REQUEST frame carries: every query of
#: ``queries.py`` is one handler. A close is a frame of its own (``Op.CLOSE``), never a
#: request. A command added to the proto without an entry here fails this module's import.
_BLOCK_COMMANDS = command_table(
    pb.VectorSessionRequest,
    {
        "step": _block_step,
        "reset": _block_reset,
        "restore": _block_restore,
        **dict.fromkeys(QUERIES, _block_query),
    },
    elsewhere=("close",),
)


async def _query_answer(calls: LocalBatchCalls, payload: bytes) -> tuple[int, bytes]:
    """Run a query with its room (``Op.QUERY``), env by env; returns the status and the
    answer: ANSWER with every env's bytes, or TOO_LARGE once they passed the room (the
    bytes read then; every answer is dropped, and the envs after that one are not read)."""
    room, request = read_room_frame(payload)
    name = str(request.WhichOneof("command"))
    response = pb.VectorSessionResponse(request_id=request.request_id)
    rows, size = BatchStates(), 0
    try:
        for index in getattr(request, name).indices:
            got = await calls.query(name, (index,))
            rows.rows += got.rows
            rows.states += got.states
            rows.errors.update(got.errors)
            size += sum(map(len, got.states))
            if size > room:
                return Status.TOO_LARGE, ROOM.pack(size)
    except BatchRefused as refused:
        return _refused(response, refused)
    fill_rows(response.snapshots, rows)
    rows.states.clear()  # copied into the answer: not held twice while it is serialized
    return Status.ANSWER, response.SerializeToString()


def _refused(response: pb.VectorSessionResponse, refused: BatchRefused) -> tuple[int, bytes]:
    """The answer of a block call that failed as a whole."""
    response.ClearField("outcome")
    response.error.code = refused.code
    response.error.message = refused.message
    response.error.exception_type = refused.exception_type
    return Status.CALL_REFUSED + refusal_flags(refused), response.SerializeToString()


class _NoPool:
    """Inline and async envs never use the pool; the worker has none."""

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("isolated workers run env calls inline")


_NO_POOL: Any = _NoPool()
