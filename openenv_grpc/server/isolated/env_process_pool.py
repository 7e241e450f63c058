"""``--isolated K``: env instances live in a pool of K env processes (``env_process.py``;
"worker" here), as blocks of their streams (``spread.py``), so a crash or runaway memory
in env code costs only that worker's envs, and CPU-heavy envs use every core.

The front never blocks on a worker: frames go out and answers come in through asyncio
streams. A worker answers its frames one at a time, in order, so the front knows which
call each worker is busy with and since when: a call not answered within the step
timeout kills its worker (that call fails :class:`CallTimedOut`, the worker's other calls
as on a crash), and a replacement starts. A drain uses the same watchdog for its grace.
A call may hold its answer against a :class:`Charge` (offered before its bytes are read;
one not admitted is read and dropped), or hand it to a :data:`Late` should its caller
stop waiting, so steps the envs completed are still counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import socket
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from openenv_grpc.environment import AutoresetMode, InvalidAction
from openenv_grpc.server.errors import EnvFactoryError, SessionLostError
from openenv_grpc.server.isolated.env_process import (
    AUTORESET_MODES,
    BLOCK_OPEN,
    HEADER,
    READ_LIMIT,
    SIDE_CLOSE,
    STRICT_CLOSE,
    VECTOR_BLOCK,
    Op,
    Status,
    put,
    worker_main,
)
from openenv_grpc.server.local.calls import BatchRefused
from openenv_grpc.server.model.spec import EnvSpec, ExecutionMode
from openenv_grpc.server.process.budget import ByteBudget
from openenv_grpc.server.process.orphans import OrphanReaper

__all__ = [
    "CallTimedOut", "Charge", "EnvProcessPool", "Late", "Payload", "Worker",
]  # fmt: skip

log = logging.getLogger(__name__)

_DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
_INTERNAL = grpc.StatusCode.INTERNAL.value[0]
#: Seconds an async env's worker gets past the timeout (it cancels the call itself).
_ASYNC_MARGIN = 1.0
#: Once a drain's grace is over, seconds a call may still keep its worker busy.
_DRAIN_ALLOWANCE = 1.0
#: Seconds :meth:`EnvProcessPool.stop` waits for workers to exit, then for the orphan hook.
_STOP_WAIT = 2.0

_DIED = "the environment's worker process died"

#: A worker's answer: read whole (bytes), or into one buffer when held against a charge.
Payload = bytes | bytearray

#: Takes the status and payload of an answer whose caller was cancelled meanwhile.
Late = Callable[[int, Payload], None]


class CallTimedOut(SessionLostError):
    """The worker did not answer this call within the step timeout and was killed."""


class Charge(Protocol):
    """How a call's answer is held: offered before it is read, given back once let go."""

    def admit(self, status: int, length: int) -> bool:
        """Whether to read an answer of ``length`` bytes (held until :meth:`give`)."""
        ...

    def give(self, length: int) -> None: ...


@dataclass(slots=True)
class _Call:
    """One frame sent to a worker and the answer awaited for it."""

    future: asyncio.Future[tuple[int, Payload]]
    limit: float | None  # seconds the worker may spend on it (None: no limit)
    env_id: int = 0
    charge: Charge | None = None
    #: Set before the frame goes out: the answer may come before the caller's cancellation.
    late: Late | None = None
    started: float = 0.0  # loop time at which the worker began it


class Worker:
    """One worker process, its socket, and the calls it owes answers to, oldest first."""

    def __init__(self, process: Any, sock: socket.socket, side: socket.socket) -> None:
        self.process = process
        self.sock = sock
        #: Closes answered while the worker is busy with another env's call (a drain's).
        self.side = side
        self.side_lock = asyncio.Lock()
        self.writer: asyncio.StreamWriter | None = None  # once connected
        #: Frames not yet handed to the transport.
        self.unsent: deque[tuple[bytes, bytes]] = deque()
        self.wake = asyncio.Event()  # set when ``unsent`` has frames
        self.owed: deque[_Call] = deque()
        self.timer: asyncio.TimerHandle | None = None  # the watchdog of ``owed[0]``
        #: Env id -> how many env instances it is: 1, or a vector sub-batch's size.
        self.envs: dict[int, int] = {}
        self.alive = True
        self.gone = _DIED
        self.ready = False  # the process is up and reading
        self.task: asyncio.Task[None] | None = None  # connects, then reads its answers


