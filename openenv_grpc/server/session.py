"""The session lifecycle: one Session stream, one environment instance, from admission
to close.

Every path that ends a stream goes through :meth:`SessionManager.serve`'s ``finally``:
the client closes or cancels, its process dies, keepalive drops the connection, the idle
reaper or a drain cancels the session. There the env is closed exactly once and the slot
released exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
import uuid
from concurrent.futures import Executor

import grpc

from openenv_grpc.metadata import ADMITTED_KEY, RETRY_PUSHBACK_KEY, SESSION_ID_KEY
from openenv_grpc.server.activity import Activity
from openenv_grpc.server.backend import (
    EnvFactoryError,
    LocalBackend,
    SessionBackend,
    SessionLostError,
    UndecodableRequest,
)
from openenv_grpc.server.config import ServerConfig
from openenv_grpc.server.isolated import IsolatedPool
from openenv_grpc.server.limiter import Admission, SessionLimiter
from openenv_grpc.server.logs import SESSION_ID
from openenv_grpc.server.metrics import NO_METRICS, Metrics
from openenv_grpc.server.runner import EnvRunner
from openenv_grpc.server.spec import EnvSpec

__all__ = ["SessionManager"]

log = logging.getLogger(__name__)

#: Session requests arrive as raw bytes; the loop parses them (see service.add_env_service).
_Context = grpc.aio.ServicerContext[bytes, bytes]


class _EndReason(enum.Enum):
    """Why the server ended a session itself, and the status the client gets."""

    IDLE = grpc.StatusCode.DEADLINE_EXCEEDED
    DRAIN = grpc.StatusCode.UNAVAILABLE


class _LiveSession:
    """The handle the reaper and the drain use to end a session from outside."""

    __slots__ = ("end_reason", "task", "waiting_since")

    def __init__(self, task: asyncio.Task[object]) -> None:
        self.task = task
        #: Loop time when the session began waiting for its client; None while it works.
        self.waiting_since: float | None = None
        self.end_reason: _EndReason | None = None

    def end(self, reason: _EndReason) -> None:
        if self.end_reason is None:
            self.end_reason = reason
            self.task.cancel()


class _Held:
    """What an admitted session holds until :meth:`SessionManager._release`."""

    __slots__ = ("backend", "live", "reason", "released", "started")

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.reason = "error"  # how the session ended, for logs and metrics
        self.backend: SessionBackend | None = None
        self.live: _LiveSession | None = None
        self.released = False


class SessionManager:
    """Admits, runs and ends every session of one server process."""

    def __init__(
        self,
        spec: EnvSpec,
        config: ServerConfig,
        pool: Executor,
        limiter: SessionLimiter,
        metrics: Metrics = NO_METRICS,
        isolated: IsolatedPool | None = None,
        activity: Activity | None = None,
    ) -> None:
        self._isolated = isolated
        self.spec = spec
        self.config = config
        self.limiter = limiter
        self._metrics = metrics
        #: Counters for the Info RPC; ``metrics`` must report to it (the server wires both).
        self.activity = activity if activity is not None else Activity()
        self._pool = pool
        self._live: set[_LiveSession] = set()
        self._reaper: asyncio.Task[None] | None = None
        #: Set when a drain's grace period is over: sessions still starting end at once.
        self._ending: _EndReason | None = None
        #: Longest an env call may take; the server's setting wins over the env's own.
        self._call_timeout = config.call_timeout(spec.env_class.step_timeout)

    async def _new_runner(self) -> EnvRunner:
        return await EnvRunner.create(self.spec, self._pool)

    async def _open_backend(self) -> SessionBackend:
        """A fresh env for one session: in a worker process when isolated, else here."""
        if self._isolated is not None:
            return await self._isolated.open()
        return await LocalBackend.open(
            self.spec, self._new_runner, self._call_timeout, self._metrics
        )

    async def serve(self, context: _Context) -> None:
        """Run one Session stream, given its RPC context, to its end."""
        admission = self.limiter.try_acquire()
        if admission is not Admission.ADMITTED:
            self._metrics.session_refused(admission.value)
            await self._refuse(context, admission)
            return
        session_id = uuid.uuid4().hex[:16]
        SESSION_ID.set(session_id)  # this task's context: every log line below carries it
        held = _Held()
        try:
            try:
                held.backend = await self._open_backend()
            except Exception as exc:
                held.reason = "factory_error"
                log.exception("environment factory raised")
                # A worker process reports the factory's exception as text already.
                detail = str(exc) if isinstance(exc, EnvFactoryError) else _describe(exc)
                await context.abort(
                    grpc.StatusCode.INTERNAL, f"could not create the environment: {detail}"
                )
            # Headers now tell the client it was admitted and its env exists.
            await context.send_initial_metadata(
                ((ADMITTED_KEY, self.spec.name), (SESSION_ID_KEY, session_id))
            )
            log.debug("session opened")
            held.live = live = _LiveSession(asyncio.current_task())  # type: ignore[arg-type]
            self._live.add(live)
            if self._ending is not None:
                live.end(self._ending)
            held.reason = await self._loop(context, held.backend, live)
        except asyncio.CancelledError:
            end_reason = held.live.end_reason if held.live is not None else None
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

    async def _release(self, held: _Held) -> None:
        """Close the session's env and free its slot, once."""
        if held.released:
            return
        held.released = True
        if held.live is not None:
            self._live.discard(held.live)
        if held.backend is not None:
            await held.backend.close()
        self.limiter.release()
        elapsed = time.monotonic() - held.started
        self._metrics.session_ended(elapsed, held.reason)
        log.debug("session ended (%s) after %.3fs", held.reason, elapsed)

    async def _loop(self, context: _Context, backend: SessionBackend, live: _LiveSession) -> str:
        """Answer requests until the stream ends; returns how it ended."""
        loop = asyncio.get_running_loop()
        read, write, handle = context.read, context.write, backend.handle
        live.waiting_since = loop.time()
        while True:
            # Idle = waiting on the client: for its next request, or for it to take our
            # last answer (a client that stops reading blocks write() on flow control).
            raw: object = await read()
            live.waiting_since = None
            if raw is grpc.aio.EOF:
                # The client half-closed or cancelled: gRPC shows both as the end of input.
                return "client_ended"
            try:
                response = await handle(raw)  # type: ignore[arg-type]
            except UndecodableRequest as exc:
                # No request id to answer to: the stream is out of sync, so end it.
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except SessionLostError as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"session lost: {exc}")
            live.waiting_since = loop.time()
            await write(response)
            if backend.closed:
                return "closed"

    async def _refuse(
        self,
        context: _Context,
        admission: Admission,
    ) -> None:
        if admission is Admission.DRAINING:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "server is draining: not admitting new sessions"
            )
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"server at {self.limiter.describe()}; retry later or elsewhere",
            trailing_metadata=((RETRY_PUSHBACK_KEY, str(self.config.retry_pushback_ms)),),
        )

    def _end_message(self, reason: _EndReason) -> str:
        if reason is _EndReason.IDLE:
            return f"session idle for more than {self.config.idle_timeout:g}s: environment closed"
        return "server is draining: session ended and environment closed"

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
                if live.waiting_since is not None and live.waiting_since < cutoff:
                    live.end(_EndReason.IDLE)

    async def drain(self, grace: float) -> None:
        """Admit nothing more, give running sessions ``grace`` seconds, then end them all.

        Returns once every session's env is closed.
        """
        self.limiter.start_draining()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.limiter.wait_idle(), grace)
        self._ending = _EndReason.DRAIN
        for live in list(self._live):
            live.end(_EndReason.DRAIN)
        await self.limiter.wait_idle()
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
