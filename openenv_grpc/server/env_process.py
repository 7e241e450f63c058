"""An env process of ``--isolated`` (the env process pool's worker), and the frames it
exchanges with the front.

An env process hosts env instances for the front (``env_process_pool.py``) and answers
one frame at a time, in the order the frames arrive, with the same request handler as the
in-process path (:class:`~openenv_grpc.server.session_view.SessionView`). It talks to the
front over one socket pair with asyncio streams; nothing is pickled after start-up (only
the factory reference, once, to spawn the process).

A frame is a fixed header and a payload of ``length`` bytes::

    length: u32 | env id: u64 | operation (front) or status (worker): u8

The worker answers every frame it reads with exactly one frame, in the order it read
them, so the front matches answers to calls by their order and knows which call a worker
is busy with. The only other frame is READY, sent once when the worker is up.

A vector stream's sub-batch lives here too (``VECTOR_CREATE``, then ``VECTOR_REQUEST``
frames): the front keeps the stream's books and sends each env process the part of a
request that concerns its envs (``vector_frames.py``); the env process runs it on a
:class:`~openenv_grpc.server.vector_batch.VectorBatch`, inline, and answers the outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import grpc

from openenv_grpc.codec import PayloadError, unpack
from openenv_grpc.environment import AutoresetMode, InvalidAction
from openenv_grpc.server.backend import Answer, Outcome, UndecodableRequest
from openenv_grpc.server.calls import (
    BatchRefused,
    LocalBatchCalls,
    ResetArgs,
    RestoreArgs,
    StepArgs,
    local_calls,
)
from openenv_grpc.server.phases import SESSION_WORDS
from openenv_grpc.server.session_view import SessionView
from openenv_grpc.server.snapshots import SnapshotSeal
from openenv_grpc.server.spec import EnvSpec, ExecutionMode
from openenv_grpc.server.vector_frames import (
    fill_errors,
    fill_result,
    fill_snapshots,
    fill_states,
    read_restore,
)
from openenv_grpc.v1 import session_pb2 as pb

__all__ = [
    "AUTORESET_MODES",
    "HEADER",
    "READ_LIMIT",
    "SIDE_CLOSE",
    "SIDE_CLOSED",
    "VECTOR_OPEN",
    "Op",
    "Status",
    "answer_status",
    "answered",
    "refusal_flags",
    "worker_main",
]

log = logging.getLogger(__name__)

#: Payload length, env id, operation or status.
HEADER = struct.Struct("<IQB")
#: Stream buffer size: large frames are read in big chunks, not 64 KiB ones.
READ_LIMIT = 1 << 20
#: VECTOR_CREATE's payload: the sub-batch's size and its autoreset mode (an index of
#: :data:`AUTORESET_MODES`).
VECTOR_OPEN = struct.Struct("<IB")
AUTORESET_MODES = (AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED)


class Op:
    """Front -> worker operations. CLOSE closes either kind of env."""

    CREATE, REQUEST, CLOSE, VECTOR_CREATE, VECTOR_REQUEST = 1, 2, 3, 4, 5


class Status:
    """Worker -> front statuses. OK: an env was created (a sub-batch: the payload says
    ``native`` or ``loop``) or closed; FAILED: its factory raised; REFUSED: ``make_batch``
    refused (InvalidAction); UNDECODABLE: a request did not parse; READY: sent once, when
    the worker is up, env id 0. An answered request has status ``ANSWER + outcome`` (plus
    ``ENDS`` when the stream must end after it): the driver's
    :class:`~openenv_grpc.server.backend.Answer`, which the front rebuilds without parsing
    the response. A sub-batch's answer is VECTOR_ANSWER (a VectorSessionResponse), or
    ``VECTOR_REFUSED + flags`` (:func:`refusal_flags`) when the whole call failed."""

    OK, FAILED, UNDECODABLE, READY, REFUSED = 0, 2, 3, 5, 6
    ANSWER, ENDS = 16, 8
    VECTOR_ANSWER, VECTOR_REFUSED = 48, 64


def refusal_flags(refused: BatchRefused) -> int:
    """The flags of a refused sub-batch call, added to ``Status.VECTOR_REFUSED``."""
    return refused.broken | refused.replaced << 1 | refused.saturated << 2 | refused.ends << 3


def answer_status(answer: Answer) -> int:
    """The status byte that carries ``answer``'s outcome (and whether the stream ends)."""
    return Status.ANSWER + int(answer.outcome) + (Status.ENDS if answer.ends else 0)


