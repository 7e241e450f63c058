"""Isolated execution (``--isolated K``): env instances live in a pool of K env processes.

The gRPC front (one process) keeps the sessions and their drivers; each env lives in one
env process (``env_process.py``; "worker" below means one of them, never a ``--workers``
server process), as a block of its stream: a Session's one env, or a sub-batch of a
vector stream (``spread.py``). So a segfault, ``os._exit`` or runaway memory in
env code costs only the envs on that worker (a Session there ends, UNAVAILABLE "session
lost"; a vector stream's envs there answer UNAVAILABLE and are replaced, the stream goes
on), the pool starts a replacement, and CPU-heavy envs use every core even when all
streams share one HTTP/2 connection.

The front never blocks on a worker: frames go out through asyncio streams (a frame for a
busy worker waits in that worker's queue, written as the worker reads), and answers come
in the same way. A worker answers its frames one at a time, in order, so the front knows
which call each worker is busy with and since when. That is how it enforces the step
timeout, which a worker running env code inline cannot: a worker that has not answered a
call in time is killed; that call fails :class:`CallTimedOut` (its stream answers
DEADLINE_EXCEEDED in-band and gets fresh envs on a live worker), the other calls on that
worker fail as on a crash, and a replacement worker starts. A drain uses the same watchdog
to keep its grace period. After a worker dies, the env's ``reclaim_orphans`` hook runs in a
thread (``orphans.py``).

A vector stream's envs live here as sub-batches, one per worker, so that they step in
parallel; a block counts as its size in a worker's load.

A call may say how its answer is held (a :class:`Charge`: a query's, against its room
and the server's byte budget): the answer's length is offered to it as its header
arrives, before any of its bytes are read; one it does not admit is read and dropped a
buffer at a time (answered UNKEPT, with no payload), as is one nobody waits for any more.

A call may also say who takes its answer should its caller stop waiting (a :data:`Late`:
a step's, whose stream ended while the env process stepped): the answer that comes after
all is handed to it, once, so the steps the envs completed are still counted.
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
from typing import Any, Protocol

from openenv_grpc.environment import AutoresetMode, InvalidAction
from openenv_grpc.server.errors import EnvFactoryError, SessionLostError
from openenv_grpc.server.isolated.env_process import (
    AUTORESET_MODES,
    BLOCK_OPEN,
    HEADER,
    READ_LIMIT,
    SIDE_CLOSE,
    SIDE_CLOSED,
    STRICT_CLOSE,
    VECTOR_BLOCK,
    Op,
    Status,
    worker_main,
)
from openenv_grpc.server.model.spec import EnvSpec, ExecutionMode
from openenv_grpc.server.process.budget import ByteBudget
from openenv_grpc.server.process.orphans import OrphanReaper

__all__ = [
    "CallTimedOut", "Charge", "CloseFailed", "EnvProcessPool", "Late", "Payload", "Worker",
]  # fmt: skip

log = logging.getLogger(__name__)

#: Frames smaller than this are joined to their header and written in one piece; larger
#: ones are written after it, never copied into one buffer.
_JOIN_BELOW = 64 * 1024
#: Seconds an async env's worker gets past the timeout before the front kills it: the
#: worker cancels the call itself at the timeout (as in-process) and answers.
_ASYNC_MARGIN = 1.0
#: Once a drain's grace period is over, seconds a call may still keep its worker busy
#: (e.g. the closes the drain sends; closes of other envs go on its side thread) before
#: that worker is killed.
_DRAIN_ALLOWANCE = 1.0
#: Seconds :meth:`EnvProcessPool.stop` waits for workers to exit, then for the orphan hook.
_STOP_WAIT = 2.0

_DIED = "the environment's worker process died"

#: A worker's answer: read whole (bytes), or into one buffer when held against a charge.
Payload = bytes | bytearray

#: Takes the status and payload of an answer whose caller was cancelled before it came
#: (or as it came): see :meth:`EnvProcessPool.call`.
Late = Callable[[int, Payload], None]


class CloseFailed(Exception):
    """A block's ``close`` raised in its worker: ``describe(exc)`` and the exception's type."""

    def __init__(self, message: str, exception_type: str) -> None:
        super().__init__(message)
        self.message = message
        self.exception_type = exception_type


class CallTimedOut(SessionLostError):
    """The worker did not answer this call within the step timeout and was killed."""


class Charge(Protocol):
    """How a call's answer is held: offered before it is read, given back once let go."""

    def admit(self, status: int, length: int) -> bool:
        """Whether to read an answer of ``status`` and ``length`` bytes: True, and the
        caller holds those bytes until :meth:`give`; False, and it is dropped unread."""
        ...

    def give(self, length: int) -> None:
        """``length`` bytes admitted before are let go."""
        ...


