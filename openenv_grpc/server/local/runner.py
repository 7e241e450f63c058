"""Where env code runs: an :class:`EnvRunner` holds one batch and runs each call on it
inline, on the shared thread pool, awaited on the loop, or where its measured cost group
says; and :func:`contain_tasks`, the loop's task factory that contains env code's tasks.

A runner holds its envs' limiter slots until the batch is closed, wherever that happens
(also after a cancelled open or an abandoned call: once the factory or call returns), so
the cap counts live envs. Factories and closes of pooled envs run on the
:class:`~openenv_grpc.server.local.env_threads.Lifecycle` threads, with its timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Executor
from typing import Any, ParamSpec, TypeVar

from openenv_grpc.environment import AnyEnvironment
from openenv_grpc.server.errors import EnvExit, contained
from openenv_grpc.server.local.env_threads import (
    CloseAbandoned,
    CreateTimeout,
    EnvThreadPool,
    Lifecycle,
    untimed,
)
from openenv_grpc.server.model.placement import CallPlacement, CostGroup, PooledCall
from openenv_grpc.server.model.spec import EnvSpec, ExecutionMode

__all__ = [
    "EnvRunner",
    "Orphaned",
    "PoolSaturated",
    "contain_tasks",
]

log = logging.getLogger(__name__)

#: Takes the result of a pooled call whose caller stopped waiting for it, and its seconds.
Orphaned = Callable[[Any, float], None]


class PoolSaturated(Exception):
    """A pooled call waited for a free thread until its timeout: it never ran."""


def _nothing() -> None:
    pass


_P = ParamSpec("_P")
_T = TypeVar("_T")


def _contained(method: Callable[_P, Awaitable[_T]]) -> Callable[_P, Coroutine[Any, Any, _T]]:
    """Env code's ``SystemExit`` and kin come out as ``EnvExit``: escaping a task, they
    would stop the server's event loop. Cancellation passes."""

    @functools.wraps(method)
    async def run(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return await method(*args, **kwargs)
        except (Exception, asyncio.CancelledError):
            raise
        except BaseException as exc:
            raise EnvExit(exc) from exc

    return run


#: grpc.aio's compiled coroutines that run an RPC's handler, which calls env code only
#: through a runner (a name grpc changes is wrapped: the safe side).
_GRPC_OWN = frozenset({"_handle_exceptions", "_schedule_rpc_coro"})
#: uvicorn's coroutine of a WebSocket, which catches any BaseException its app raises.
_UVICORN_OWN = "WebSocketsSansIOProtocol.run_asgi"


def contain_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Run the tasks env code may have started on ``loop`` under ``errors.contained``, so
    that a task an async env starts itself cannot stop the loop with ``SystemExit`` (it
    is logged as an ``EnvExit``). The server's own tasks (its streams, its sockets) go
    unwrapped: the wrapper is one more frame resumed at every wake-up, and they call env
    code only through a runner (its calls, ``cost_class`` too, contain what it raises)."""

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        if not _servers_own(coro):
            coro = contained(coro)
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(factory)


def _servers_own(coro: Any) -> bool:
    """The server's own code (this package's, the grpc.aio and uvicorn coroutines that run
    its handlers); never asyncio's as such: ``asyncio.to_thread`` awaits env code."""
    frame = getattr(coro, "cr_frame", None)
    name = getattr(coro, "__qualname__", None)
    module = None if frame is None else frame.f_globals.get("__name__")
    if not isinstance(module, str):  # compiled: Cython's frames name no module (or done)
        return name in _GRPC_OWN
    return module.startswith("openenv_grpc.") or (
        module.startswith("uvicorn.") and name == _UVICORN_OWN
    )