class EnvProcessPool:
    """Env processes that host env instances for the sessions of this server."""

    def __init__(
        self,
        factory: Callable[[], Any],
        size: int,
        call_timeout: float | None,
        *,
        max_env_bytes: int = 0,
        budget: ByteBudget | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"env process pool size must be >= 1, got {size}")
        self.call_timeout = call_timeout
        self.max_env_bytes = max_env_bytes  # per env (0: no ceiling)
        #: The server's byte budget, which a query's answers are held against.
        self.budget = budget
        spec = EnvSpec.from_factory(factory)
        margin = _ASYNC_MARGIN if spec.mode is ExecutionMode.ASYNC else 0.0
        self._worker_limit = None if call_timeout is None else call_timeout + margin
        self._factory = factory
        self._size = size
        # spawn: the front already runs gRPC, which must never be forked.
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[Worker] = []
        self._next_env = 1
        self._reaper = OrphanReaper(spec.env_class)
        self._closing: set[asyncio.Task[None]] = set()
        #: Set once a drain began: closes no longer wait behind other envs' calls.
        self._drain_timer: asyncio.TimerHandle | None = None
        self._grace_over_at: float | None = None  # loop time a drain's grace ended
        self._stopped = False

    def start(self) -> None:
        """Start the workers; call on the server's event loop."""
        for _ in range(self._size):
            self._workers.append(self._spawn())

    def _spawn(self) -> Worker:
        front, back = socket.socketpair()
        side_front, side_back = socket.socketpair()
        process = self._context.Process(
            target=worker_main,
            args=(back, self._factory, self.call_timeout, side_back, self.max_env_bytes),
            name="openenv-env-worker",
            daemon=True,
        )
        try:
            process.start()
        except BaseException:
            front.close()
            side_front.close()
            raise
        finally:
            back.close()
            side_back.close()
        side_front.setblocking(False)
        worker = Worker(process, front, side_front)
        worker.task = asyncio.get_running_loop().create_task(
            self._run(worker), name=f"openenv-env-worker-{process.pid}"
        )
        return worker

    async def _run(self, worker: Worker) -> None:
        """Connect to a worker and dispatch its answers until it is gone."""
        writing: asyncio.Task[None] | None = None
        try:
            reader, writer = await asyncio.open_unix_connection(sock=worker.sock, limit=READ_LIMIT)
            worker.writer = writer
            writing = asyncio.create_task(self._write(worker, writer))
            while True:
                length, _, status = HEADER.unpack(await reader.readexactly(HEADER.size))
                owed = worker.owed
                charge = owed[0].charge if owed and status != Status.READY else None
                if length and charge is not None:
                    status, payload = await _read_charged(reader, length, status, owed[0], charge)
                else:
                    payload = await reader.readexactly(length) if length else b""
                self._answered(worker, status, payload)
        except (asyncio.IncompleteReadError, OSError):
            pass  # the worker is gone (mid-frame or not), or was stopped
        finally:
            if writing is not None:
                writing.cancel()
            if worker.writer is not None:
                worker.writer.transport.abort()
            else:
                worker.sock.close()
            worker.side.close()
        self._lost(worker, "died", _DIED)

    async def _write(self, worker: Worker, writer: asyncio.StreamWriter) -> None:
        """Hand queued frames to the transport as the worker takes them."""
        with contextlib.suppress(ConnectionError):  # the reader sees the worker go
            while True:
                while worker.unsent:
                    await writer.drain()
                    put(writer, *worker.unsent.popleft())
                worker.wake.clear()
                await worker.wake.wait()

    def _send(self, worker: Worker, header: bytes, payload: bytes) -> None:
        writer = worker.writer
        if (
            writer is not None
            and not worker.unsent
            and not writer.transport.get_write_buffer_size()
        ):
            put(writer, header, payload)  # the common case: straight to the socket
        else:
            worker.unsent.append((header, payload))
            worker.wake.set()

    def _answered(self, worker: Worker, status: int, payload: Payload) -> None:
        if status == Status.READY:
            worker.ready = True
            return
        call = worker.owed.popleft()
        future = call.future
        if not future.done():  # not cancelled by a session that went away
            future.set_result((status, payload))
        elif call.late is not None and future.cancelled():
            # In a callback of its own: nothing it raises stops this reader.
            future.get_loop().call_soon(call.late, status, payload)
        if worker.owed:
            worker.owed[0].started = future.get_loop().time()
        self._arm(worker)

    def _arm(self, worker: Worker) -> None:
        """Set the watchdog for the call the worker is busy with (if any)."""
        if worker.timer is not None:
            worker.timer.cancel()
            worker.timer = None
        if not worker.owed:
            return
        call = worker.owed[0]
        deadline = None if call.limit is None else call.started + call.limit
        if self._grace_over_at is not None:
            latest = max(call.started, self._grace_over_at) + _DRAIN_ALLOWANCE
            deadline = latest if deadline is None else min(deadline, latest)
        if deadline is not None:
            worker.timer = asyncio.get_running_loop().call_at(deadline, self._expired, worker, call)

    def _expired(self, worker: Worker, call: _Call) -> None:
        worker.timer = None
        if not worker.alive or not worker.owed or worker.owed[0] is not call:
            return
        pid = worker.process.pid
        if self._grace_over_at is not None:
            log.warning("env worker pid %s still busy after the drain's grace: killing it", pid)
            reason = "the environment's worker process was stopped: the server is draining"
            worker.process.kill()
            self._lost(worker, "was killed (drain)", reason)
            return
        limit = self.call_timeout
        log.warning("env worker pid %s: a call did not finish within %gs: killing it", pid, limit)
        worker.process.kill()
        self._lost(
            worker,
            "was killed (step timeout)",
            "the environment's worker process was stopped: another session's call on it "
            f"did not finish within {limit:g}s",
            culprit=call,
            culprit_message=f"the call did not finish within {limit:g}s; the environment's "
            "worker process was stopped",
        )

    def _lost(
        self,
        worker: Worker,
        how: str,
        message: str,
        culprit: _Call | None = None,
        culprit_message: str = "",
    ) -> None:
        """The worker is gone: fail what it owed (``culprit``: the call that hung), reclaim
        its leftovers, replace it."""
        if not worker.alive:
            return
        worker.gone = message
        self._disconnect(worker, message, culprit, culprit_message)
        lost = sum(worker.envs.values())
        log.error("env worker pid %s %s: %d envs lost", worker.process.pid, how, lost)
        self._reaper.reap(worker.process)
        if not self._stopped and self._grace_over_at is None:
            self._workers[self._workers.index(worker)] = self._spawn()

    def _disconnect(
        self,
        worker: Worker,
        message: str = _DIED,
        culprit: _Call | None = None,
        culprit_message: str = "",
    ) -> None:
        """Cut ``worker`` off; the calls it owed fail (``culprit``, the call that hung:
        CallTimedOut)."""
        worker.alive = False
        for call in worker.owed:
            error = CallTimedOut(culprit_message) if call is culprit else SessionLostError(message)
            if not call.future.done():
                call.future.set_exception(error)
        worker.owed.clear()
        self._arm(worker)  # no call owed: the watchdog is off
        worker.unsent.clear()
        # Shut down, not closed (the transport owns the socket): the worker sees EOF now.
        with contextlib.suppress(OSError):
            worker.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            worker.side.shutdown(socket.SHUT_RDWR)

    async def call(
        self,
        worker: Worker,
        env_id: int,
        op: int,
        payload: bytes = b"",
        *,
        envs: int = 1,
        charge: Charge | None = None,
        late: Late | None = None,
    ) -> tuple[int, Payload]:
        """Send one frame and wait for its status and payload; a call about ``envs`` envs
        gets the step timeout that many times. With ``charge``, the caller holds the
        payload's bytes until it gives them back (UNKEPT, no payload: not admitted); with
        ``late``, a caller cancelled first has the answer handed there, exactly once.

        Raises:
            SessionLostError: the worker is or becomes dead (``CallTimedOut``: this call
                took too long).
        """
        if not worker.alive:
            raise SessionLostError(worker.gone)
        loop = asyncio.get_running_loop()
        limit = self._worker_limit
        if op == Op.CREATE:
            limit = None
        elif limit is not None and envs > 1:
            limit *= envs
        call = _Call(loop.create_future(), limit, env_id, charge, late)
        worker.owed.append(call)
        if len(worker.owed) == 1:
            call.started = loop.time()
            self._arm(worker)
        self._send(worker, HEADER.pack(len(payload), env_id, op), payload)
        try:
            return await call.future
        except asyncio.CancelledError:
            # Cancelled after its answer came: nobody else gives its bytes back.
            future = call.future
            answered = future.done() and not future.cancelled() and future.exception() is None
            if charge is not None and answered:
                charge.give(len(future.result()[1]))
            if late is not None and answered:  # else the future is cancelled: _answered's
                loop.call_soon(late, *future.result())
            raise

    async def place_block(
        self, size: int, autoreset: AutoresetMode, *, kind: int, prefer_ready: bool
    ) -> tuple[Worker, int, bool]:
        """:meth:`create_block` on the first worker of :meth:`for_new_envs`, or on
        another should that one die first; returns the worker too.

        Raises:
            EnvFactoryError, InvalidAction: see :meth:`create_block`.
            SessionLostError: no worker is running, or every one died meanwhile.
        """
        tried: set[int] = set()
        while True:
            worker = self.for_new_envs(prefer_ready=prefer_ready, tried=tried)[0]
            tried.add(id(worker))
            try:
                env_id, native = await self.create_block(worker, size, autoreset, kind=kind)
            except SessionLostError:
                if len(tried) >= 2 * self._size:
                    raise
                log.info(
                    "env worker pid %s died during a create: trying another", worker.process.pid
                )
                continue
            return worker, env_id, native

    def for_new_envs(
        self, *, prefer_ready: bool = False, tried: AbstractSet[int] = frozenset()
    ) -> list[Worker]:
        """The workers new envs may go to without waiting behind another call: the idle
        ones, least loaded (and, ``prefer_ready``, up) first; if none, a new worker (up to
        twice the pool's size; it retires once empty); at that limit, every live one.

        Raises:
            SessionLostError: no worker is running.
        """
        live = sorted(
            (w for w in self._workers if w.alive and id(w) not in tried),
            key=lambda w: (prefer_ready and not w.ready, sum(w.envs.values())),
        )
        if not live:
            raise SessionLostError("no environment worker process is running")
        idle = [w for w in live if not w.owed]
        if idle:
            return idle
        if (
            self._grace_over_at is None
            and not self._stopped
            and len(self._workers) < 2 * self._size
        ):
            worker = self._spawn()
            self._workers.append(worker)
            log.info(
                "every env worker is busy: started worker pid %s for new envs (%d now)",
                worker.process.pid, len(self._workers),
            )  # fmt: skip
            return [worker]
        return live

    def _retire(self, worker: Worker) -> None:
        """Stop ``worker`` if it holds nothing and the pool is over its size."""
        if (
            worker.alive
            and not worker.envs
            and not worker.owed
            and sum(w.alive for w in self._workers) > self._size
        ):
            self._workers.remove(worker)
            self._disconnect(worker)  # it sees EOF and exits: it holds no env
            self._reaper.reap(worker.process)  # joined off the loop (no zombie)
            log.info("env worker pid %s retired (%d now)", worker.process.pid, len(self._workers))

    async def create_block(
        self, worker: Worker, size: int, autoreset: AutoresetMode, *, kind: int = VECTOR_BLOCK
    ) -> tuple[int, bool]:
        """Create a block of ``size`` envs (of ``kind``) on ``worker``; returns its env id
        and whether it is the env's native batch.

        Raises:
            EnvFactoryError: the factory (or ``make_batch``) raised in the worker.
            InvalidAction: ``make_batch`` refused.
            SessionLostError: the worker died meanwhile.
        """
        payload = BLOCK_OPEN.pack(size, AUTORESET_MODES.index(autoreset), kind)
        env_id = self._next_env
        self._next_env += 1
        worker.envs[env_id] = size  # counted at once, so opens at the same time spread out
        try:
            status, answer = await self.call(worker, env_id, Op.CREATE, payload)
            if status in (Status.FAILED, Status.REFUSED):
                text = answer.decode(errors="replace")
                raise InvalidAction(text) if status == Status.REFUSED else EnvFactoryError(text)
        except BaseException as exc:
            worker.envs.pop(env_id, None)
            if isinstance(exc, asyncio.CancelledError):
                self.close_env(worker, env_id)  # the worker builds it all the same
            raise
        return env_id, answer == b"native"

    def close_env(self, worker: Worker, env_id: int) -> asyncio.Task[None]:
        """Close an env in its worker, in a task of its own (a cancelled session must not
        skip it); quietly if the worker is or becomes dead."""
        task = asyncio.get_running_loop().create_task(self._close_env(worker, env_id))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return task

    async def _close_env(self, worker: Worker, env_id: int) -> None:
        if await self._close_on_the_side(worker, env_id):
            return
        with contextlib.suppress(SessionLostError):  # it died with its process
            await self.call(worker, env_id, Op.CLOSE)
            self._retire(worker)

    async def close_strictly(self, worker: Worker, env_id: int) -> None:
        """Close a block for a close command, in its worker, and wait for it.

        Raises:
            BatchRefused: the env's ``close`` raised (INTERNAL; it is closed all the same)
                or hung past the step timeout (DEADLINE_EXCEEDED; its worker was stopped):
                the stream ends.
            SessionLostError: the worker died meanwhile.
        """
        worker.envs.pop(env_id, None)
        try:
            status, payload = await self.call(worker, env_id, Op.CLOSE, STRICT_CLOSE)
        except CallTimedOut:
            raise BatchRefused(
                _DEADLINE_EXCEEDED,
                f"close did not finish within {self.call_timeout:g}s; the environment's "
                "worker process was stopped",
                ends=True,
            ) from None
        self._retire(worker)
        if status == Status.FAILED:  # the description and the exception's type
            text, _, kind = payload.decode(errors="replace").partition("\n")
            raise BatchRefused(_INTERNAL, f"close failed: {text}", kind, ends=True)

    async def _close_on_the_side(self, worker: Worker, env_id: int) -> bool:
        """In a drain, close an env whose worker is busy with another env's call (maybe
        hung, killed at the grace's end) on its side thread. True if closed so (or the
        worker is gone); False: send CLOSE."""
        if self._drain_timer is None or not worker.alive or not worker.owed:
            return False
        if worker.owed[0].env_id == env_id:
            return False  # its own call runs: close after it, in order
        loop = asyncio.get_running_loop()
        try:
            async with worker.side_lock:
                await loop.sock_sendall(worker.side, SIDE_CLOSE.pack(env_id))
                answer = await loop.sock_recv(worker.side, 1)
        except OSError:
            return True
        return answer != b"\x00"  # (none: the worker is gone, and its envs with it)

    def start_draining(self, grace: float) -> None:
        """The server drains: past ``grace`` seconds, a call that keeps its worker busy
        longer than ``_DRAIN_ALLOWANCE`` kills it; dead workers are not replaced."""
        self._drain_timer = asyncio.get_running_loop().call_later(grace, self._end_grace)

    def _end_grace(self) -> None:
        self._grace_over_at = asyncio.get_running_loop().time()
        for worker in self._workers:
            if worker.alive and worker.owed:
                self._arm(worker)

    def stop(self) -> None:
        """Stop every worker (each closes its envs and exits; killed after
        ``_STOP_WAIT`` s), then give ``reclaim_orphans`` up to ``_STOP_WAIT`` s. Blocks the
        event loop: the server has stopped serving by then."""
        if self._stopped:
            return
        self._stopped = True
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        live = [worker for worker in self._workers if worker.alive]
        for worker in live:
            self._disconnect(worker, "the server stopped")
        deadline = time.monotonic() + _STOP_WAIT
        for worker in live:
            worker.process.join(max(0.0, deadline - time.monotonic()))
        for worker in live:
            if worker.process.is_alive():
                log.warning("env worker pid %s did not exit: killing it", worker.process.pid)
                worker.process.kill()
                self._reaper.reap(worker.process)
        if not self._reaper.wait(_STOP_WAIT):
            log.warning("reclaim_orphans() did not finish in %gs; exiting anyway", _STOP_WAIT)


