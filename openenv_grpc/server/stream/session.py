"""The stream lifecycle, for a Session (one env) and a VectorSession (N; what each opens is
``service.py``'s): admission, open, the one stream loop, the idle reaper, the drain.

Every path that ends a stream goes through :meth:`SessionManager.run`'s ``finally``, where
the envs are closed and the slots released exactly once. Every answer is held against the
server's byte budget (``budget.py``) from when it exists until its write is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any, Protocol

import grpc

from openenv_grpc.environment import AutoresetMode, InvalidAction
from openenv_grpc.metadata import ADMITTED_KEY, RETRY_PUSHBACK_KEY, SESSION_ID_KEY
from openenv_grpc.server.config import ServerConfig
from openenv_grpc.server.errors import EnvFactoryError, SessionLostError, describe
from openenv_grpc.server.local.calls import LocalBatchCalls, local_calls
from openenv_grpc.server.local.env_threads import CreateTimeout, Lifecycle
from openenv_grpc.server.model.phases import Words
from openenv_grpc.server.model.placement import CallPlacement
from openenv_grpc.server.model.snapshots import SnapshotSeal
from openenv_grpc.server.model.spec import EnvSpec
from openenv_grpc.server.process.activity import Activity
from openenv_grpc.server.process.budget import ByteBudget
from openenv_grpc.server.process.limiter import Admission, SessionLimiter
from openenv_grpc.server.process.logs import SESSION_ID
from openenv_grpc.server.process.metrics import ORPHANED_STEPS, Metrics, MetricsTee
from openenv_grpc.server.stream.backend import (
    Answer,
    Outcome,
    SessionBackend,
    UndecodableRequest,
)
from openenv_grpc.server.stream.wire import Wire
from openenv_grpc.v1 import session_pb2 as pb

__all__ = ["CLOSE_BUDGET", "Held", "SessionManager", "StreamOpening"]

log = logging.getLogger(__name__)

#: Seconds a drain gives envs to close after the grace; envs stuck then are abandoned.
CLOSE_BUDGET = 2.0

#: An answer is held twice until its write is done: our bytes, and gRPC's copy of them.
_COPIES = 2
#: Answers this small may overdraw a short budget: stalled readers must not stop others.
_SMALL = 64 * 1024
#: Answers this small (most steps, errors) always go out, counted or not: at most
#: capacity x requests in flight x 4 KiB x 2 uncounted (32 MiB at the defaults).
_TINY = 4 * 1024
#: Seconds an answer holding budget bytes may wait for its client: then its stream stalls.
STALLED_AFTER = 5.0
#: Seconds an answer waits for bytes that stalled streams give back before it is refused.
_BUDGET_WAIT = 1.0

#: A refusal first waits this long for the client's first request, else grpc.aio may
#: report the status racing a write as INTERNAL (grpc/grpc#36066); not longer: a burst of
#: 16,384 opens then saw grpc cancel thousands of queued ones.
REFUSAL_WAIT = 0.25
#: Refusals that may wait at once (each holds its call); past it one goes out at once.
MAX_WAITING_REFUSALS = 1024


class _EndReason(enum.Enum):
    """Why the server ended a session itself, and the status the client gets."""

    IDLE = grpc.StatusCode.DEADLINE_EXCEEDED
    DRAIN = grpc.StatusCode.UNAVAILABLE
    STALLED = grpc.StatusCode.RESOURCE_EXHAUSTED


class Held:
    """An admitted stream, from admission to its release: what it holds, and the handle
    the reaper and the drain reach it by."""

    __slots__ = (
        "backend", "context", "deferred", "end_reason", "holding", "noticed",
        "owns_slot", "ready", "reason", "released", "side_write", "slots", "started", "task",
        "unread_since", "waiting_since", "writing",
    )  # fmt: skip

    def __init__(self, task: asyncio.Task[object], context: Wire, slots: int) -> None:
        self.task = task
        self.context = context
        self.slots = slots  # limiter slots: 1, or N for a vector stream
        self.started = time.monotonic()
        self.reason = "error"  # how the session ended, for logs and metrics
        self.backend: SessionBackend | None = None
        self.released = False
        #: False once an env runner took the slots over (it frees them with its envs).
        self.owns_slot = True
        #: Loop time when the session began waiting for its client; None while it works.
        self.waiting_since: float | None = None
        self.end_reason: _EndReason | None = None
        #: Headers are sent and the wire takes notices: one may be written from now on.
        self.ready = False
        #: Writes never overlap: a notice sent during the loop's write waits in
        #: ``deferred`` (the loop sends it next), else goes as ``side_write``, which the
        #: loop's next write awaits first.
        self.writing = False
        self.deferred: bytes | None = None
        self.side_write: asyncio.Task[None] | None = None
        self.noticed = False
        self.holding = 0  # bytes this stream's answers hold against the budget
        #: Loop time when the pending write began; None while none is pending.
        self.unread_since: float | None = None

    def end(self, reason: _EndReason) -> None:
        if self.end_reason is None:
            self.end_reason = reason
            self.task.cancel()

    def notify(self, notice: bytes, tasks: set[asyncio.Task[None]]) -> None:
        """Send ``notice`` once, between the loop's answers; ``tasks`` keeps the write."""
        if self.noticed or not self.ready:
            return
        self.noticed = True
        if self.writing:
            self.deferred = notice
            return
        self.side_write = task = asyncio.create_task(_write_quietly(self.context, notice))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


