"""An env process of ``--isolated``: it hosts blocks of streams' envs for the front
(``env_process_pool.py``) and answers one frame at a time, in the order they arrive, over
one socket pair. A frame is a header and a payload of ``length`` bytes::

    length: u32 | env id: u64 | operation (front) or status (worker): u8

Every frame read gets exactly one answer, in order; the only other frame is READY, once.
A block (``CREATE``, then ``REQUEST`` frames) is a vector stream's sub-batch or a
Session's one env; the front keeps the books, and a request is the batch's method by
name on args the front checked (``frames.py``): nothing here names a command. A
``QUERY`` carries its room: the envs are read one by one, and past the room only the
bytes read then are answered (``TOO_LARGE``).

With ``--max-env-bytes``, each env's construction is measured by this process's resident
memory: an env past the ceiling is closed with the block's other envs and the create is
refused (INVALID_ARGUMENT: retrying cannot help).
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

from openenv_grpc.environment import AutoresetMode, InvalidAction
from openenv_grpc.server.errors import describe, qualname
from openenv_grpc.server.local.calls import BatchRefused, LocalBatchCalls, local_calls
from openenv_grpc.server.local.frames import ROOM, fill_answer, know_messages, read_command
from openenv_grpc.server.local.runner import contain_tasks
from openenv_grpc.server.model.commands import complete_table
from openenv_grpc.server.model.phases import SESSION_WORDS, VECTOR_WORDS
from openenv_grpc.server.model.queries import BatchStates
from openenv_grpc.server.model.spec import EnvSpec, ExecutionMode
from openenv_grpc.v1 import session_pb2 as pb

__all__ = [
    "AUTORESET_MODES",
    "BLOCK_OPEN",
    "HEADER",
    "READ_LIMIT",
    "REFUSAL_FLAGS",
    "SIDE_CLOSE",
    "Op",
    "Status",
    "put",
    "worker_main",
]

log = logging.getLogger(__name__)

_INTERNAL = grpc.StatusCode.INTERNAL.value[0]

#: Payload length, env id, operation or status.
HEADER = struct.Struct("<IQB")
#: Stream buffer size: large frames are read in big chunks, not 64 KiB ones.
READ_LIMIT = 1 << 20
#: Frames smaller than this are joined to their header; larger ones are not copied.
_JOIN_BELOW = 64 * 1024
#: CREATE's payload: the block's size, its autoreset mode (an index of
#: :data:`AUTORESET_MODES`) and its kind (:data:`VECTOR_BLOCK` or :data:`SESSION_BLOCK`).
BLOCK_OPEN = struct.Struct("<IBB")
AUTORESET_MODES = (AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED)
#: A Session's env is a plain instance (never the native batch) with its own env-call
#: timeout here, in the Session's words.
VECTOR_BLOCK, SESSION_BLOCK = 0, 1
#: CLOSE's payload for a close command: a raising ``close`` is answered FAILED.
STRICT_CLOSE = b"strict"


class Op(enum.IntEnum):
    """Front -> worker operations about one block; each has a handler in ``_OPS``."""

    CREATE = 1
    REQUEST = 2
    CLOSE = 3
    QUERY = 4


class Status:
    """Worker -> front statuses. OK: a block created (payload ``native`` or ``loop``) or
    closed; FAILED: its factory or strict close raised (payload: what); REFUSED:
    ``make_batch`` refused, or the memory ceiling; BLOCK_GONE: the block was closed on the
    side meanwhile (plain text); READY: once, at start. ANSWER is a
    ``VectorSessionResponse``, or ``CALL_REFUSED + flags`` (:data:`REFUSAL_FLAGS`) when the
    call failed as a whole; TOO_LARGE: a QUERY past its room (``frames.ROOM``). UNKEPT is
    the front's own: an answer its byte budget could not hold, read and dropped."""

    OK, FAILED, BLOCK_GONE, READY, REFUSED, TOO_LARGE, UNKEPT, ANSWER = 0, 1, 2, 3, 4, 5, 6, 7
    CALL_REFUSED = 8


#: ``CALL_REFUSED + flags`` for flags below this: four bits, ``BatchRefused``'s broken,
#: replaced, saturated and ends.
REFUSAL_FLAGS = 16


#: A side close (front -> worker): the env id. The answer is one byte (``_serve_side``).
SIDE_CLOSE = struct.Struct("<Q")


def put(writer: asyncio.StreamWriter, header: bytes, payload: bytes) -> None:
    """Write one frame (what the socket does not take is buffered)."""
    if len(payload) < _JOIN_BELOW:
        writer.write(header + payload)
    else:
        writer.write(header)
        writer.write(payload)