async def _read_charged(
    reader: asyncio.StreamReader, length: int, status: int, call: _Call, charge: Charge
) -> tuple[int, Payload]:
    """Read a charged call's answer if admitted (else UNKEPT, no bytes; no bytes either
    when nobody waits for it)."""
    gone = call.future.done()  # its caller went away: nothing to hold
    if gone or not charge.admit(status, length):
        await _read_whole(reader, length, keep=False)
        return status if gone else Status.UNKEPT, b""
    try:
        payload = await _read_whole(reader, length)
    except BaseException:
        charge.give(length)
        raise
    if call.future.done():  # gone while its answer came in
        charge.give(length)
        return status, b""
    return status, payload


async def _read_whole(reader: asyncio.StreamReader, length: int, *, keep: bool = True) -> bytearray:
    """``length`` bytes read into one buffer (in memory once, not twice as with
    ``readexactly``), or skipped (not ``keep``); IncompleteReadError if the worker went
    away first."""
    data = bytearray(length if keep else 0)
    with memoryview(data) as view:
        done = 0
        while done < length:
            chunk = await reader.read(min(length - done, READ_LIMIT))
            if not chunk:
                raise asyncio.IncompleteReadError(b"", length)
            if keep:
                view[done : done + len(chunk)] = chunk
            done += len(chunk)
    return data