def answered(status: int) -> tuple[Outcome, bool]:
    """The outcome and the end-of-stream flag an answer's status byte carries."""
    code = status - Status.ANSWER
    return Outcome(code & ~Status.ENDS), bool(code & Status.ENDS)


#: A side close (front -> worker): the env id. The answer adds a status byte.
SIDE_CLOSE = struct.Struct("<Q")
SIDE_CLOSED = struct.Struct("<QB")


def worker_main(
    sock: socket.socket,
    factory: Callable[[], Any],
    call_timeout: float | None,
    snapshots: SnapshotSeal | None = None,
    side: socket.socket | None = None,
) -> None:
    """Entry point of a worker process: serve frames until the front goes away.

    ``snapshots`` is the front's seal, key ring included: it arrives through the spawn's
    private pipe (never the environment or a command line), so every env process signs
    and verifies exactly as the front's server would.
    """
    # Ctrl-C reaches the whole process group: the front drains and then ends its workers,
    # so a worker must not die first and take its envs with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    asyncio.run(_serve(sock, factory, call_timeout, snapshots, side))


async def _serve(
    sock: socket.socket,
    factory: Callable[[], Any],
    call_timeout: float | None,
    snapshots: SnapshotSeal | None,
    side: socket.socket | None = None,
) -> None:
    spec = EnvSpec.from_factory(factory)
    # Pooled envs are thread-safe across instances (in-process, their calls run on a
    # pool): those may be closed on the side while another instance's call runs.
    threaded = spec.mode in (ExecutionMode.POOL, ExecutionMode.MEASURED)
    if threaded:
        # The worker is the env's own process: blocking calls run inline, one at a time.
        spec = dataclasses.replace(spec, mode=ExecutionMode.INLINE)
    reader, writer = await asyncio.open_unix_connection(sock=sock, limit=READ_LIMIT)
    drivers: dict[int, SessionView] = {}
    batches: dict[int, LocalBatchCalls] = {}
    if side is not None:
        threading.Thread(
            target=_serve_side, args=(side, drivers, batches, threaded),
            name="openenv-side-closes", daemon=True,
        ).start()  # fmt: skip

    async def answer(env_id: int, status: int, payload: bytes = b"") -> None:
        writer.write(HEADER.pack(len(payload), env_id, status) + payload)
        await writer.drain()

    try:
        await answer(0, Status.READY)
        while True:
            length, env_id, op = HEADER.unpack(await reader.readexactly(HEADER.size))
            payload = await reader.readexactly(length) if length else b""
            if op in (Op.REQUEST, Op.VECTOR_REQUEST) and (
                env_id not in (drivers if op == Op.REQUEST else batches)
            ):
                # Closed on the side while this frame was queued: its session is gone.
                await answer(env_id, Status.UNDECODABLE, b"the environment was closed")
            elif op == Op.VECTOR_REQUEST:
                await answer(env_id, *await _vector_answer(batches[env_id], spec, payload))
            elif op == Op.REQUEST:
                try:
                    done = await drivers[env_id].handle(payload)
                except UndecodableRequest as exc:
                    await answer(env_id, Status.UNDECODABLE, str(exc).encode())
                    continue
                await answer(env_id, answer_status(done), done.response)
            elif op == Op.CREATE:
                try:
                    calls = await local_calls(
                        spec, 1, AutoresetMode.DISABLED, _NO_POOL, words=SESSION_WORDS,
                        call_timeout=call_timeout, native=False,
                    )  # fmt: skip
                    drivers[env_id] = SessionView(spec, calls, snapshots)
                except Exception as exc:
                    log.exception("environment factory raised")
                    message = f"{type(exc).__name__}: {exc}".encode()
                    await answer(env_id, Status.FAILED, message)
                    continue
                await answer(env_id, Status.OK)
            elif op == Op.VECTOR_CREATE:
                size, mode = VECTOR_OPEN.unpack(payload)
                status, text = await _vector_create(spec, size, AUTORESET_MODES[mode])
                if isinstance(text, LocalBatchCalls):
                    batches[env_id] = text
                    text = b"native" if text.native else b"loop"
                await answer(env_id, status, text)
            elif op == Op.CLOSE:
                closing: SessionView | LocalBatchCalls | None = drivers.pop(env_id, None)
                closing = closing or batches.pop(env_id, None)
                if closing is not None:
                    await closing.close()
                await answer(env_id, Status.OK)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass  # the front is gone (or ended this worker): close what is left
    finally:
        # popitem, not a loop over values(): the side thread may pop meanwhile.
        while drivers:
            await drivers.popitem()[1].close()
        while batches:
            await batches.popitem()[1].close()