def worker_main(
    sock: socket.socket,
    factory: Callable[[], Any],
    call_timeout: float | None,
    side: socket.socket | None = None,
    max_env_bytes: int = 0,
) -> None:
    """Entry point of a worker process: serve frames until the front goes away."""
    # Ctrl-C reaches the whole process group: the front drains, then ends its workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = EnvSpec.from_factory(factory)
    if max_env_bytes:
        spec = dataclasses.replace(spec, factory=_Measured(spec.factory, spec.name, max_env_bytes))
    # Pooled envs are thread-safe across instances: those may be closed on the side.
    threaded = spec.mode in (ExecutionMode.POOL, ExecutionMode.MEASURED)
    if threaded:  # the worker is the env's own process: calls run inline
        spec = dataclasses.replace(spec, mode=ExecutionMode.INLINE)
    types = spec.types
    know_messages(types.action, types.observation, types.state, types.reset_options)
    asyncio.run(_serve(sock, _Worker(spec, call_timeout, max_env_bytes), side, threaded))


async def _serve(
    sock: socket.socket, worker: _Worker, side: socket.socket | None, threaded: bool
) -> None:
    contain_tasks(asyncio.get_running_loop())  # env code's own tasks cannot stop it
    reader, writer = await asyncio.open_unix_connection(sock=sock, limit=READ_LIMIT)
    blocks = worker.blocks
    if side is not None:
        threading.Thread(
            target=_serve_side, args=(side, blocks, threaded),
            name="openenv-side-closes", daemon=True,
        ).start()  # fmt: skip

    async def answer(env_id: int, status: int, payload: bytes = b"") -> None:
        put(writer, HEADER.pack(len(payload), env_id, status), payload)
        del payload  # the transport holds what it has not sent: not held twice
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
        pass  # the front is gone (or ended this worker)
    finally:
        while blocks:  # popitem: the side thread may pop meanwhile
            await blocks.popitem()[1].close()


@dataclasses.dataclass(slots=True, eq=False)
class _Worker:
    """One env process's blocks, and a handler per op (env id, payload -> status, answer)."""

    spec: EnvSpec
    call_timeout: float | None
    max_env_bytes: int
    #: The blocks by env id (the side thread may pop a thread-safe env's).
    blocks: dict[int, LocalBatchCalls] = dataclasses.field(default_factory=dict)

    async def create(self, env_id: int, payload: bytes) -> tuple[int, bytes]:
        """Build a block; a native batch, made in one piece, is measured as a whole."""
        size, mode, kind = BLOCK_OPEN.unpack(payload)
        session, spec, ceiling = kind == SESSION_BLOCK, self.spec, self.max_env_bytes
        before = _resident_bytes()
        try:
            # A vector block gets no call timeout here: the front's watchdog stops this
            # process. A Session's async env is cancelled here, past its timeout.
            block = await local_calls(
                spec, size, AUTORESET_MODES[mode], _NO_POOL, native=not session,
                words=SESSION_WORDS if session else VECTOR_WORDS,
                call_timeout=self.call_timeout if session else None,
            )  # fmt: skip
        except InvalidAction as exc:
            return Status.REFUSED, str(exc).encode()
        except Exception as exc:
            log.exception("environment factory raised")
            return Status.FAILED, describe(exc).encode()
        if ceiling and block.native and (over := _over_ceiling(spec.name, before, ceiling, size)):
            await block.close()
            return Status.REFUSED, over.encode()
        self.blocks[env_id] = block
        return Status.OK, b"native" if block.native else b"loop"

    async def request(self, env_id: int, payload: bytes) -> tuple[int, bytes]:
        """Any command: the block's batch's method by name (checked by the front)."""
        block = self.blocks.get(env_id)
        if block is None:  # closed on the side while this frame was queued
            return _BLOCK_GONE
        response = pb.VectorSessionResponse(request_id=1)
        try:
            result = await block.call(*read_command(payload))
            fill_answer(response, result, self.spec.observation_url)
        except BatchRefused as refused:
            return _refused(response, refused)
        except Exception as exc:  # a bug (a frame or a result this process cannot take)
            return _unanswerable(exc)
        return Status.ANSWER, response.SerializeToString()

    async def query(self, env_id: int, payload: bytes) -> tuple[int, bytes]:
        """A query within its room, env by env: ANSWER with every env's bytes, or
        TOO_LARGE once they passed it (the bytes read then; no answer is kept)."""
        block = self.blocks.get(env_id)
        if block is None:
            return _BLOCK_GONE
        (room,) = ROOM.unpack_from(payload)
        try:
            what, method, _, (name, indices) = read_command(payload[ROOM.size :])
        except Exception as exc:
            return _unanswerable(exc)
        response = pb.VectorSessionResponse(request_id=1)
        rows, size = BatchStates(), 0
        try:
            for index in indices:
                got = await block.call(what, method, 1, (name, (index,)))
                rows.rows += got.rows
                rows.states += got.states
                rows.errors.update(got.errors)
                size += sum(map(len, got.states))
                if size > room:
                    return Status.TOO_LARGE, ROOM.pack(size)
        except BatchRefused as refused:
            return _refused(response, refused)
        fill_answer(response, rows, "")
        rows.states.clear()  # copied into the answer: not held twice while serialized
        return Status.ANSWER, response.SerializeToString()

    async def close(self, env_id: int, payload: bytes) -> tuple[int, bytes]:
        """Close a block; a strict close answers what its ``close`` raised (FAILED: the
        description and the exception's type on two lines)."""
        block = self.blocks.pop(env_id, None)
        try:
            if block is not None:  # a quiet close never raises
                await (block.close_strictly() if payload == STRICT_CLOSE else block.close())
        except Exception as exc:
            log.exception("environment close() raised")
            return Status.FAILED, f"{describe(exc)}\n{qualname(exc)}".encode()
        return Status.OK, b""


