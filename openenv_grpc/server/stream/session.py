"""The stream lifecycle: from admission to close, for a Session stream (one environment
instance) and for a VectorSession stream (N of them); what each opens is ``service.py``'s.

Every path that ends a stream goes through :meth:`SessionManager.run`'s ``finally``:
the client closes or cancels, its process dies, keepalive drops the connection, the idle
reaper or a drain cancels the session. There the env is closed exactly once and the slot
released exactly once (for in-process envs the slot goes with the env: see ``runner.py``).
A vector stream is N sessions to everything here: N slots taken at once, all or nothing,
and given back together; the idle reaper and the drain end it like any session.

Every answer is held against the server's one byte budget (``budget.py``) from when it
exists until its write is done; what a stream does when the budget is short is
:class:`_StreamLoop`'s.

A drain tells every held session at once with a notice (request_id 0), ends them when
the grace period is over, and gives their envs a short budget to close; an env stuck in
a call after that is abandoned, so the process exits on time whatever env code does.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError, Message

from openenv_grpc.environment import AutoresetMode, InvalidAction
from openenv_grpc.metadata import ADMITTED_KEY, RETRY_PUSHBACK_KEY, SESSION_ID_KEY
from openenv_grpc.server.config import ServerConfig
from openenv_grpc.server.errors import EnvFactoryError, SessionLostError, describe
from openenv_grpc.server.local.calls import LocalBatchCalls, local_calls
from openenv_grpc.server.local.runner import CreateTimeout
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
    exhausted,
    parse_request,
)
from openenv_grpc.server.stream.wire import Wire
from openenv_grpc.v1 import session_pb2 as pb

__all__ = ["CLOSE_BUDGET", "Held", "SessionManager", "StreamOpening"]

log = logging.getLogger(__name__)

#: A stream's transport: gRPC's context, or a local stream's (``wire.py``). Requests
#: arrive as raw bytes; the loop parses them (see service.add_env_service).
_Context = Wire

#: Seconds a drain gives envs to close once the grace period is over (or every session has
#: ended). Closing takes milliseconds; what is still closing after this is stuck in env
#: code (a hung call, a hung close) and is abandoned so the process can exit.
CLOSE_BUDGET = 2.0

#: An answer is held twice until its write is done: our bytes, and gRPC's copy of them.
_COPIES = 2
#: Answers this small go out even when the budget is short, drawn from its reserve (half
#: the budget again, ``ByteBudget.try_overdraw``): stalled readers must not stop every
#: neighbour's steps, and the reserve keeps even many small answers bounded.
_SMALL = 64 * 1024
#: Answers this small (a step of most envs, an error) always go out, counted or not:
#: at most capacity x requests in flight x 4 KiB x 2 uncounted (32 MiB at the defaults),
#: and stalled streams cannot stop a neighbour's ordinary steps even for a moment.
_TINY = 4 * 1024
#: Seconds an answer holding budget bytes may wait for its client to start taking it
#: before the stream counts as stalled. A stalled stream is ended only when another
#: stream's answer needs the bytes it holds: without that, a few clients that never read
#: could keep the budget full until the idle timeout and refuse every neighbour's large
#: answers. 16 MiB take well under a second on any link a trainer uses.
STALLED_AFTER = 5.0
#: Seconds an answer waits for bytes that stalled streams give back before it is refused.
_BUDGET_WAIT = 1.0

#: A refusal first waits this long for the client's first request (or its half-close),
#: so that its status does not race a write: grpc.aio reports such a write as INTERNAL
#: "Internal error from Core" instead of our status (grpc/grpc#36066, fix proposed in
#: #43486). Clients that wait for the headers before writing (ours, grpc-js, grpc-go)
#: write nothing, so they get their refusal this much later. Longer waits (up to 5 s, as
#: a 4,000-open burst's writes can lag on a loaded machine) made a 16,384-open burst see
#: grpc cancel thousands of opens still queued, so the wait stays short.
REFUSAL_WAIT = 0.25
#: Refusals that may wait at once; past it a refusal goes out at once. Each holds its call
#: (~20 KiB) and what of its first request has arrived (at most the request limit, as for
#: an admitted stream) for at most REFUSAL_WAIT seconds.
MAX_WAITING_REFUSALS = 1024


class _EndReason(enum.Enum):
    """Why the server ended a session itself, and the status the client gets."""

    IDLE = grpc.StatusCode.DEADLINE_EXCEEDED
    DRAIN = grpc.StatusCode.UNAVAILABLE
    STALLED = grpc.StatusCode.RESOURCE_EXHAUSTED


class _LiveSession:
    """The handle the reaper and the drain use to reach a session from outside."""

    __slots__ = (
        "context", "deferred", "end_reason", "heard", "holding", "noticed", "ready",
        "side_write", "task", "unread_since", "waiting_since", "writing",
    )  # fmt: skip

    def __init__(self, task: asyncio.Task[object], context: _Context) -> None:
        self.task = task
        self.context = context
        #: Loop time when the session began waiting for its client; None while it works.
        self.waiting_since: float | None = None
        #: The wire's own clock of its client, if it has one (see ``Wire``).
        self.heard: Callable[[], float] | None = getattr(context, "heard", None)
        self.end_reason: _EndReason | None = None
        #: Headers are sent (the env exists): a notice may be written from now on.
        self.ready = False
        #: Writes on a stream must never overlap. The session loop sets ``writing`` around
        #: its own writes; a notice written from outside meanwhile waits in ``deferred``
        #: (the loop sends it next), otherwise it is written at once as ``side_write``,
        #: which the loop's next write awaits first.
        self.writing = False
        self.deferred: bytes | None = None
        self.side_write: asyncio.Task[None] | None = None
        self.noticed = False
        #: Bytes this stream's answers hold against the byte budget now.
        self.holding = 0
        #: Loop time when the pending write began; None while none is pending (a client
        #: that reads takes an answer at once).
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


class Held:
    """What an admitted stream holds until :meth:`SessionManager._release`."""

    __slots__ = ("backend", "live", "owns_slot", "reason", "released", "slots", "started")

    def __init__(self, live: _LiveSession, slots: int) -> None:
        self.started = time.monotonic()
        self.reason = "error"  # how the session ended, for logs and metrics
        self.backend: SessionBackend | None = None
        self.live = live
        self.released = False
        #: Limiter slots the stream was admitted with: 1, or N for a vector stream.
        self.slots = slots
        #: The session frees its limiter slots itself; False once an in-process env runner
        #: took them over (it frees them when its env is closed, maybe after the session).
        self.owns_slot = True


class StreamOpening(Protocol):
    """What one kind of stream brings to :meth:`SessionManager.run`: how many slots it
    takes, its message types, and how its backend is made once it is admitted."""

    @property
    def slots(self) -> int:
        """Limiter slots (= env instances) the stream takes, all or nothing."""
        ...

    @property
    def request_class(self) -> type[Message]:
        """The stream's request message (read back for the oversize answer)."""
        ...

    @property
    def in_flight(self) -> int:
        """Requests the stream may have in flight at once; 0: one at a time, in order
        (a Session: the next request is read once the last one is answered)."""
        ...

    @property
    def response_class(self) -> type[Message]:
        """The stream's response message."""
        ...

    async def open(self, held: Held) -> SessionBackend:
        """Make the stream's backend (its envs). Set ``held.owns_slot`` to False before
        handing the slots to something that frees them itself.

        Raises:
            Exception: the env factory's (or the env process's) failure.
        """
        ...

    def headers(self) -> tuple[tuple[str, str], ...]:
        """Initial metadata beyond the admitted and session-id keys, sent once open."""
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
        lifecycle: Executor | None = None,
        snapshots: SnapshotSeal | None = None,
        budget: ByteBudget | None = None,
    ) -> None:
        #: Seals and opens this server's snapshots (None: the driver's default).
        self.snapshots = snapshots
        #: The server's one byte budget (``--max-held-bytes``): every answer is held
        #: against it from when it exists until its write completes, and so is whatever
        #: else holds bytes for clients (isolated frames, the OpenEnv wire).
        self.budget = budget if budget is not None else ByteBudget(config.max_held_bytes)
        self.spec = spec
        self.config = config
        self.limiter = limiter
        #: Counters for the Info RPC, always kept; Prometheus too when it is on. Both are
        #: fed from what each request was answered with (:meth:`_record`).
        self.activity = activity if activity is not None else Activity()
        self._metrics: Metrics = (
            self.activity if prometheus is None else MetricsTee(self.activity, prometheus)
        )
        self._pool = pool
        #: Where factories and closes of pooled envs run: never behind hung env calls.
        self._lifecycle = lifecycle if lifecycle is not None else pool
        #: Every admitted session, from admission (before its env exists) to its release.
        self._live: set[_LiveSession] = set()
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
        #: Longest an env call may take; the server's setting wins over the env's own.
        self._call_timeout = config.call_timeout(spec.env_class.step_timeout)
        self.max_response = config.max_message_bytes
        #: Loop time before which :meth:`_end_stalled` does not scan the streams again.
        self._stalled_scan_at = 0.0
        #: Refusals waiting for their client's first request (``MAX_WAITING_REFUSALS``).
        self._refusals_waiting = 0

    @property
    def call_timeout(self) -> float | None:
        """Longest an env call may take (None: no limit); the server's setting wins."""
        return self._call_timeout

    @property
    def pool(self) -> Executor:
        """The shared thread pool that blocking env calls run on."""
        return self._pool

    @property
    def lifecycle(self) -> Executor:
        """The threads that build and close pooled envs."""
        return self._lifecycle

    async def local_calls(
        self,
        size: int,
        autoreset: AutoresetMode,
        placement: CallPlacement | None,
        words: Words,
        *,
        native: bool = True,
    ) -> LocalBatchCalls:
        """The envs of one admitted stream, built in this process (``calls.local_calls``).
        Their runner frees the ``size`` slots when they are closed (or could not be made);
        a hung batch's replacement takes slots of its own (NoSlot: the hung one still
        holds them, the cap is on envs).

        Raises:
            Exception: what building the envs raised.
        """
        limiter = self.limiter
        return await local_calls(
            self.spec, size, autoreset, self._pool, words=words,
            call_timeout=self._call_timeout, placement=placement, native=native,
            lifecycle=self._lifecycle, release=limiter.release,
            reserve=limiter.acquire_for_replacement,
        )  # fmt: skip

    async def run(self, context: _Context, opening: StreamOpening) -> None:
        """Run one stream of any kind, given its RPC context, to its end: admit its slots
        (or refuse it), make its backend, answer its requests, release everything once."""
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
        live = _LiveSession(asyncio.current_task(), context)  # type: ignore[arg-type]
        held = Held(live, slots)
        self._live.add(live)
        self._no_sessions.clear()
        try:
            try:
                held.backend = await opening.open(held)
            except InvalidAction as exc:  # e.g. make_batch refused this size
                held.reason = "refused"
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"the environment refused the open: {exc}"
                )
            except CreateTimeout as exc:  # the factory ran past --lifecycle-timeout
                held.reason = "factory_error"
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"could not create the environment: {exc}"
                )
            except SessionLostError as exc:  # an env process died while making the env(s)
                held.reason = "factory_error"
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"could not create the environment: {exc}; nothing was made, open again",
                )
            except Exception as exc:
                held.reason = "factory_error"
                log.exception("environment factory raised")
                # A worker process reports the factory's exception as text already.
                detail = str(exc) if isinstance(exc, EnvFactoryError) else describe(exc)
                await context.abort(
                    grpc.StatusCode.INTERNAL, f"could not create the environment: {detail}"
                )
            # Headers now tell the client it was admitted and its env exists.
            await context.send_initial_metadata(
                ((ADMITTED_KEY, self.spec.name), (SESSION_ID_KEY, session_id), *opening.headers())
            )
            log.debug("session opened" if slots == 1 else f"vector session of {slots} opened")
            live.ready = True
            if self._drain_deadline is not None:
                live.notify(self._drain_notice(), self._notices)
            held.reason = await _StreamLoop(self, context, held.backend, live, opening).run()
        except asyncio.CancelledError:
            end_reason = live.end_reason
            if end_reason is None:
                held.reason = "cancelled"
                raise  # the client went away or the server is stopping: nobody to tell
            held.reason = end_reason.name.lower()
            log.info("session ended by the server: %s", held.reason)
            # Free the env and the slot first: the status may wait for ever behind answers
            # a client that stopped reading never takes.
            await self._release(held)
            await context.abort(end_reason.value, self._end_message(end_reason))
        finally:
            await self._release(held)

    async def _release(self, held: Held) -> None:
        """Close the session's envs and free their slots, once."""
        if held.released:
            return
        held.released = True
        self._live.discard(held.live)
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
        than the rest of :data:`CLOSE_BUDGET`, so that the stream's status is sent and its
        handler ends in time (a close that hangs goes on unobserved). False if given up."""
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
        the budget for it (give them back once the write is done, or given up): the answer
        itself while it fits the message limit and the budget (or is small: see
        :data:`_SMALL`), else the small in-band RESOURCE_EXHAUSTED that replaces it
        (nothing taken)."""
        size = len(response)
        if size > self.max_response:
            # gRPC would end the stream; fail this request instead.
            return self.too_large(raw, size, opening), 0
        held = size * _COPIES
        budget = self.budget
        if budget.try_take(held):
            return response, held
        # Stalled streams give their bytes up now that an answer needs them.
        self._end_stalled()
        if size <= _TINY:
            return response, 0
        if size <= _SMALL and budget.try_overdraw(held):
            # A budget full of stalled readers' answers must not stop every neighbour's
            # steps: a small answer is held in the budget's reserve.
            return response, held
        # Held bytes are on their way back (answers being written, stalled streams
        # ended here unwinding): wait for them a moment rather than refuse at once. One
        # answer waits at a time: a waiting answer is bytes the budget does not count.
        if not budget.waiting:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(budget.take(held), _BUDGET_WAIT)
                return response, held
        return self._unheld(raw, size, opening), 0

    def too_large(self, raw: bytes, size: int, opening: StreamOpening) -> bytes:
        """The in-band error that replaces a response over the message limit."""
        request, command = _command(raw, opening)
        hint = "" if opening.slots == 1 else " (name fewer envs per request, by indices)"
        return self._exhausted(
            opening,
            request,
            f"the {command} response is {size} bytes, over the server's message limit of "
            f"{self.max_response} bytes (--max-message-bytes): the {command} took effect "
            f"but its result cannot be sent{hint}; the session goes on",
        )

    def _unheld(self, raw: bytes, size: int, opening: StreamOpening) -> bytes:
        """The in-band error that replaces an answer the byte budget cannot hold now."""
        request, command = _command(raw, opening)
        budget = self.budget
        return self._exhausted(
            opening,
            request,
            f"the {command} response is {size} bytes and this server holds {budget.used} "
            f"of its {budget.total} bytes (--max-held-bytes) for answers not yet taken by "
            f"their clients: the {command} took effect but its result could not be held; "
            f"retry in {self.config.retry_pushback_ms} ms or elsewhere (the {command} is "
            "not undone); the session goes on",
        )

    def over_cap(self, raw: bytes, opening: StreamOpening, in_flight: int) -> bytes:
        """The in-band RESOURCE_EXHAUSTED for a request past the stream's cap on requests
        in flight.

        Raises:
            UndecodableRequest: ``raw`` does not parse (no id to answer to).
        """
        return self._exhausted(
            opening,
            parse_request(raw, opening.request_class),
            f"{in_flight} requests already in flight on this stream, the most this server "
            f"allows (--max-vector-in-flight, MAX_VECTOR_IN_FLIGHT = {opening.in_flight}): "
            "wait for an answer before sending more; nothing was done, the stream goes on",
        )

    def _exhausted(self, opening: StreamOpening, request: Message, message: str) -> bytes:
        """An in-band RESOURCE_EXHAUSTED answer to ``request``, counted in the metrics."""
        self._metrics.request_error(grpc.StatusCode.RESOURCE_EXHAUSTED.name)
        # Set, not passed: Message's stubs take no field keywords.
        response = opening.response_class()
        response.request_id = request.request_id  # type: ignore[attr-defined]
        return exhausted(response, message)

    async def _refuse(self, context: _Context, admission: Admission, asked: int) -> None:
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
        context: _Context,
        code: grpc.StatusCode,
        message: str,
        trailing_metadata: Sequence[tuple[str, str]] = (),
    ) -> None:
        """End a stream that was not admitted with ``code``, once the client's first
        request came or :data:`REFUSAL_WAIT` is over (see there why).

        Raises:
            grpc.aio.AbortError: always (what ``context.abort`` raises to end the handler).
        """
        # A reset stream has no write in flight: no read (a failed batch) on it.
        if not context.cancelled() and self._refusals_waiting < MAX_WAITING_REFUSALS:
            # A task, not wait_for: cancelling a pending read would cancel the call itself.
            first = asyncio.ensure_future(context.read())
            # It ends (EOF) once the status is out, or with the call; nobody needs its outcome.
            first.add_done_callback(_ignore)
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

    def _end_stalled(self) -> bool:
        """End every stream whose answers hold budget bytes and have waited for their
        client longer than :data:`STALLED_AFTER`; returns whether any was ended. Their
        bytes come back as their tasks unwind."""
        now = asyncio.get_running_loop().time()
        if now < self._stalled_scan_at:  # one scan of every stream per quarter second
            return False
        self._stalled_scan_at = now + 0.25
        cutoff = now - STALLED_AFTER
        ended = False
        for live in self._live:
            since = live.unread_since
            if live.holding and since is not None and since < cutoff and live.end_reason is None:
                log.warning(
                    "ending a session whose client took no answer for %.0fs: %d bytes held",
                    STALLED_AFTER, live.holding,
                )  # fmt: skip
                live.end(_EndReason.STALLED)
                ended = True
        return ended

    # -- reclaiming sessions ---------------------------------------------------------

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
            for live in list(self._live):
                since, heard = live.waiting_since, live.heard
                if since is not None and since < cutoff and (heard is None or heard() < cutoff):
                    live.end(_EndReason.IDLE)

    async def drain(self, grace: float) -> int:
        """Admit nothing more, tell every session it has ``grace`` seconds (a notice), end
        those still open when the grace is over, and give their envs :data:`CLOSE_BUDGET`
        seconds to close.

        Returns the number of envs left unclosed: stuck in a call or in ``close`` (their
        threads cannot be stopped; the caller exits without them).
        """
        self.limiter.start_draining()
        loop = asyncio.get_running_loop()
        self._drain_deadline = (loop.time() + grace, time.time() + grace)
        if self._live:
            notice = self._drain_notice()
            for live in list(self._live):
                live.notify(notice, self._notices)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._no_sessions.wait(), grace)
        # From here, a session's envs get what is left of the budget to close.
        self._close_by = loop.time() + CLOSE_BUDGET
        for live in list(self._live):
            live.end(_EndReason.DRAIN)
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
    """The one loop of every stream, whatever its kind or wire: read a request, answer
    it, write the answer (its request id on it), until the stream ends.

    A stream may have up to ``opening.in_flight`` requests in flight: read, and not
    answered or not yet written (an answer waiting for a client that does not read still
    counts). A Session has one: the reader answers each request itself before it reads
    the next. A VectorSession's reader hands each request to a task of its own; answers
    go out as each is ready, one write at a time. Past the cap, while answers wait for
    the client the stream reads nothing more until one is taken (backpressure); while all
    of them are in the env, a request is answered RESOURCE_EXHAUSTED at once and the
    stream goes on. Every answer is held against the server's byte budget until it is
    written; when its own answers make the budget short, the stream stops reading too,
    and an answer the budget cannot hold at all is replaced by an in-band
    RESOURCE_EXHAUSTED. Which envs each request may touch is the driver's business
    (``Driver.hold``). The stream is idle (for the reaper) while it waits for its client:
    for a request, or to take an answer. After a half-close the requests in flight are
    answered before the stream ends; a close's answer (or any answer that ends the
    stream) is written last, after the others.
    """

    __slots__ = (
        "_answering", "_backend", "_budget", "_cap", "_context", "_ended", "_held",
        "_largest", "_lock", "_loop", "_manager", "_opening", "_taken", "_tasks", "_working",
        "_write", "live",
    )  # fmt: skip

    def __init__(
        self,
        manager: SessionManager,
        context: _Context,
        backend: SessionBackend,
        live: _LiveSession,
        opening: StreamOpening,
    ) -> None:
        self._manager = manager
        self._context = context
        self._backend = backend
        self.live = live
        self._opening = opening
        self._loop = asyncio.get_running_loop()
        #: How the stream ends, set once: ("eof",), ("ends", answer bytes), ("abort",
        #: code, message) or ("raise", exception).
        self._ended: asyncio.Future[tuple[object, ...]] = self._loop.create_future()
        self._cap = max(opening.in_flight, 1)
        #: Writes of several answer tasks never overlap (one request in flight: one writer).
        self._lock = asyncio.Lock() if self._cap > 1 else None
        #: How an answer is written: at once, or after the other tasks' writes.
        self._write = self._write_now if self._lock is None else self._write_locked
        self._tasks: set[asyncio.Task[None]] = set()
        #: Requests read and not answered, or answered and not yet written (the cap).
        self._answering = 0
        #: Requests inside the backend (the stream is not idle while any is).
        self._working = 0
        self._budget = manager.budget
        #: Bytes this stream's answers hold against the budget until they are written.
        self._held = 0
        #: The most one answer of this stream has held: what the next one may need.
        self._largest = 0
        #: Set when an answer leaves (written or given up): the reader may read again.
        self._taken: asyncio.Future[None] | None = None

    async def run(self) -> str:
        """Answer requests until the stream ends; returns how it ended."""
        live = self.live
        live.waiting_since = self._loop.time()
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
            # A half-close or an ending answer: the other requests in flight first.
            if self._tasks:
                await asyncio.wait(list(self._tasks))
            if kind == "eof":
                return "client_ended"
            await self._write(end[1])  # type: ignore[arg-type]
            return "closed"  # nothing may follow the answer to a close
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
        """Answers of this stream wait for its client, and it may hold no more of them:
        the cap is reached, or its own answers made the budget short."""
        return self._answering > self._working and (
            self._answering >= self._cap
            or (self._held > 0 and not self._budget.fits(self._largest))
        )

    async def _until_taken(self) -> None:
        """Wait until an answer of this stream leaves (its write is done)."""
        if self._taken is None:
            self._taken = self._loop.create_future()
        await self._taken

    async def _read_all(self) -> None:
        read, live, cap, ended = self._context.read, self.live, self._cap, self._ended
        inline = self._lock is None
        try:
            while not ended.done():
                # Backpressure (a Session's one answer is written before it reads again).
                while not inline and self._full():  # the request stays in gRPC's window
                    await self._until_taken()
                raw: object = await read()
                if raw is grpc.aio.EOF:
                    # The client half-closed or cancelled: gRPC shows both as the end.
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
        is written (an answer the client never takes counts)."""
        manager, live = self._manager, self.live
        try:
            try:
                answer = await self._backend.handle(raw)
            except UndecodableRequest as exc:
                # No request id to answer to: the stream is out of sync, so end it.
                self._end("abort", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                return
            except SessionLostError as exc:
                self._end("abort", grpc.StatusCode.UNAVAILABLE, f"session lost: {exc}")
                return
            finally:
                self._working -= 1
                if not self._working:
                    # Idle from here: waiting for the client, to take this answer or to ask.
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
            live.holding = self._held = self._held + held
            if held > self._largest:
                self._largest = held
            try:
                await self._write(response)
            finally:
                live.holding = self._held = self._held - held
                self._budget.give(held)
        finally:
            self._answering -= 1
            taken = self._taken
            if taken is not None:
                self._taken = None
                if not taken.done():
                    taken.set_result(None)

    async def _write_locked(self, response: bytes) -> None:
        """:meth:`_write_now` for a stream of several answer tasks: one write at a time."""
        assert self._lock is not None
        async with self._lock:
            await self._write_now(response)

    async def _write_now(self, response: bytes) -> None:
        """Write one answer, never overlapping a drain notice."""
        live, write = self.live, self._context.write
        if live.side_write is not None:  # a notice is on its way: never overlap it
            await live.side_write
            live.side_write = None
        live.writing = True
        # Any write, small or not: a client that takes none holds every answer queued
        # behind it (``live.holding``).
        live.unread_since = self._loop.time()
        try:
            await write(response)
        except Exception as exc:
            # grpc-core fails a write (ExecuteBatchError) only once the call is over:
            # the client cancelled or went away mid-write, before the reader saw it.
            # The stream ends as on any cancel, not as a server error with a
            # traceback in the log (a client could fill the log with those).
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
            finally:
                live.writing = False


def _command(raw: bytes, opening: StreamOpening) -> tuple[Message, str]:
    """The request ``raw`` (decoded once already: empty if it no longer parses) and the
    name of its command."""
    request: Message
    try:
        request = opening.request_class.FromString(raw)
    except DecodeError:  # kept total for safety
        request = opening.request_class()
    return request, request.WhichOneof("command") or "request"


async def _write_quietly(context: _Context, message: bytes) -> None:
    """Write ``message`` on a stream that may end meanwhile (then it is simply not sent)."""
    with contextlib.suppress(Exception):
        await context.write(message)


def _ignore(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()
