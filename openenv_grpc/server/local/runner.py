"""Where env code runs: a stream's batch of envs called where its execution mode says,
and the event loop's task factory that contains env code's own tasks.

An :class:`EnvRunner` holds one batch (``calls.local_calls`` makes it from
``batch.batch_spec``: a Session's loop of one plain instance, a vector stream's
loop or native batch, or an env process's block) and runs each call on it as a whole. No
thread per session: inline and async envs run on the event loop, blocking sync envs share one
bounded thread pool, and a measured env's calls go to whichever of the two its
:class:`~openenv_grpc.server.model.placement.CostGroup` says now (timed either way; a call that
must be given up on at a timeout always goes to the pool). Calls on one batch never
overlap: its ``calls.LocalBatchCalls`` runs them one at a time, also for a vector stream
with several requests in flight.

A batch holds its envs' slots of the session limiter from before its factory runs until
it is closed, wherever that happens: the runner gives them back (its ``release``
callback) when the batch is closed, when its factory raised, or -- for an open that was
cancelled while the factory ran, or a batch abandoned in a hung call -- once the factory
or the call finally returns and the batch is closed. So the cap counts live envs, not
sessions. Factories and closes of pooled envs run on their own ``lifecycle`` threads (a
:class:`~openenv_grpc.server.local.env_threads.Lifecycle`: creates and closes on separate pools,
with a timeout), so a fresh env is never built behind env calls that hang on the shared
pool, nor behind closes that hang. A close past the timeout is abandoned: the session
ends, and the envs keep their slots until the close returns (they still exist).

Env code's ``SystemExit`` and kin come out of a runner as
:class:`~openenv_grpc.server.errors.EnvExit`; :func:`contain_tasks` does the same for the
tasks an async env starts itself, so none of them can stop the server's event loop.
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

from openenv_grpc.environment import AnyEnvironment, Environment
from openenv_grpc.server.errors import EnvExit, contained
from openenv_grpc.server.local.env_threads import EnvCall, EnvThreadPool, Lifecycle
from openenv_grpc.server.model.placement import CallPlacement, CostGroup
from openenv_grpc.server.model.spec import EnvSpec, ExecutionMode

__all__ = [
    "CloseAbandoned",
    "CreateTimeout",
    "EnvRunner",
    "Orphaned",
    "PoolSaturated",
    "RunnerFactory",
    "contain_tasks",
]

log = logging.getLogger(__name__)

#: Takes the result of a pooled call whose caller stopped waiting for it, and the seconds
#: the call took (see _hand_on).
Orphaned = Callable[[Any, float], None]


class PoolSaturated(Exception):
    """A pooled env call waited for a free thread until its timeout: it never ran, so the
    env is untouched."""


class CreateTimeout(Exception):
    """The env's factory ran past the lifecycle timeout: the open fails; the env, if it is
    ever born, is closed then (its slot is held until then)."""


class CloseAbandoned(Exception):
    """The env's close ran past the lifecycle timeout and was given up on: the env is
    gone for the session, and keeps its slot until its close returns."""


def _nothing() -> None:
    pass


_P = ParamSpec("_P")
_T = TypeVar("_T")


def _contained(method: Callable[_P, Awaitable[_T]]) -> Callable[_P, Coroutine[Any, Any, _T]]:
    """Env code's ``SystemExit``, ``KeyboardInterrupt`` (any ``BaseException`` that is no
    ``Exception``) comes out of the runner as :class:`~openenv_grpc.server.errors.EnvExit`:
    escaping a task, it would stop the server's event loop. Cancellation passes."""

    @functools.wraps(method)
    async def run(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return await method(*args, **kwargs)
        except (Exception, asyncio.CancelledError):
            raise
        except BaseException as exc:
            raise EnvExit(exc) from exc

    return run


def contain_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Make every task on ``loop`` run its coroutine under ``errors.contained``: a task an
    async env starts itself (``asyncio.create_task`` in its step) that raises
    ``SystemExit`` or ``KeyboardInterrupt`` would otherwise stop the server's loop. Its
    failure is then logged as the task's unretrieved exception, an ``EnvExit``."""

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        return asyncio.Task(contained(coro), loop=loop, **kwargs)

    loop.set_task_factory(factory)


class EnvRunner:
    """One live environment instance and the way to call it."""

    __slots__ = ("_closed", "_cost_class", "_inflight", "_lifecycle", "_loop", "_mode",
                 "_placement", "_pool", "_release", "env", "inline")  # fmt: skip

    def __init__(
        self,
        env: AnyEnvironment,
        mode: ExecutionMode,
        pool: Executor,
        *,
        lifecycle: Executor | None = None,
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
        #: The env's own cost_class(), if it has one (else every call is in class "").
        self._cost_class: Callable[[], str] | None = None
        if mode is ExecutionMode.MEASURED:
            # A batch (batch.VectorBatch) answers for its envs: always ask it.
            own = getattr(type(env), "cost_class", Environment.cost_class)
            measured: Any = env  # an Environment or a VectorBatch: both have cost_class
            self._cost_class = None if own is Environment.cost_class else measured.cost_class
        self._pool = pool
        self._lifecycle = lifecycle if lifecycle is not None else pool
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
        lifecycle: Executor | None = None,
        release: Callable[[], None] = _nothing,
    ) -> EnvRunner:
        """Make a fresh instance with the spec's factory (on ``lifecycle``, default
        ``pool``, for pooled and measured envs). From here on the runner owns ``release``:
        it is called once, on the event loop, when the instance is closed or could not be
        made -- also when this call is cancelled (then once the factory's env is closed).

        Raises:
            Exception: whatever the factory raised.
            TypeError: the factory returned an instance of another class than the spec's.
        """
        loop = asyncio.get_running_loop()
        lifecycle = lifecycle if lifecycle is not None else pool
        try:
            if spec.mode in _OFF_LOOP:
                future = lifecycle.submit(spec.factory)
                timeout = lifecycle.timeout if isinstance(lifecycle, Lifecycle) else None
                waiter = asyncio.wrap_future(future)
                try:
                    done, _ = await asyncio.wait((waiter,), timeout=timeout)
                except asyncio.CancelledError:
                    # The session is gone but the env may still be born: it keeps its
                    # slot until it is, and is closed then.
                    _close_orphan_later(future, lifecycle, loop, release)
                    raise
                if not done:
                    assert isinstance(lifecycle, Lifecycle) and timeout is not None
                    _give_up_create(lifecycle, future, loop, release)
                    raise CreateTimeout(
                        f"the environment was not made within {timeout:g}s "
                        "(--lifecycle-timeout): nothing was kept, open again"
                    )
                env = waiter.result()
            else:
                env = spec.factory()
        except (asyncio.CancelledError, CreateTimeout):
            raise
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

    async def _call(
        self,
        method: Callable[..., Any],
        *args: Any,
        orphaned: Orphaned | None = None,
        **kwargs: Any,
    ) -> Any:
        """Call one of the env's methods and return its result (awaited if async); see
        :attr:`call`, the same with env code's exceptions contained. A pooled call whose
        caller is cancelled while it runs hands its result to ``orphaned`` once it returns
        (see :func:`_hand_on`).

        Raises:
            Exception: whatever the method (or a measured env's ``cost_class()``) raised.
        """
        mode = self._mode
        if mode is ExecutionMode.INLINE:
            return method(*args, **kwargs)
        if mode is ExecutionMode.MEASURED:
            group = self._group(method)
            if group.inline:
                return group.call_inline(method, *args, **kwargs)
            timed = group.pooled(method)
            submitted = time.perf_counter()
            self._inflight = future = self._pool.submit(_here().run, timed.run, *args, **kwargs)
            try:
                return await asyncio.wrap_future(future)
            except asyncio.CancelledError:
                if orphaned is not None:
                    _hand_on(future, self._loop, orphaned, submitted)
                raise
            finally:
                # A call that raised counts too; one the session stopped waiting for, not.
                if future.done() and not future.cancelled():
                    timed.record()
        if mode is ExecutionMode.ASYNC:
            return await method(*args, **kwargs)  # cancelled with its caller: nothing runs on
        submitted = time.perf_counter()
        self._inflight = future = self._pool.submit(_here().run, method, *args, **kwargs)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if orphaned is not None:
                _hand_on(future, self._loop, orphaned, submitted)
            raise

    #: :meth:`_call` with env code's SystemExit and kin contained (``_contained``); the
    #: runner's own contained entries call ``_call``, so a step is wrapped once.
    call = _contained(_call)

    def _group(self, method: Callable[..., Any]) -> CostGroup:
        """The cost group ``method``'s call belongs to now."""
        assert self._placement is not None  # MEASURED implies a placement (see __init__)
        cost_class = self._cost_class() if self._cost_class is not None else ""
        name = getattr(method, "__name__", "call")
        threads = getattr(self.env, "computes_in_threads", None)  # a VectorBatch's
        return self._placement.group(cost_class, name, threads is not None and threads())

    def call_inline(self, method: Callable[..., Any], *args: Any) -> Any:
        """What :meth:`call_within` returns for an :attr:`inline` runner, without its
        three coroutines per call (a step's hot path): the method's result, env code's
        ``SystemExit`` and kin as :class:`~openenv_grpc.server.errors.EnvExit`.

        Raises:
            Exception: whatever the method raised.
        """
        try:
            return method(*args)
        except (Exception, asyncio.CancelledError):
            raise
        except BaseException as exc:
            raise EnvExit(exc) from exc

    @_contained
    async def call_within(
        self,
        timeout: float | None,
        method: Callable[..., Any],
        *args: Any,
        orphaned: Orphaned | None = None,
        **kwargs: Any,
    ) -> Any:
        """:meth:`call`, giving up ``timeout`` seconds after the call started (None: wait
        for ever); ``orphaned`` as for :meth:`_call`.

        Inline envs run on the event loop and cannot be interrupted: no timeout applies.
        A measured env's calls run on the pool whenever a timeout applies (never moved to
        the loop: there they could not be given up on). A pooled call that waits
        ``timeout`` seconds for a free thread is cancelled before it ever runs. After a
        timeout the instance is unusable; see :meth:`abandon`.

        Raises:
            TimeoutError: the call ran longer than ``timeout`` (it may still be running).
            PoolSaturated: the call was still queued for a thread after ``timeout``.
        """
        if timeout is None or self._mode is ExecutionMode.INLINE:
            return await self._call(method, *args, orphaned=orphaned, **kwargs)
        if self._mode is ExecutionMode.ASYNC:
            try:
                return await asyncio.wait_for(method(*args, **kwargs), timeout)  # cancelled
            except asyncio.TimeoutError:
                raise TimeoutError(f"no answer within {timeout:g}s") from None
        submitted = time.monotonic()
        began = time.perf_counter()
        self._inflight = future = self._pool.submit(_here().run, method, *args, **kwargs)
        waiter = asyncio.wrap_future(future)
        try:
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
            # Given up (timeout, saturation, the session cancelled): a call still queued
            # is dropped, as with call(); a running one goes on unobserved.
            if not waiter.done():
                waiter.cancel()

    def _saturation(self) -> str:
        pool = self._pool
        if isinstance(pool, EnvThreadPool):
            threads = f"{pool.busy} of {pool.size} threads busy"
        else:
            threads = "every thread busy"
        return f"env thread pool saturated: {threads}; the episode is unchanged, retry"

    def abandon(self) -> None:
        """Give up on this instance after a timeout: close it once its running call ends,
        without waiting for that here. Counts as closed; the slot is freed after the close."""
        if self._closed:
            return
        self._closed = True
        self._close_later()

    def _close_later(self) -> None:
        """Close the env (and free its slot) in the background, never overlapping a
        call still running on the pool."""
        inflight = self._inflight
        if self._mode in _OFF_LOOP and inflight is not None and not inflight.done():
            # Runs when the hung call returns, on its thread (on this one if it just did).
            inflight.add_done_callback(lambda _: self._submit_close())
            return
        if self._mode is ExecutionMode.ASYNC:
            task = self._loop.create_task(self._aclose_then_release())
            _background.add(task)
            task.add_done_callback(_background.discard)
            return
        self._submit_close()

    def _submit_close(self) -> None:
        """Close the env on a lifecycle thread (never on the event loop), then free its slot."""
        try:
            _submit_close(self._lifecycle, self._loop, self._close_here)
        except RuntimeError:  # the pool is shut down: the process is exiting
            log.warning("environment not closed: the server is stopping")

    def _close_here(self) -> None:
        """Close a sync env on this (pool) thread, then free its slot."""
        _close_quietly(self.env)
        _release_from_thread(self._loop, self._release)

    async def _aclose_then_release(self) -> None:
        try:
            await self.env.close()  # type: ignore[misc]
        except asyncio.CancelledError:
            raise
        except BaseException:  # env code's SystemExit too: it is not the server's
            log.exception("closing an abandoned environment raised")
        finally:
            self._release()

    @_contained
    async def close(self) -> None:
        """Close the env exactly once and free its slot; later calls do nothing.

        A call a cancelled session left running is not waited for: the env is closed
        (and its slot freed) once that call returns, so close() never overlaps it.

        Raises:
            Exception: whatever the env's ``close`` raised (it still counts as closed).
            CloseAbandoned: the close ran past the lifecycle timeout (pooled envs).
        """
        if self._closed:
            return
        self._closed = True
        inflight = self._inflight
        if inflight is not None and not inflight.done():
            self._close_later()
            return
        if self._mode in _OFF_LOOP:
            await self._close_off_loop()
            return
        lifecycle = self._lifecycle
        timeout = lifecycle.timeout if isinstance(lifecycle, Lifecycle) else None
        try:
            if self._mode is ExecutionMode.ASYNC and timeout is not None:
                # An async close can be given up on: it is cancelled, nothing keeps running.
                try:
                    await asyncio.wait_for(self.env.close(), timeout)  # type: ignore[arg-type]
                except asyncio.TimeoutError:
                    raise CloseAbandoned(
                        f"close did not finish within {timeout:g}s (--lifecycle-timeout); "
                        "it was cancelled"
                    ) from None
            else:  # an inline env's close runs on the loop: it cannot be interrupted
                await self._call(self.env.close)
        finally:
            self._release()

    async def _close_off_loop(self) -> None:
        """Close on a lifecycle thread; past the lifecycle timeout, stop waiting: the close
        is abandoned (counted, logged) and the slot freed only once it returns."""
        lifecycle = self._lifecycle
        future = _submit_close(lifecycle, self._loop, self.env.close)
        timeout = lifecycle.timeout if isinstance(lifecycle, Lifecycle) else None
        waiter = asyncio.wrap_future(future)
        try:
            done, _ = await asyncio.wait((waiter,), timeout=timeout)
        except asyncio.CancelledError:
            future.add_done_callback(lambda _: _release_from_thread(self._loop, self._release))
            raise
        if not done:
            # Not waiter.cancel(): that would cancel a close still queued, and its env
            # would never be closed.
            assert isinstance(lifecycle, Lifecycle) and isinstance(future, EnvCall)
            lifecycle.abandon_close(future)
            future.add_done_callback(lambda _: _release_from_thread(self._loop, self._release))
            raise CloseAbandoned(
                f"close did not finish within {timeout:g}s (--lifecycle-timeout); the "
                "environment was abandoned and its slot is freed when its close returns"
            )
        try:
            waiter.result()
        finally:
            self._release()

    async def close_quietly(self) -> None:
        """:meth:`close`, shielded from a second cancellation (a server stopping must not
        skip it), logging what the env's ``close`` raised instead of raising it."""
        try:
            await asyncio.shield(self.close())
        except (asyncio.CancelledError, CloseAbandoned):  # (the lifecycle logged it)
            pass
        except Exception:
            log.exception("environment close() raised; its session ended anyway")


#: Makes a fresh env instance wrapped in a runner (the session's factory).
RunnerFactory = Callable[[], Awaitable[EnvRunner]]


def _hand_on(
    future: concurrent.futures.Future[Any],
    loop: asyncio.AbstractEventLoop,
    orphaned: Orphaned,
    submitted: float,
) -> None:
    """The caller of the pooled call ``future`` (submitted at ``perf_counter`` time
    ``submitted``) was cancelled (its session ended) while the call may still run: once
    it returns, hand its result and its seconds to ``orphaned`` on ``loop``, so that what
    the env did is still accounted for (a call that never ran, or raised, hands on
    nothing). Its caller raised CancelledError, so it is handed on exactly once."""

    def done(finished: concurrent.futures.Future[Any]) -> None:
        if finished.cancelled() or finished.exception() is not None:
            return
        seconds = time.perf_counter() - submitted
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is exiting
            loop.call_soon_threadsafe(orphaned, finished.result(), seconds)

    future.add_done_callback(done)  # on the call's thread, or here if it is done already


#: Modes whose factory and close run on a lifecycle thread, never on the event loop
#: (a measured env's cheap steps say nothing about what making or closing it costs).
_OFF_LOOP = frozenset({ExecutionMode.POOL, ExecutionMode.MEASURED})


#: Closes of abandoned async envs, referenced until done so they are not collected.
_background: set[asyncio.Task[Any]] = set()


def _release_from_thread(loop: asyncio.AbstractEventLoop, release: Callable[[], None]) -> None:
    """Run ``release`` on ``loop`` (the limiter lives there); nothing if the loop is gone."""
    # A closed loop means the server has stopped: nothing left to free.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(release)


#: This task's context, for a pooled call: what the env (and a row error) logs on the pool
#: thread carries the session's id, as on the event loop (``logs.SESSION_ID``).
_here = contextvars.copy_context


def _close_orphan_later(
    future: concurrent.futures.Future[Any],
    lifecycle: Executor,
    loop: asyncio.AbstractEventLoop,
    release: Callable[[], None],
) -> None:
    """Close the env of a cancelled open once its factory returns, then free its slot."""

    def close_then_release(env: Any) -> None:
        _close_quietly(env)
        _release_from_thread(loop, release)

    def done(finished: concurrent.futures.Future[Any]) -> None:
        if finished.cancelled() or finished.exception() is not None:
            _release_from_thread(loop, release)
            return
        if isinstance(lifecycle, Lifecycle):  # on the close pool: a create thread is free
            try:
                lifecycle.close(loop, close_then_release, finished.result())
            except RuntimeError:  # shut down: the process is exiting
                _release_from_thread(loop, release)
            return
        close_then_release(finished.result())

    if future.done():
        # Done already (the cancel raced the result): close off the event loop.
        if isinstance(lifecycle, Lifecycle):
            done(future)
            return
        try:
            lifecycle.submit(done, future)
        except RuntimeError:
            release()
        return
    future.add_done_callback(done)  # runs on the factory's thread, or here if cancelled


def _give_up_create(
    lifecycle: Lifecycle,
    future: concurrent.futures.Future[Any],
    loop: asyncio.AbstractEventLoop,
    release: Callable[[], None],
) -> None:
    """An open stops waiting for its factory at the timeout: a factory still queued never
    runs (its slot is freed now); a running one is abandoned on its thread, so the creates
    queued behind it go on, and its env is closed when it is born."""
    if future.cancel():
        release()
        return
    if isinstance(future, EnvCall):
        lifecycle.creates.abandon(future)
    log.error(
        "an environment's factory did not return within %gs: the open failed; the env is "
        "closed if it is ever made, and holds its slot until then", lifecycle.timeout,
    )  # fmt: skip
    _close_orphan_later(future, lifecycle, loop, release)


def _submit_close(
    lifecycle: Executor, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any
) -> concurrent.futures.Future[Any]:
    """``fn(*args)`` on the close pool of ``lifecycle`` (watched for its timeout), or on
    ``lifecycle`` itself when it is a plain executor.

    Raises:
        RuntimeError: the pool is shut down.
    """
    if isinstance(lifecycle, Lifecycle):
        return lifecycle.close(loop, fn, *args)
    return lifecycle.submit(fn, *args)


def _close_quietly(env: Any) -> None:
    try:
        env.close()
    except BaseException:  # on a pool thread; env code's SystemExit included
        log.exception("closing an abandoned environment raised")