_BLOCK_GONE = (Status.BLOCK_GONE, b"the environment was closed")

#: An ``Op`` added without a handler fails this module's import.
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


def _unanswerable(exc: Exception) -> tuple[int, bytes]:
    """A call this process could not read or answer: refused (INTERNAL, its envs must be
    reset), so one bad frame never ends the process and every block on it."""
    log.exception("the env process could not answer a call")
    refused = BatchRefused(
        _INTERNAL, f"the env process could not answer the call: {describe(exc)}", broken=True
    )
    return _refused(pb.VectorSessionResponse(request_id=1), refused)


def _refused(response: pb.VectorSessionResponse, refused: BatchRefused) -> tuple[int, bytes]:
    response.error.code = refused.code
    response.error.message = refused.message
    response.error.exception_type = refused.exception_type
    flags = refused.broken | refused.replaced << 1 | refused.saturated << 2 | refused.ends << 3
    return Status.CALL_REFUSED + flags, response.SerializeToString()


def _serve_side(side: socket.socket, blocks: dict[int, LocalBatchCalls], threaded: bool) -> None:
    """Close envs the front names on the side socket, on this thread, while the main one
    may be stuck in another env's call. Answers 1 when closed, 0 when not done here
    (unknown, or not thread-safe): the front then sends a CLOSE frame."""
    with contextlib.suppress(OSError):
        while True:
            data = side.recv(SIDE_CLOSE.size, socket.MSG_WAITALL)
            if len(data) < SIDE_CLOSE.size:
                return  # the front is gone
            (env_id,) = SIDE_CLOSE.unpack(data)
            closing: LocalBatchCalls | None = None
            if threaded:  # dict.pop is atomic: the main thread never sees it again
                closing = blocks.pop(env_id, None)
            if closing is not None:
                asyncio.run(closing.close())  # an inline env's close, on this thread
            side.sendall(b"\x01" if closing is not None else b"\x00")


#: Bytes per page of resident memory (``/proc/self/statm`` counts pages).
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _resident_bytes() -> int:
    """This process's resident memory (0 without ``/proc``: nothing is measured)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _over_ceiling(name: str, before: int, ceiling: int, batch: int = 0) -> str:
    """Why an env (or, ``batch``, each of a native batch's) made since this process had
    ``before`` resident bytes is refused; empty if it stayed within ``ceiling``."""
    grew = (_resident_bytes() - before) // max(batch, 1)
    if grew <= ceiling:
        return ""
    made = f"a native batch of {batch} grew" if batch else "grew"
    each = " per env" if batch else ""
    return (
        f"environment {name!r}: building one env {made} its env process by {grew} bytes"
        f"{each}, over the per-env memory ceiling of {ceiling} bytes (--max-env-bytes); it "
        "was closed and nothing was opened"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class _Measured:
    """The env's factory, measured: an instance that grew this process past ``ceiling``
    bytes is closed and refused (InvalidAction), so the block's loop closes the others."""

    factory: Callable[[], Any]
    name: str
    ceiling: int

    def __call__(self) -> Any:
        before = _resident_bytes()
        env = self.factory()
        if over := _over_ceiling(self.name, before, self.ceiling):
            _close_now(env)
            raise InvalidAction(over)
        return env


#: Closes of async envs refused at creation, kept until they finish.
_CLOSING: set[asyncio.Future[Any]] = set()


def _close_now(env: Any) -> None:
    """Close an env that is not kept (an async env's close runs as a task)."""
    try:
        closing = env.close()
        if inspect.isawaitable(closing):
            task = asyncio.ensure_future(closing)
            _CLOSING.add(task)
            task.add_done_callback(_CLOSING.discard)
    except Exception:
        log.exception("environment close() raised")


class _NoPool:
    """Inline and async envs never use the pool; the worker has none."""

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("isolated workers run env calls inline")


_NO_POOL: Any = _NoPool()