class EnvRunner:
    """One live environment instance and the way to call it."""

    __slots__ = ("_closed", "_cost_class", "_groups", "_inflight", "_lifecycle", "_loop",
                 "_mode", "_placement", "_pool", "_release", "env", "inline")  # fmt: skip

    def __init__(
        self,
        env: AnyEnvironment,
        mode: ExecutionMode,
        pool: Executor,
        *,
        lifecycle: Lifecycle | None = None,
        release: Callable[[], None] = _nothing,
        placement: CallPlacement | None = None,
    ) -> None:
        self.env = env
        if mode is ExecutionMode.MEASURED and placement is None:
            mode = ExecutionMode.POOL  # nothing to measure against: the safe side
        self._mode = mode
        #: Every call runs on the event loop, untimed: :meth:`call_inline` may be used.
        self.inline = mode is ExecutionMode.INLINE
        self._placement = placement
        measured: Any = env  # a VectorBatch: it answers for its envs
        self._cost_class: Callable[[], str] | None = (
            measured.cost_class if mode is ExecutionMode.MEASURED else None
        )
        #: A measured batch grouped by method alone keeps its groups here, by method name
        #: (one lookup per call); None: the group is asked for on each call.
        alone = getattr(measured, "by_method_alone", None)
        self._groups: dict[str, CostGroup] | None = (
            {} if mode is ExecutionMode.MEASURED and alone is not None and alone() else None
        )
        self._pool = pool
        self._lifecycle = lifecycle if lifecycle is not None else untimed()
        self._release = release
        self._loop = asyncio.get_running_loop()
        self._closed = False
        #: The last call submitted to the pool; a cancelled session may leave it running.
        self._inflight: concurrent.futures.Future[Any] | None = None

    @classmethod
    @_contained
    async def create(
        cls,
        spec: EnvSpec,
        pool: Executor,
        *,
        lifecycle: Lifecycle | None = None,
        release: Callable[[], None] = _nothing,
    ) -> EnvRunner:
        """A runner of a fresh instance from the spec's factory (made by ``lifecycle``,
        default :func:`untimed`, for pooled and measured envs). It owns ``release`` from
        here on, also when this call is cancelled or fails (raising what the factory
        raised, or TypeError for an instance of another class than the spec's)."""
        lifecycle = lifecycle if lifecycle is not None else untimed()
        try:
            if spec.mode in _OFF_LOOP:
                env = await lifecycle.make(spec.factory, release)
            else:
                env = spec.factory()
        except (asyncio.CancelledError, CreateTimeout):
            raise  # the lifecycle frees the slot when the factory returns
        except BaseException:
            release()
            raise
        if not isinstance(env, spec.env_class):
            release()
            raise TypeError(
                f"factory returned {type(env).__qualname__}, not {spec.env_class.__qualname__}"
            )
        return cls(
            env, spec.mode, pool, lifecycle=lifecycle, release=release, placement=spec.placement
        )

    def _group(self, method: Callable[..., Any]) -> CostGroup:
        name = getattr(method, "__name__", "call")
        groups = self._groups
        if groups is not None and (group := groups.get(name)) is not None:
            return group
        assert self._placement is not None  # MEASURED implies a placement (see __init__)
        cost_class = self._cost_class() if self._cost_class is not None else ""
        threads = getattr(self.env, "computes_in_threads", None)  # a VectorBatch's
        group = self._placement.group(cost_class, name, threads is not None and threads())
        if groups is not None:
            groups[name] = group
        return group

    def group_on_loop(self, method: Callable[..., Any]) -> CostGroup | None:
        """The measured group of ``method`` while it runs on the event loop (None: the env
        is not measured, or the group is on the pool)."""
        if self._mode is not ExecutionMode.MEASURED:
            return None
        group = self._group(method)
        return group if group.inline else None

    def call_inline(self, method: Callable[..., Any], *args: Any) -> Any:
        """:meth:`call_within` of an :attr:`inline` runner without its two coroutines (a
        step's hot path)."""
        try:
            return method(*args)
        except (Exception, asyncio.CancelledError):
            raise
        except BaseException as exc:
            raise EnvExit(exc) from exc

    async def _call_within(
        self,
        timeout: float | None,
        method: Callable[..., Any],
        *args: Any,
        orphaned: Orphaned | None = None,
        **kwargs: Any,
    ) -> Any:
        """Call one of the env's methods where its mode says, given up ``timeout`` seconds
        after the call started (None: never). A pooled call whose caller is cancelled
        hands its result to ``orphaned`` once it returns.

        Inline calls cannot be interrupted: no timeout applies. A measured env's calls run
        on the pool when a timeout applies. After a timeout, see :meth:`abandon`.

        Raises:
            TimeoutError: the call ran longer than ``timeout`` (it may still be running).
            PoolSaturated: the call was still queued for a thread after ``timeout``.
        """
        mode = self._mode
        if mode is ExecutionMode.INLINE:
            return method(*args, **kwargs)
        if mode is ExecutionMode.ASYNC:
            if timeout is None:
                return await method(*args, **kwargs)  # cancelled with its caller
            try:
                return await asyncio.wait_for(method(*args, **kwargs), timeout)  # cancelled
            except asyncio.TimeoutError:
                raise TimeoutError(f"no answer within {timeout:g}s") from None
        timed: PooledCall | None = None
        run = method
        if mode is ExecutionMode.MEASURED and timeout is None:
            group = self._group(method)
            if group.inline:
                return group.call_inline(method, *args, **kwargs)
            timed = group.pooled(method)
            run = timed.run
        began = time.perf_counter()
        self._inflight = future = self._pool.submit(_here().run, run, *args, **kwargs)
        waiter = asyncio.wrap_future(future)
        try:
            if timeout is None:
                return await waiter
            submitted = time.monotonic()
            # Not wait_for: it would cancel the waiter, and a call that started late
            # gets more time below.
            done, _ = await asyncio.wait((waiter,), timeout=timeout)
            while not done:
                if future.cancel():  # still queued: it never ran, the env is untouched
                    raise PoolSaturated(self._saturation())
                started = getattr(future, "started_at", None) or submitted
                left = started + timeout - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no answer within {timeout:g}s")
                done, _ = await asyncio.wait((waiter,), timeout=left)
            return waiter.result()
        except asyncio.CancelledError:
            if orphaned is not None:
                _hand_on(future, self._loop, orphaned, began)
            raise
        finally:
            # A call that raised counts too; one the session stopped waiting for, not.
            if timed is not None and future.done() and not future.cancelled():
                timed.record()
            # Given up: a call still queued is dropped; a running one goes on unobserved.
            if not waiter.done():
                waiter.cancel()

    #: :meth:`_call_within` with env code's SystemExit and kin contained.
    call_within = _contained(_call_within)

    def call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Awaitable[Any]:
        """:meth:`call_within` without a timeout."""
        return self.call_within(None, method, *args, **kwargs)

    def _saturation(self) -> str:
        pool = self._pool
        if isinstance(pool, EnvThreadPool):
            threads = f"{pool.busy} of {pool.size} threads busy"
        else:
            threads = "every thread busy"
        return f"env thread pool saturated: {threads}; the episode is unchanged, retry"

    def abandon(self) -> None:
        """Give up on this instance after a timeout: it counts as closed, and is closed
        (its slot freed) once its running call ends."""
        if self._closed:
            return
        self._closed = True
        self._close_later()

    def _close_later(self) -> None:
        """Close the env and free its slot in the background, after a pooled call still
        running."""
        inflight = self._inflight
        if self._mode in _OFF_LOOP and inflight is not None and not inflight.done():
            # Runs when the hung call returns, on its thread (on this one if it just did).
            inflight.add_done_callback(lambda _: self._submit_close())
            return
        if self._mode is ExecutionMode.ASYNC:
            task = self._loop.create_task(self._aclose_unobserved())
            _background.add(task)
            task.add_done_callback(_background.discard)
            return
        self._submit_close()

    def _submit_close(self) -> None:
        """Close the env on a lifecycle thread (never on the event loop), then free its slot."""
        try:
            self._lifecycle.close_later(self._loop, self.env.close, self._release)
        except RuntimeError:  # the pool is shut down: the process is exiting
            log.warning("environment not closed: the server is stopping")

    async def _aclose_unobserved(self) -> None:
        try:
            await self._lifecycle.close_async(self.env.close, self._release)  # type: ignore[arg-type]
        except asyncio.CancelledError:
            raise
        except CloseAbandoned:  # cancelled at the timeout (the lifecycle logged it)
            pass
        except BaseException:  # env code's SystemExit too: it is not the server's
            log.exception("closing an abandoned environment raised")

    @_contained
    async def close(self) -> None:
        """Close the env exactly once (also when its ``close`` raises) and free its slot.
        A call a cancelled session left running is not waited for: the env is closed once
        it returns.

        Raises:
            CloseAbandoned: the close ran past the lifecycle timeout (envs off the loop and
                async envs: see :class:`Lifecycle`).
        """
        if self._closed:
            return
        self._closed = True
        inflight = self._inflight
        if inflight is not None and not inflight.done():
            self._close_later()
            return
        if self._mode in _OFF_LOOP:
            await self._lifecycle.close(self.env.close, self._release)
        elif self._mode is ExecutionMode.ASYNC:
            await self._lifecycle.close_async(self.env.close, self._release)  # type: ignore[arg-type]
        else:  # an inline env's close runs on the loop: it cannot be interrupted
            try:
                self.env.close()
            finally:
                self._release()

    async def close_quietly(self) -> None:
        """:meth:`close`, shielded from a second cancellation, logging what it raised."""
        try:
            await asyncio.shield(self.close())
        except (asyncio.CancelledError, CloseAbandoned):  # (the lifecycle logged it)
            pass
        except Exception:
            log.exception("environment close() raised; its session ended anyway")


def _hand_on(
    future: concurrent.futures.Future[Any],
    loop: asyncio.AbstractEventLoop,
    orphaned: Orphaned,
    submitted: float,
) -> None:
    """Once the pooled call ``future`` (submitted at ``perf_counter`` ``submitted``), whose
    caller was cancelled, returns: hand its result and seconds to ``orphaned`` on ``loop``
    (nothing if it never ran or raised)."""

    def done(finished: concurrent.futures.Future[Any]) -> None:
        if finished.cancelled() or finished.exception() is not None:
            return
        seconds = time.perf_counter() - submitted
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is exiting
            loop.call_soon_threadsafe(orphaned, finished.result(), seconds)

    future.add_done_callback(done)


#: Modes whose factory and close run on a lifecycle thread, never on the event loop
#: (a measured env's cheap steps say nothing about what making or closing it costs).
_OFF_LOOP = frozenset({ExecutionMode.POOL, ExecutionMode.MEASURED})

#: Closes of abandoned async envs, referenced until done so they are not collected.
_background: set[asyncio.Task[Any]] = set()

#: A pooled call runs in its task's context: its logs carry the session's id.
_here = contextvars.copy_context