def _serve_side(
    side: socket.socket,
    drivers: dict[int, SessionView],
    batches: dict[int, LocalBatchCalls],
    threaded: bool,
) -> None:
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
            closing: SessionView | LocalBatchCalls | None = None
            if threaded:  # dict.pop is atomic: the main thread never sees it again
                closing = drivers.pop(env_id, None) or batches.pop(env_id, None)
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


async def _vector_create(
    spec: EnvSpec, size: int, autoreset: AutoresetMode
) -> tuple[int, LocalBatchCalls | bytes]:
    """Build a sub-batch of ``size`` envs; returns the status to answer and the batch (or
    the failure's text)."""
    try:
        # No step timeout here for inline envs: the front's watchdog stops this process.
        return Status.OK, await local_calls(spec, size, autoreset, _NO_POOL)
    except InvalidAction as exc:
        return Status.REFUSED, str(exc).encode()
    except Exception as exc:
        log.exception("environment factory raised")
        return Status.FAILED, f"{type(exc).__name__}: {exc}".encode()


async def _vector_answer(
    calls: LocalBatchCalls, spec: EnvSpec, payload: bytes
) -> tuple[int, bytes]:
    """Run one sub-batch frame (checked by the front already); returns the status and the
    answer (a VectorSessionResponse)."""
    request = pb.VectorSessionRequest.FromString(payload)
    response = pb.VectorSessionResponse(request_id=request.request_id)
    command = request.WhichOneof("command")
    types = spec.types
    try:
        if command == "step":
            step = request.step
            indices = list(step.indices)
            if step.HasField("batch_action"):
                action = unpack(step.batch_action, types.action, "batch action")
                args = StepArgs(indices, action, step.batch_action, True)
            else:
                actions = [unpack(a, types.action, "action") for a in step.actions]
                args = StepArgs(indices, actions, step.actions, False)
            outcome = await calls.step(args)
            # Only the ids of episodes autoreset here: the front keeps the other books.
            new_ids = outcome.new_episode_ids
            autoreset = outcome.autoreset is not None
            ids = [new_ids.get(index, "") for index in outcome.rows] if autoreset else []
            fill_result(response.result, outcome, spec.observation_url, ids, ())
        elif command == "reset":
            reset = request.reset
            commands = reset.envs
            options = [
                unpack(c.options, types.reset_options, "reset options")
                if c.HasField("options")
                else None
                for c in commands
            ]
            args_reset = ResetArgs(
                list(reset.indices),
                [c.seed if c.HasField("seed") else None for c in commands],
                [c.episode_id for c in commands],
                options,
                [c.options if c.HasField("options") else None for c in commands],
                reset.batch_observation,
            )
            outcome = await calls.reset(args_reset)
            fill_result(response.result, outcome, spec.observation_url, (), ())
        elif command == "snapshot":  # the envs' own bytes: the front seals them
            snapshots = await calls.snapshot(list(request.snapshot.indices))
            fill_snapshots(response.snapshots, snapshots)
        elif command == "restore":  # authenticated by the front already
            indices, captured = read_restore(request.restore)
            failed = await calls.restore(RestoreArgs(indices, captured))
            response.restored.SetInParent()
            fill_errors(response.restored.errors, failed)
        else:
            states = await calls.state(list(request.state.indices))
            fill_states(response.states, states, spec.state_url, None, None)
    except PayloadError as exc:  # the front checked the payloads: not expected
        response.ClearField("outcome")
        response.error.code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
        response.error.message = str(exc)
        return Status.VECTOR_REFUSED, response.SerializeToString()
    except BatchRefused as refused:
        response.ClearField("outcome")
        response.error.code = refused.code
        response.error.message = refused.message
        response.error.exception_type = refused.exception_type
        return Status.VECTOR_REFUSED + refusal_flags(refused), response.SerializeToString()
    return Status.VECTOR_ANSWER, response.SerializeToString()


class _NoPool:
    """Inline and async envs never use the pool; the worker has none."""

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("isolated workers run env calls inline")


_NO_POOL: Any = _NoPool()