class StreamOpening(Protocol):
    """What one kind of stream brings to :meth:`SessionManager.run`: the slots (envs) it
    takes, the requests it may have in flight (0: one at a time), its backend (``open``
    sets ``held.owns_slot`` to False when it hands the slots to what frees them itself),
    initial metadata beyond the admitted and session-id keys, and its wire's words for a
    request and for an in-band RESOURCE_EXHAUSTED."""

    slots: int
    in_flight: int
    #: The wire takes the core's notices (a drain's DRAINING answer); the OpenEnv door's
    #: wires do not (a socket learns of a drain by its close frame).
    notices: bool

    async def open(self, held: Held) -> SessionBackend: ...

    def headers(self) -> tuple[tuple[str, str], ...]: ...

    def command_of(self, raw: Any, strict: bool = False) -> tuple[int, str]:
        """Request ``raw``'s id and its command's name. Raises UndecodableRequest when
        ``strict`` and ``raw`` does not parse (else an id of 0, command "request")."""
        ...

    def exhausted(self, request_id: int, message: str) -> bytes:
        """The answer to request ``request_id`` refusing it in-band (RESOURCE_EXHAUSTED)."""
        ...


class SessionManager:
    """Admits, runs and ends every session of one server process."""

    def __init__(
        self,
        spec: EnvSpec,
        config: ServerConfig,
        pool: Executor,
        limiter: SessionLimiter,
        *,
        activity: Activity | None = None,
        prometheus: Metrics | None = None,
        lifecycle: Lifecycle | None = None,
        snapshots: SnapshotSeal | None = None,
        budget: ByteBudget | None = None,
    ) -> None:
        self.snapshots = snapshots  # None: the driver's default seal
        #: The server's one byte budget (``--max-held-bytes``), for all it holds for clients.
        self.budget = budget if budget is not None else ByteBudget(config.max_held_bytes)
        self.spec = spec
        self.config = config
        self.limiter = limiter
        #: Info's counters, always kept; Prometheus too when it is on.
        self.activity = activity if activity is not None else Activity()
        self._metrics: Metrics = (
            self.activity if prometheus is None else MetricsTee(self.activity, prometheus)
        )
        self._pool = pool
        #: Where factories and closes of pooled envs run: never behind hung env calls.
        self._lifecycle = lifecycle
        self._live: set[Held] = set()  # every admitted session, until its release
        self._no_sessions = asyncio.Event()
        self._no_sessions.set()
        self._reaper: asyncio.Task[None] | None = None
        #: While draining: when the grace period ends (loop time, wall-clock time).
        self._drain_deadline: tuple[float, float] | None = None
        self._notices: set[asyncio.Task[None]] = set()
        #: While draining, after the grace: loop time by which envs must have closed.
        self._close_by: float | None = None
        #: Closes a drain stopped waiting for (referenced so they are not collected).
        self._closing: set[asyncio.Future[None]] = set()
        self._call_timeout = config.call_timeout(spec.env_class.step_timeout)
        self.max_response = config.max_message_bytes
        self._stalled_scan_at = 0.0  # loop time before which streams are not scanned again
        self._refusals_waiting = 0

    async def local_calls(
        self,
        size: int,
        autoreset: AutoresetMode,
        placement: CallPlacement | None,
        words: Words,
        *,
        native: bool = True,
        objects: bool = False,
    ) -> LocalBatchCalls:
        """The envs of one admitted stream, built in this process; their runner frees the
        ``size`` slots when they are closed (or could not be made)."""
        limiter = self.limiter
        return await local_calls(
            self.spec, size, autoreset, self._pool, words=words,
            call_timeout=self._call_timeout, placement=placement, native=native, objects=objects,
            lifecycle=self._lifecycle, release=limiter.release,
            reserve=limiter.acquire_for_replacement,
        )  # fmt: skip

    async def run(self, context: Wire, opening: StreamOpening) -> None:
        """Run one stream to its end: admit its slots (or refuse it), make its backend,
        answer its requests, release everything once."""
        slots = opening.slots
        admission = self.limiter.try_acquire(slots)
        if admission is not Admission.ADMITTED:
            for _ in range(slots):  # a vector stream counts as N sessions
                self._metrics.session_refused(admission.value)
            await self._refuse(context, admission, slots)
            return
        session_id = uuid.uuid4().hex[:16]
        SESSION_ID.set(session_id)  # this task's context: every log line below carries it
        ORPHANED_STEPS.set(self._metrics)  # steps done after their answer was given up
        held = Held(asyncio.current_task(), context, slots)  # type: ignore[arg-type]
        self._live.add(held)
        self._no_sessions.clear()
        try:
            try:
                held.backend = await opening.open(held)
            except Exception as exc:
                held.reason = "refused" if isinstance(exc, InvalidAction) else "factory_error"
                await context.abort(*_open_failed(exc))
            await context.send_initial_metadata(
                ((ADMITTED_KEY, self.spec.name), (SESSION_ID_KEY, session_id), *opening.headers())
            )
            log.debug("session opened" if slots == 1 else f"vector session of {slots} opened")
            held.ready = opening.notices
            if self._drain_deadline is not None:
                held.notify(self._drain_notice(), self._notices)
            held.reason = await _StreamLoop(self, held, held.backend, opening).run()
        except asyncio.CancelledError:
            end_reason = held.end_reason
            if end_reason is None:
                held.reason = "cancelled"
                raise  # the client went away or the server is stopping: nobody to tell
            held.reason = end_reason.name.lower()
            log.info("session ended by the server: %s", held.reason)
            # Free the envs first: the status may wait for ever behind unread answers.
            await self._release(held)
            await context.abort(end_reason.value, self._end_message(end_reason))
        finally:
            await self._release(held)

    async def _release(self, held: Held) -> None:
        """Close the session's envs and free their slots, once."""
        if held.released:
            return
        held.released = True
        self._live.discard(held)
        if not self._live:
            self._no_sessions.set()
        closed = held.backend is None or await self._close_within_budget(held)
        if held.owns_slot and closed:  # else its slots go back when the close returns
            self.limiter.release(held.slots)
        elapsed = time.monotonic() - held.started
        for _ in range(held.slots):  # a vector stream counts as N sessions
            self._metrics.session_ended(elapsed, held.reason)
        log.debug("session ended (%s) after %.3fs", held.reason, elapsed)

    async def _close_within_budget(self, held: Held) -> bool:
        """Close the session's backend; once a drain has ended the sessions, wait no longer
        than the rest of :data:`CLOSE_BUDGET` (a hung close goes on unobserved). False if
        given up."""
        assert held.backend is not None
        if self._close_by is None:
            await held.backend.close()
            return True
        closing = asyncio.ensure_future(held.backend.close())
        left = self._close_by - asyncio.get_running_loop().time()
        done, _ = await asyncio.wait((closing,), timeout=max(left, 0.0))
        if done:
            closing.result()
            return True
        self._closing.add(closing)
        slots = held.slots if held.owns_slot else 0

        def closed(task: asyncio.Future[None]) -> None:
            self._closing.discard(task)
            if slots:
                self.limiter.release(slots)
            if not task.cancelled() and task.exception() is not None:
                log.error("closing a session's environment raised", exc_info=task.exception())

        closing.add_done_callback(closed)
        log.error(
            "a session's environment did not close within the drain's %.0fs budget: its "
            "stream ends now, the close goes on unobserved", CLOSE_BUDGET,
        )  # fmt: skip
        return False

    def record(self, answer: Answer) -> None:
        """Count what a request was answered with, in Info's activity and in Prometheus."""
        outcome = answer.outcome
        if outcome is Outcome.STEPPED:
            steps = answer.steps
            if steps == 1:
                self._metrics.step(answer.seconds)
            elif steps:
                self._metrics.env_steps(steps, answer.seconds)
        elif outcome is Outcome.FAILED:
            self._metrics.request_error(answer.error)
        elif outcome is Outcome.SATURATED:
            self._metrics.request_error(answer.error)
            self._metrics.pool_saturated()
        if answer.env_errors:
            for code in answer.env_errors:
                self._metrics.request_error(code)

    async def to_send(
        self, raw: bytes, response: bytes, opening: StreamOpening
    ) -> tuple[bytes, int]:
        """What to write for the answer ``response`` to ``raw``, and the bytes taken from
        the budget for it (given back once the write is done or given up): the answer
        while it fits the message limit and the budget (or is small), else the in-band
        RESOURCE_EXHAUSTED that replaces it (nothing taken)."""
        size = len(response)
        if size > self.max_response:  # gRPC would end the stream; fail this request instead
            return self.too_large(raw, size, opening), 0
        held = size * _COPIES
        budget = self.budget
        if budget.try_take(held):
            return response, held
        self._end_stalled()  # stalled streams give their bytes up now that one needs them
        if size <= _TINY:
            return response, 0
        if size <= _SMALL and budget.try_overdraw(held):
            return response, held
        # Held bytes are on their way back: wait a moment rather than refuse at once. One
        # answer waits at a time: a waiting answer is bytes the budget does not count.
        if not budget.waiting:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(budget.take(held), _BUDGET_WAIT)
                return response, held
        request_id, command = opening.command_of(raw)
        return self._exhausted(
            opening,
            request_id,
            f"the {command} response is {size} bytes and this server holds {budget.used} "
            f"of its {budget.total} bytes (--max-held-bytes) for answers not yet taken by "
            f"their clients: the {command} took effect but its result could not be held; "
            f"retry in {self.config.retry_pushback_ms} ms or elsewhere (the {command} is "
            "not undone); the session goes on",
        ), 0

    def too_large(self, raw: bytes, size: int, opening: StreamOpening) -> bytes:
        """The in-band error that replaces a response over the message limit."""
        request_id, command = opening.command_of(raw)
        hint = "" if opening.slots == 1 else " (name fewer envs per request, by indices)"
        return self._exhausted(
            opening,
            request_id,
            f"the {command} response is {size} bytes, over the server's message limit of "
            f"{self.max_response} bytes (--max-message-bytes): the {command} took effect "
            f"but its result cannot be sent{hint}; the session goes on",
        )

    def over_cap(self, raw: bytes, opening: StreamOpening, in_flight: int) -> bytes:
        """The in-band RESOURCE_EXHAUSTED for a request past the stream's cap on requests
        in flight. Raises UndecodableRequest: ``raw`` does not parse."""
        return self._exhausted(
            opening,
            opening.command_of(raw, strict=True)[0],
            f"{in_flight} requests already in flight on this stream, the most this server "
            f"allows (--max-vector-in-flight, MAX_VECTOR_IN_FLIGHT = {opening.in_flight}): "
            "wait for an answer before sending more; nothing was done, the stream goes on",
        )

    def _exhausted(self, opening: StreamOpening, request_id: int, message: str) -> bytes:
        """An in-band RESOURCE_EXHAUSTED answer to ``request_id``, counted in the metrics."""
        self._metrics.request_error(grpc.StatusCode.RESOURCE_EXHAUSTED.name)
        return opening.exhausted(request_id, message)

    async def _refuse(self, context: Wire, admission: Admission, asked: int) -> None:
        if admission is Admission.DRAINING:
            await self.refuse(
                context,
                grpc.StatusCode.UNAVAILABLE,
                "server is draining: not admitting new sessions",
            )
        limiter = self.limiter
        pushback: tuple[tuple[str, str], ...] = (
            (RETRY_PUSHBACK_KEY, str(self.config.retry_pushback_ms)),
        )
        if asked == 1:
            message = f"server at {limiter.describe()}; retry later or elsewhere"
        elif limiter.capacity and asked > limiter.capacity:
            # Waiting never helps: no pushback, so that a retrying client gives up.
            message = (
                f"{asked} envs asked, more than this server's capacity of {limiter.capacity} "
                f"({limiter.active} in use now): this never fits here; ask for fewer"
            )
            pushback = ()
        else:
            message = (
                f"server at {limiter.describe()}: {asked} envs asked, {limiter.free} free; "
                "retry later or elsewhere"
            )
        await self.refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, message, pushback)

    async def refuse(
        self,
        context: Wire,
        code: grpc.StatusCode,
        message: str,
        trailing_metadata: Sequence[tuple[str, str]] = (),
    ) -> None:
        """End a stream that was not admitted with ``code``, once the client's first
        request came or :data:`REFUSAL_WAIT` is over; always raises (``context.abort``)."""
        # A reset stream has no write in flight: no read (a failed batch) on it.
        if not context.cancelled() and self._refusals_waiting < MAX_WAITING_REFUSALS:
            # A task, not wait_for: cancelling a pending read would cancel the call itself.
            first = asyncio.ensure_future(context.read())
            first.add_done_callback(_ignore)  # it ends with the call; nobody needs it
            self._refusals_waiting += 1
            try:
                await asyncio.wait((first,), timeout=REFUSAL_WAIT)
            finally:
                self._refusals_waiting -= 1
        await context.abort(code, message, trailing_metadata=tuple(trailing_metadata))

    def _end_message(self, reason: _EndReason) -> str:
        if reason is _EndReason.IDLE:
            return f"session idle for more than {self.config.idle_timeout:g}s: environment closed"
        if reason is _EndReason.STALLED:
            return (
                f"the client took none of its answers for more than {STALLED_AFTER:g}s while "
                "other sessions needed the memory they held (--max-held-bytes): session "
                "ended and environment closed"
            )
        return "server is draining: session ended and environment closed"

    def _end_stalled(self) -> None:
        """End every stream whose answers hold budget bytes and have waited for their
        client longer than :data:`STALLED_AFTER`; their bytes come back as they unwind."""
        now = asyncio.get_running_loop().time()
        if now < self._stalled_scan_at:  # one scan of every stream per quarter second
            return
        self._stalled_scan_at = now + 0.25
        cutoff = now - STALLED_AFTER
        for held in self._live:
            since = held.unread_since
            if held.holding and since is not None and since < cutoff and held.end_reason is None:
                log.warning(
                    "ending a session whose client took no answer for %.0fs: %d bytes held",
                    STALLED_AFTER, held.holding,
                )  # fmt: skip
                held.end(_EndReason.STALLED)

    def start(self) -> None:
        """Start the idle reaper (if an idle timeout is set). Call on the server's loop."""
        if self.config.idle_timeout > 0 and self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_idle(), name="openenv-idle-reaper")

    async def _reap_idle(self) -> None:
        timeout = self.config.idle_timeout
        # A sweep every quarter timeout ends an idle session within 1.25x the timeout.
        interval = min(max(timeout / 4, 0.05), 5.0)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            cutoff = loop.time() - timeout
            for held in list(self._live):
                since = held.waiting_since
                if since is not None and since < cutoff:
                    held.end(_EndReason.IDLE)

    async def drain(self, grace: float) -> int:
        """Admit nothing more, notify every session it has ``grace`` seconds, end those
        still open then, and give their envs :data:`CLOSE_BUDGET` seconds to close.
        Returns the number of envs left unclosed (stuck in env code; abandoned)."""
        self.limiter.start_draining()
        loop = asyncio.get_running_loop()
        self._drain_deadline = (loop.time() + grace, time.time() + grace)
        if self._live:
            notice = self._drain_notice()
            for held in list(self._live):
                held.notify(notice, self._notices)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._no_sessions.wait(), grace)
        self._close_by = loop.time() + CLOSE_BUDGET
        for held in list(self._live):
            held.end(_EndReason.DRAIN)
        stuck = 0
        try:
            await asyncio.wait_for(self.limiter.wait_idle(), CLOSE_BUDGET)
        except asyncio.TimeoutError:
            stuck = self.limiter.active
        if stuck:  # (the last close may return as the budget ends)
            log.error(
                "%d environment(s) still in a call or in close() %.0fs after the sessions "
                "ended: abandoned without close (env code that never returns)",
                stuck, CLOSE_BUDGET,
            )  # fmt: skip
        for task in list(self._notices):
            task.cancel()
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        return stuck

    def _drain_notice(self) -> bytes:
        """The DRAINING notice, with the time left until the grace period ends."""
        assert self._drain_deadline is not None
        at, wall = self._drain_deadline
        left = max(0.0, at - asyncio.get_running_loop().time())
        response = pb.SessionResponse(request_id=0)
        notice = response.notice
        notice.kind = pb.NOTICE_KIND_DRAINING
        notice.seconds_left = left
        notice.deadline.FromNanoseconds(int(wall * 1e9))
        notice.message = (
            f"server is draining: this session ends in {left:.1f}s (UNAVAILABLE) and its "
            "environment is closed; finish the episode or move to another server"
        )
        return response.SerializeToString()