class _Call:
    """One frame sent to a worker and the answer awaited for it."""

    __slots__ = ("charge", "env_id", "future", "late", "limit", "started")

    def __init__(
        self,
        future: asyncio.Future[tuple[int, Payload]],
        limit: float | None,
        env_id: int = 0,
        charge: Charge | None = None,
        late: Late | None = None,
    ) -> None:
        self.future = future
        #: The env the call is about.
        self.env_id = env_id
        #: Seconds the worker may spend on it (None: no limit).
        self.limit = limit
        #: Loop time at which the worker began it (it answers in order, one at a time).
        self.started = 0.0
        #: How its answer is held (None: read whole, whatever its length).
        self.charge = charge
        #: Takes its answer if it comes after its caller was cancelled (None: dropped).
        #: Set before the frame goes out: the answer may come before the caller sees its
        #: cancellation.
        self.late = late


class _Worker:
    """One worker process, its socket, and the calls it owes answers to, oldest first."""

    def __init__(self, process: Any, sock: socket.socket, side: socket.socket) -> None:
        self.process = process
        self.sock = sock
        #: Closes of envs with no call in flight, answered while the worker is busy with
        #: another env's call (see :meth:`EnvProcessPool._close_env`); one at a time.
        self.side = side
        self.side_lock = asyncio.Lock()
        self.writer: asyncio.StreamWriter | None = None  # once connected
        #: Frames not yet handed to the transport (it holds at most one frame more).
        self.unsent: deque[tuple[bytes, bytes]] = deque()
        self.wake = asyncio.Event()  # set when ``unsent`` has frames
        self.owed: deque[_Call] = deque()
        self.timer: asyncio.TimerHandle | None = None  # the watchdog of ``owed[0]``
        #: Env id -> how many env instances it is: 1, or a vector sub-batch's size.
        self.envs: dict[int, int] = {}
        self.alive = True
        #: Why it is gone, once it is: what its sessions are told.
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
        #: The step timeout this pool enforces (None: none).
        self.call_timeout = call_timeout
        #: What a worker's construction of one env may add to its memory (0: no ceiling).
        self.max_env_bytes = max_env_bytes
        #: The server's byte budget, which a query's answers are held against (None: not
        #: counted); the pool holds it for the streams on its env processes.
        self.budget = budget
        spec = EnvSpec.from_factory(factory)
        margin = _ASYNC_MARGIN if spec.mode is ExecutionMode.ASYNC else 0.0
        self._worker_limit = None if call_timeout is None else call_timeout + margin
        self._factory = factory
        self._size = size
        #: Workers the pool may start beyond ``size`` while every worker is busy.
        self._overflow = size
        # spawn: the front already runs gRPC, which must never be forked.
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []
        self._next_env = 1
        self._reaper = OrphanReaper(spec.env_class)
        self._closing: set[asyncio.Task[None]] = set()
        self._drain_timer: asyncio.TimerHandle | None = None
        #: Loop time at which a drain's grace period ended (None: not yet).
        self._grace_over_at: float | None = None
        #: A drain began: closes no longer wait behind other envs' calls.
        self._draining = False
        self._stopped = False

    def start(self) -> None:
        """Start the workers; call on the server's event loop."""
        for _ in range(self._size):
            self._workers.append(self._spawn())

    # -- worker processes ---------------------------------------------------------------

    def _spawn(self) -> _Worker:
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
        worker = _Worker(process, front, side_front)
        worker.task = asyncio.get_running_loop().create_task(
            self._run(worker), name=f"openenv-env-worker-{process.pid}"
        )
        return worker

    async def _run(self, worker: _Worker) -> None:
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

    async def _write(self, worker: _Worker, writer: asyncio.StreamWriter) -> None:
        """Hand queued frames to the transport as the worker takes them."""
        with contextlib.suppress(ConnectionError):  # the reader sees the worker go
            while True:
                while worker.unsent:
                    # Room first: the transport holds at most one frame past its mark.
                    await writer.drain()
                    _put(writer, *worker.unsent.popleft())
                worker.wake.clear()
                await worker.wake.wait()

    def _send(self, worker: _Worker, header: bytes, payload: bytes) -> None:
        writer = worker.writer
        if (
            writer is not None
            and not worker.unsent
            and not writer.transport.get_write_buffer_size()
        ):
            _put(writer, header, payload)  # the common case: straight to the socket
        else:
            worker.unsent.append((header, payload))
            worker.wake.set()

    def _answered(self, worker: _Worker, status: int, payload: Payload) -> None:
        if status == Status.READY:
            worker.ready = True
            return
        call = worker.owed.popleft()
        future = call.future
        if not future.done():  # not cancelled by a session that went away
            future.set_result((status, payload))
        elif call.late is not None and future.cancelled():
            # Its caller went away first, and the env did the work all the same: handed on
            # in a callback of its own, so nothing it raises stops this worker's reader.
            future.get_loop().call_soon(call.late, status, payload)
        if worker.owed:
            self._begin(worker, worker.owed[0])
        elif worker.timer is not None:
            worker.timer.cancel()
            worker.timer = None

    # -- the watchdog -------------------------------------------------------------------

    def _begin(self, worker: _Worker, call: _Call) -> None:
        """The worker starts on ``call`` now."""
        call.started = asyncio.get_running_loop().time()
        self._arm(worker)

    def _arm(self, worker: _Worker) -> None:
        """Set the watchdog for the call the worker is busy with."""
        if worker.timer is not None:
            worker.timer.cancel()
            worker.timer = None
        call = worker.owed[0]
        deadline = None if call.limit is None else call.started + call.limit
        if self._grace_over_at is not None:
            latest = max(call.started, self._grace_over_at) + _DRAIN_ALLOWANCE
            deadline = latest if deadline is None else min(deadline, latest)
        if deadline is not None:
            worker.timer = asyncio.get_running_loop().call_at(deadline, self._expired, worker, call)

    def _expired(self, worker: _Worker, call: _Call) -> None:
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
        worker: _Worker,
        how: str,
        message: str,
        culprit: _Call | None = None,
        culprit_message: str = "",
    ) -> None:
        """The worker is gone: fail what it owed (``culprit``, the call that hung, with its
        own message), reclaim its leftovers, replace it."""
        if not worker.alive:
            return
        self._disconnect(worker)
        worker.gone = message
        for call in worker.owed:
            if not call.future.done():
                if call is culprit:
                    call.future.set_exception(CallTimedOut(culprit_message))
                else:
                    call.future.set_exception(SessionLostError(message))
        worker.owed.clear()
        lost = sum(worker.envs.values())
        log.error("env worker pid %s %s: %d envs lost", worker.process.pid, how, lost)
        self._reaper.reap(worker.process)
        if not self._stopped and self._grace_over_at is None:
            self._workers[self._workers.index(worker)] = self._spawn()

    def _disconnect(self, worker: _Worker) -> None:
        worker.alive = False
        if worker.timer is not None:
            worker.timer.cancel()
            worker.timer = None
        worker.unsent.clear()
        # Shut down, not closed: the transport owns the socket. The worker sees EOF now,
        # even if this loop does not run for a while (stop() waits on it).
        with contextlib.suppress(OSError):
            worker.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            worker.side.shutdown(socket.SHUT_RDWR)

    # -- calls ----------------------------------------------------------------------------

    async def call(
        self,
        worker: _Worker,
        env_id: int,
        op: int,
        payload: bytes = b"",
        *,
        envs: int = 1,
        charge: Charge | None = None,
        late: Late | None = None,
    ) -> tuple[int, Payload]:
        """Send one frame and wait for its answer; returns its status and payload. A call
        about ``envs`` envs (a sub-batch's step) gets the step timeout that many times.
        With ``charge``, the answer is offered to it first: the caller holds
        ``len(payload)`` bytes of it until it gives them back (UNKEPT and no payload: not
        admitted). With ``late``, a caller cancelled before it got the answer has it
        handed to ``late`` once the worker answers (in a loop callback): exactly once, and
        never if this call returned it, or the worker died first.

        Raises:
            SessionLostError: the worker is (or becomes) dead, or was killed because this
                call (``CallTimedOut``) or another one on it took too long.
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
            self._begin(worker, call)
        self._send(worker, HEADER.pack(len(payload), env_id, op), payload)
        try:
            return await call.future
        except asyncio.CancelledError:
            # Cancelled after its answer came: nobody else will give its bytes back.
            future = call.future
            answered = future.done() and not future.cancelled() and future.exception() is None
            if charge is not None and answered:
                charge.give(len(future.result()[1]))
            if late is not None and answered:  # else the future is cancelled: _answered's
                loop.call_soon(late, *future.result())
            raise

    async def place_block(
        self, size: int, autoreset: AutoresetMode, *, kind: int, prefer_ready: bool
    ) -> tuple[_Worker, int, bool]:
        """Create a block (of ``kind``, as :meth:`create_block`) on the first worker of
        :meth:`for_new_envs`; returns the worker, the block's env id and whether it is
        the env's native batch. A worker that dies before it answered (e.g. killed a
        moment before the front noticed) costs nothing but time: the block is made on
        another one, each worker tried at most once.

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
    ) -> list[_Worker]:
        """The workers new envs may go to without waiting behind another session's call
        if it can be helped: a worker answers one frame at a time, so a create sent to a
        busy one waits for that call (behind a 5 s step: 5 s). The idle workers (in
        :meth:`least_loaded`'s order, ``tried`` left out); if every one is busy, a new
        worker (up to twice the pool's size; it retires once its envs are closed); at
        that limit, every live worker.

        Raises:
            SessionLostError: no worker is running.
        """
        live = [w for w in self.least_loaded(prefer_ready=prefer_ready) if id(w) not in tried]
        if not live:
            raise SessionLostError("no environment worker process is running")
        idle = [w for w in live if not w.owed]
        if idle:
            return idle
        if (
            self._grace_over_at is None
            and not self._stopped
            and len(self._workers) < self._size + self._overflow
        ):
            worker = self._spawn()
            self._workers.append(worker)
            log.info(
                "every env worker is busy: started worker pid %s for new envs (%d now)",
                worker.process.pid, len(self._workers),
            )  # fmt: skip
            return [worker]
        return live

    def _retire(self, worker: _Worker) -> None:
        """Stop ``worker`` if the pool has more than its size and it holds nothing: the
        extra workers busy ones made (see :meth:`for_new_envs`) go once they are empty."""
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

    def least_loaded(self, *, prefer_ready: bool = False) -> list[_Worker]:
        """The live workers, least loaded (fewest env instances) first (with
        ``prefer_ready``, those up already first).

        Raises:
            SessionLostError: no worker is running.
        """
        live = [worker for worker in self._workers if worker.alive]
        if not live:
            raise SessionLostError("no environment worker process is running")
        return sorted(live, key=lambda w: (prefer_ready and not w.ready, sum(w.envs.values())))

    async def create_block(
        self, worker: _Worker, size: int, autoreset: AutoresetMode, *, kind: int = VECTOR_BLOCK
    ) -> tuple[int, bool]:
        """Create a block of ``size`` envs on ``worker`` (``kind``: what the env process
        makes of it, ``env_process.BLOCK_OPEN``'s last field, passed on as it is); returns
        its env id and whether it is the env's native batch.

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
        except asyncio.CancelledError:
            worker.envs.pop(env_id, None)
            self.close_env(worker, env_id)  # the worker builds it all the same
            raise
        except BaseException:
            worker.envs.pop(env_id, None)
            raise
        if status in (Status.FAILED, Status.REFUSED):
            worker.envs.pop(env_id, None)
            text = answer.decode(errors="replace")
            raise InvalidAction(text) if status == Status.REFUSED else EnvFactoryError(text)
        return env_id, answer == b"native"

    def close_env(self, worker: _Worker, env_id: int) -> asyncio.Task[None]:
        """Close an env in its worker, in a task of its own (a cancelled session must not
        skip it); the task ends quietly if the worker is or becomes dead."""
        task = asyncio.get_running_loop().create_task(self._close_env(worker, env_id))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return task

    async def _close_env(self, worker: _Worker, env_id: int) -> None:
        if await self._close_on_the_side(worker, env_id):
            return
        with contextlib.suppress(SessionLostError):  # it died with its process
            await self.call(worker, env_id, Op.CLOSE)
            self._retire(worker)

    async def close_strictly(self, worker: _Worker, env_id: int) -> None:
        """Close a block for a close command, in its worker, and wait for it.

        Raises:
            CloseFailed: the env's ``close`` raised (it is closed all the same).
            CallTimedOut: the close hung past the step timeout (its worker was stopped).
            SessionLostError: the worker died meanwhile.
        """
        worker.envs.pop(env_id, None)
        status, payload = await self.call(worker, env_id, Op.CLOSE, STRICT_CLOSE)
        self._retire(worker)
        if status == Status.FAILED:
            text, _, kind = payload.decode(errors="replace").partition("\n")
            raise CloseFailed(text, kind)

    async def _close_on_the_side(self, worker: _Worker, env_id: int) -> bool:
        """In a drain, close an env whose worker is busy with another env's call (maybe
        hung: then the worker is killed at the grace's end, and every env queued behind
        that call would be lost unclosed) on the worker's side thread, without waiting
        for that call. True if closed so (or the worker is gone); False: send CLOSE."""
        if not self._draining or not worker.alive or not worker.owed:
            return False
        if worker.owed[0].env_id == env_id:
            return False  # its own call runs: close after it, in order
        # Its requests still queued (their sessions gone) find it closed: answered so.
        loop = asyncio.get_running_loop()
        try:
            async with worker.side_lock:
                await loop.sock_sendall(worker.side, SIDE_CLOSE.pack(env_id))
                answer = b""
                while len(answer) < SIDE_CLOSED.size:
                    chunk = await loop.sock_recv(worker.side, SIDE_CLOSED.size - len(answer))
                    if not chunk:
                        return True  # the worker is gone, and its envs with it
                    answer += chunk
        except OSError:
            return True
        _, closed = SIDE_CLOSED.unpack(answer)
        return bool(closed)

    # -- the end ----------------------------------------------------------------------------

    def start_draining(self, grace: float) -> None:
        """The server drains: once ``grace`` seconds have passed, a call that keeps its
        worker busy for more than a couple of seconds kills that worker (its envs are
        lost and reclaimed), so a hung env call cannot hold the drain past its grace.
        Dead workers are not replaced from then on."""
        loop = asyncio.get_running_loop()
        self._draining = True
        self._drain_timer = loop.call_later(grace, self._end_grace)

    def _end_grace(self) -> None:
        self._grace_over_at = asyncio.get_running_loop().time()
        for worker in self._workers:
            if worker.alive and worker.owed:
                self._arm(worker)

    def stop(self) -> None:
        """Stop every worker, after the sessions closed their envs; returns within about
        ``2 * _STOP_WAIT`` seconds.

        Each worker closes the envs it still holds and exits; one still running after
        ``_STOP_WAIT`` seconds is killed. Then the env's ``reclaim_orphans`` hook gets up to
        ``_STOP_WAIT`` seconds for what killed workers left. Blocks the event loop (the
        server has stopped serving by then).
        """
        if self._stopped:
            return
        self._stopped = True
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        live = [worker for worker in self._workers if worker.alive]
        for worker in live:
            self._disconnect(worker)
            for call in worker.owed:
                if not call.future.done():
                    call.future.set_exception(SessionLostError("the server stopped"))
            worker.owed.clear()
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
    """Read the answer of a call with a charge, offered to it first; returns the status
    and payload to hand over (UNKEPT and no bytes when not admitted; no bytes when nobody
    waits for it any more)."""
    if call.future.done():  # its caller went away: nothing to hold
        await _skip(reader, length)
        return status, b""
    if not charge.admit(status, length):
        await _skip(reader, length)
        return Status.UNKEPT, b""
    try:
        payload = await _read_whole(reader, length)
    except BaseException:
        charge.give(length)
        raise
    if call.future.done():  # gone while its answer came in
        charge.give(length)
        return status, b""
    return status, payload


async def _read_whole(reader: asyncio.StreamReader, length: int) -> bytearray:
    """``length`` bytes in one buffer, read into it a buffer at a time: an answer held
    against the budget is in memory once, not twice as ``readexactly`` makes it.

    Raises:
        asyncio.IncompleteReadError: the worker went away first.
    """
    data = bytearray(length)
    with memoryview(data) as view:
        done = 0
        while done < length:
            chunk = await reader.read(min(length - done, READ_LIMIT))
            if not chunk:
                raise asyncio.IncompleteReadError(b"", length)
            view[done : done + len(chunk)] = chunk
            done += len(chunk)
    return data


async def _skip(reader: asyncio.StreamReader, length: int) -> None:
    """Read ``length`` bytes and drop them, a buffer at a time (never held whole)."""
    while length:
        chunk = min(length, READ_LIMIT)
        await reader.readexactly(chunk)
        length -= chunk


def _put(writer: asyncio.StreamWriter, header: bytes, payload: bytes) -> None:
    if len(payload) < _JOIN_BELOW:
        writer.write(header + payload)
    else:
        writer.write(header)
        writer.write(payload)  # sent as far as the socket takes it; the rest is buffered


#: One env process of the pool (for the vector spread, which places sub-batches on them).
Worker = _Worker