class _StreamLoop:
    """The one loop of every stream: read a request, answer it, write the answer.

    Up to ``opening.in_flight`` requests are in flight (read, not yet written): a Session
    answers each before it reads the next; a VectorSession's reader hands each to a task
    and answers go out as they are ready. Past the cap, or while its answers make the
    budget short, the stream stops reading (backpressure), or answers RESOURCE_EXHAUSTED
    while all are in the env. After a half-close the requests in flight are answered
    first; an answer that ends the stream goes last.
    """

    __slots__ = (
        "_answering", "_backend", "_budget", "_cap", "_context", "_ended", "_largest",
        "_lock", "_loop", "_manager", "_opening", "_taken", "_tasks", "_working", "_write",
        "live",
    )  # fmt: skip

    def __init__(
        self, manager: SessionManager, live: Held, backend: SessionBackend, opening: StreamOpening
    ) -> None:
        self._manager = manager
        self._context = live.context
        self._backend = backend
        self.live = live
        self._opening = opening
        self._loop = asyncio.get_running_loop()
        #: How the stream ends, set once: ("eof",), ("ends", answer bytes), ("abort",
        #: code, message) or ("raise", exception).
        self._ended: asyncio.Future[tuple[object, ...]] = self._loop.create_future()
        self._cap = max(opening.in_flight, 1)
        self._lock = asyncio.Lock() if self._cap > 1 else None  # one write at a time
        self._write = self._write_now if self._lock is None else self._write_locked
        self._tasks: set[asyncio.Task[None]] = set()
        self._answering = 0  # requests read and not yet written (the cap)
        self._working = 0  # requests inside the backend (not idle while any is)
        self._budget = manager.budget
        self._largest = 0  # the most one answer has held: what the next may need
        #: Set when an answer leaves (written or given up): the reader may read again.
        self._taken: asyncio.Future[None] | None = None

    async def run(self) -> str:
        """Answer requests until the stream ends; returns how it ended."""
        self.live.waiting_since = self._loop.time()
        # One request in flight: the reader is this task (the reaper and the drain cancel
        # it); several: a task of its own, so that answers are written as they come.
        reader = None if self._lock is None else self._loop.create_task(self._read_all())
        try:
            if reader is None:
                await self._read_all()
            end = await self._ended
            if reader is not None:
                reader.cancel()
            kind = end[0]
            if kind == "abort":
                self._cancel_all()
                await self._context.abort(end[1], end[2])  # type: ignore[arg-type]
            if kind == "raise":
                self._cancel_all()
                raise end[1]  # type: ignore[misc]
            if self._tasks:  # a half-close or an ending answer: the others first
                await asyncio.wait(list(self._tasks))
            if kind == "eof":
                return "client_ended"
            await self._write(end[1])  # type: ignore[arg-type]
            return "closed"
        finally:
            if reader is not None:
                reader.cancel()
            self._cancel_all()

    def _cancel_all(self) -> None:
        for task in list(self._tasks):
            if task is not asyncio.current_task():
                task.cancel()

    def _end(self, *how: object) -> None:
        if not self._ended.done():
            self._ended.set_result(how)

    def _full(self) -> bool:
        """Answers wait for the client, and the stream may hold no more of them: the cap
        is reached, or its own answers made the budget short."""
        return self._answering > self._working and (
            self._answering >= self._cap
            or (self.live.holding > 0 and not self._budget.fits(self._largest))
        )

    async def _until_taken(self) -> None:
        if self._taken is None:
            self._taken = self._loop.create_future()
        await self._taken

    async def _read_all(self) -> None:
        read, live, cap, ended = self._context.read, self.live, self._cap, self._ended
        inline = self._lock is None
        try:
            while not ended.done():
                while not inline and self._full():  # the request stays in gRPC's window
                    await self._until_taken()
                raw: object = await read()
                if raw is grpc.aio.EOF:  # a half-close or a cancel
                    self._end("eof")
                    return
                while not inline and self._full():  # answers left the env meanwhile
                    await self._until_taken()
                if self._answering >= cap:  # every request in flight is in the env
                    try:
                        refusal = self._manager.over_cap(raw, self._opening, self._answering)  # type: ignore[arg-type]
                    except UndecodableRequest as exc:
                        self._end("abort", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                        return
                    await self._write(refusal)
                    continue
                live.waiting_since = None
                self._answering += 1
                self._working += 1
                if inline:
                    await self._answer(raw)  # type: ignore[arg-type]
                    continue
                task = self._loop.create_task(self._answer(raw))  # type: ignore[arg-type]
                self._tasks.add(task)
                task.add_done_callback(self._finished)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._end("raise", exc)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._end("raise", task.exception())

    async def _answer(self, raw: bytes) -> None:
        """Answer one request and write the answer; it counts against the cap until it
        is written."""
        manager, live = self._manager, self.live
        try:
            try:
                answer = await self._backend.handle(raw)
            except UndecodableRequest as exc:  # no request id to answer to: out of sync
                self._end("abort", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                return
            except SessionLostError as exc:
                self._end("abort", grpc.StatusCode.UNAVAILABLE, f"session lost: {exc}")
                return
            finally:
                self._working -= 1
                if not self._working:  # idle from here: waiting for the client
                    live.waiting_since = self._loop.time()
            manager.record(answer)
            response = answer.response
            size = len(response)
            if answer.ends:  # written last, by run(); small (a close's answer, an error)
                if size > manager.max_response:
                    response = manager.too_large(raw, size, self._opening)
                self._end("ends", response)
                return
            held = size * _COPIES
            if size > manager.max_response or not self._budget.try_take(held):
                response, held = await manager.to_send(raw, response, self._opening)
            del answer  # the bytes to send are ``response`` now
            live.holding += held
            if held > self._largest:
                self._largest = held
            try:
                await self._write(response)
            finally:
                live.holding -= held
                self._budget.give(held)
        finally:
            self._answering -= 1
            taken = self._taken
            if taken is not None:
                self._taken = None
                if not taken.done():
                    taken.set_result(None)

    async def _write_locked(self, response: bytes) -> None:
        assert self._lock is not None
        async with self._lock:
            await self._write_now(response)

    async def _write_now(self, response: bytes) -> None:
        """Write one answer, never overlapping a drain notice."""
        live, write = self.live, self._context.write
        if live.side_write is not None:
            await live.side_write
            live.side_write = None
        live.writing = True
        # Any write: a client that takes none holds every answer queued behind it.
        live.unread_since = self._loop.time()
        try:
            await write(response)
        except Exception as exc:
            # grpc-core fails a write only once the call is over (the client went away):
            # end as on a cancel, without a traceback a client could fill the log with.
            log.debug("write failed, the call is over: %r", exc)
            self._end("eof")
            return
        finally:
            live.writing = False
            live.unread_since = None
        if live.deferred is not None:  # a notice arrived during our write
            notice, live.deferred = live.deferred, None
            live.writing = True
            try:
                await write(notice)
            except Exception as exc:  # as above: the call is over
                log.debug("write failed, the call is over: %r", exc)
                self._end("eof")
            finally:
                live.writing = False


def _open_failed(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status of a stream whose envs could not be made."""
    if isinstance(exc, InvalidAction):  # e.g. make_batch refused this size
        return grpc.StatusCode.INVALID_ARGUMENT, f"the environment refused the open: {exc}"
    if isinstance(exc, CreateTimeout):  # the factory ran past --lifecycle-timeout
        return grpc.StatusCode.DEADLINE_EXCEEDED, f"could not create the environment: {exc}"
    if isinstance(exc, SessionLostError):  # an env process died while making the envs
        return (
            grpc.StatusCode.UNAVAILABLE,
            f"could not create the environment: {exc}; nothing was made, open again",
        )
    log.exception("environment factory raised")
    # A worker process reports the factory's exception as text already.
    detail = str(exc) if isinstance(exc, EnvFactoryError) else describe(exc)
    return grpc.StatusCode.INTERNAL, f"could not create the environment: {detail}"


async def _write_quietly(context: Wire, message: bytes) -> None:
    """Write ``message`` on a stream that may end meanwhile (then it is simply not sent)."""
    with contextlib.suppress(Exception):
        await context.write(message)


def _ignore(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()
