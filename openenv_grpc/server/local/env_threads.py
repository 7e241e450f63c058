"""The threads blocking env code runs on, and :class:`Lifecycle`, the one path by which an
env is made and closed with a timeout and its slot freed once. Not ``ThreadPoolExecutor``:
a call records when it started (a timeout counts from there), the pool counts busy
threads (to report saturation), and its threads are daemons (``ThreadPoolExecutor``'s
are joined at exit: one hung call would block it for ever).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from openenv_grpc.server.errors import EnvExit

__all__ = ["CloseAbandoned", "CreateTimeout", "EnvCall", "EnvThreadPool", "Lifecycle", "untimed"]

log = logging.getLogger(__name__)


class EnvCall(concurrent.futures.Future[Any]):
    """A future that also records when a pool thread started running it."""

    def __init__(self) -> None:
        super().__init__()
        #: ``time.monotonic()`` when a thread picked the call up; None while queued.
        self.started_at: float | None = None
        self.abandoned = False


_Work = tuple[EnvCall, Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class EnvThreadPool(concurrent.futures.Executor):
    """At most ``size`` daemon threads (started on demand, then kept) running calls in
    order, plus up to ``spare`` more while threads are held by abandoned calls."""

    def __init__(self, size: int, name: str, *, spare: int = 0) -> None:
        if size < 1:
            raise ValueError(f"thread pool size must be >= 1, got {size}")
        self.size = size
        self.spare = spare
        self._abandoned = 0
        self._name = name
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        # Threads waiting for work: a submit that finds one idle starts no new thread.
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        #: Threads running a call now.
        self.busy = 0
        self._started = 0
        self._shutdown = False

    def abandon(self, call: EnvCall) -> bool:
        """Give up on ``call``: its thread stops counting against ``size``, so a new one
        takes the calls queued behind it. False if the call is done, already abandoned,
        or ``spare`` threads are held already."""
        with self._lock:
            if call.done() or call.abandoned or self._abandoned >= self.spare:
                return False
            call.abandoned = True
            self._abandoned += 1
            if not self._queue.empty():  # work waits: a thread for it, not the hung one
                self._start_thread()
            return True

    def _start_thread(self) -> None:
        """(With the lock held.)"""
        if len(self._threads) < self.size + self._abandoned:
            thread = threading.Thread(
                target=self._work, name=f"{self._name}-{self._started}", daemon=True
            )
            self._started += 1
            thread.start()
            self._threads.append(thread)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> EnvCall:
        """Raises RuntimeError: the pool was shut down."""
        future = EnvCall()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot run env calls after the pool was shut down")
            self._queue.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False):
                self._start_thread()
        return future

    def _work(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                self._queue.put(None)  # pass the stop on to the next thread
                return
            future, fn, args, kwargs = work
            del work
            future.started_at = time.monotonic()  # before it shows as running
            surplus = False
            if future.set_running_or_notify_cancel():
                with self._lock:
                    self.busy += 1
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:
                    # Env code's SystemExit goes as an Exception: thrown bare into the
                    # awaiting task, it could end the event loop.
                    future.set_exception(exc if isinstance(exc, Exception) else EnvExit(exc))
                else:
                    future.set_result(result)
                finally:
                    with self._lock:
                        self.busy -= 1
                        if future.abandoned:
                            self._abandoned -= 1
                        # A thread started for an abandoned call's queue leaves once
                        # that call returns.
                        surplus = len(self._threads) > self.size + self._abandoned
                        if surplus:
                            self._threads.remove(threading.current_thread())
                    del future, fn, args, kwargs
                if surplus:
                    return
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """With ``wait``, wait for the running calls (never while a call may hang)."""
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                while True:
                    try:
                        work = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if work is not None:
                        work[0].cancel()
            self._queue.put(None)
        if wait:
            for thread in list(self._threads):
                thread.join()


class CreateTimeout(Exception):
    """The factory ran past the lifecycle timeout: the open fails; the env, if ever born,
    is closed then (its slot is held until then)."""


class CloseAbandoned(Exception):
    """The close ran past the lifecycle timeout: the env keeps its slot until it returns."""


class Lifecycle:
    """The one place envs run off the loop are made and closed, and a hung make or close
    is given up on: two pools, so a hung close never delays an open, and one ``timeout``
    (None: none). Whatever happens to a make or a close, the env's slot is freed exactly
    once, when nothing of it runs any more: a close past the timeout is abandoned (logged,
    counted, its thread let go) and frees the slot when it returns."""

    def __init__(self, creates: EnvThreadPool, closes: EnvThreadPool, timeout: float | None):
        self.creates = creates
        self.closes = closes
        self.timeout = timeout
        #: Closes given up on at the timeout, since the start.
        self.closes_abandoned = 0
        self._hung: set[EnvCall] = set()

    @property
    def closes_hung(self) -> int:
        """Abandoned closes that have not returned yet (``openenv_env_closes_hung``)."""
        return len(self._hung)

    async def make(self, factory: Callable[[], Any], release: Callable[[], None]) -> Any:
        """``factory()`` on a create thread. If this call is cancelled or times out, it
        owns ``release``: a factory still queued never runs (freed now); a running one
        is left on its thread, and the env it makes, if any, is closed (freed then).

        Raises:
            CreateTimeout: the factory ran past the timeout (counted from its submission).
            Exception: what the factory raised (``release`` is the caller's then).
        """
        loop = asyncio.get_running_loop()
        call = self.creates.submit(factory)
        waiter = asyncio.wrap_future(call)
        try:
            done, _ = await asyncio.wait((waiter,), timeout=self.timeout)
        except asyncio.CancelledError:
            _let_go(waiter)
            self._close_when_made(loop, call, release)
            raise
        if done:
            return waiter.result()
        _let_go(waiter)
        if call.cancel():  # still queued: it never runs
            release()
        else:
            self.creates.abandon(call)
            log.error(
                "an environment's factory did not return within %gs: the open failed; the "
                "env is closed if it is ever made, and holds its slot until then", self.timeout,
            )  # fmt: skip
            self._close_when_made(loop, call, release)
        raise CreateTimeout(
            f"the environment was not made within {self.timeout:g}s (--lifecycle-timeout): "
            "nothing was kept, open again"
        )

    def _close_when_made(
        self, loop: asyncio.AbstractEventLoop, call: EnvCall, release: Callable[[], None]
    ) -> None:
        """Close the env ``call`` makes once it is made (on a close thread: a create thread
        is free, and never on the event loop); free its slot then, or at once if none."""

        def made(finished: concurrent.futures.Future[Any]) -> None:
            if finished.cancelled() or finished.exception() is not None:
                if not finished.cancelled():
                    log.error(
                        "an abandoned environment's factory raised", exc_info=_cause(finished)
                    )
                _on_loop(loop, release)
                return
            try:
                self.close_later(loop, finished.result().close, release)
            except BaseException:  # shut down (the process is exiting), or no close at all
                log.exception("an abandoned environment could not be closed")
                _on_loop(loop, release)

        call.add_done_callback(made)  # on the factory's thread; here, at once, if done

    async def close(self, close: Callable[[], Any], release: Callable[[], None]) -> None:
        """``close()`` on a close thread, awaited; ``release()`` runs on the loop once it
        returns, whenever that is (past the timeout, or after this call was cancelled).

        Raises:
            CloseAbandoned: the close ran past the timeout (it is abandoned).
            Exception: what ``close`` raised.
            RuntimeError: the pool was shut down (nothing ran, nothing is freed).
        """
        call = self._submit_close(asyncio.get_running_loop(), close, release)
        waiter = asyncio.wrap_future(call)
        try:
            done, _ = await asyncio.wait((waiter,), timeout=self.timeout)
        except asyncio.CancelledError:
            _unobserved(waiter, call)
            raise
        if not done:
            # Not waiter.cancel(): a close still queued would never run.
            _unobserved(waiter, call)
            self.abandon_close(call)
            raise CloseAbandoned(
                f"close did not finish within {self.timeout:g}s (--lifecycle-timeout); the "
                "environment was abandoned and its slot is freed when its close returns"
            )
        waiter.result()

    async def close_async(
        self, close: Callable[[], Awaitable[Any]], release: Callable[[], None]
    ) -> None:
        """An async env's ``close()``, on the loop, then ``release()`` (always). Past the
        timeout it is cancelled: nothing of it keeps running.

        Raises:
            CloseAbandoned: the close ran past the timeout (it was cancelled).
            Exception: what ``close`` raised.
        """
        try:
            await asyncio.wait_for(close(), self.timeout)
        except asyncio.TimeoutError:
            log.error("an environment's async close() did not return within %gs: cancelled",
                      self.timeout)  # fmt: skip
            raise CloseAbandoned(
                f"close did not finish within {self.timeout:g}s (--lifecycle-timeout); it "
                "was cancelled"
            ) from None
        finally:
            release()

    def close_later(
        self, loop: asyncio.AbstractEventLoop, close: Callable[[], Any], release: Callable[[], None]
    ) -> None:
        """:meth:`close` with nobody waiting, from any thread: what it raises is logged.

        Raises:
            RuntimeError: the pool was shut down.
        """
        self._submit_close(loop, close, release, unobserved=True)

    def _submit_close(
        self,
        loop: asyncio.AbstractEventLoop,
        close: Callable[[], Any],
        release: Callable[[], None],
        *,
        unobserved: bool = False,
    ) -> EnvCall:
        """Run ``close`` on ``closes``, ``release`` on ``loop`` after it, and watch it for
        the timeout from ``loop``; ``unobserved``: log what it raises first."""
        call = self.closes.submit(close)
        if unobserved:  # logged before its slot can be taken again
            call.add_done_callback(_log_failure)
        # Added before any waiter's (``wrap_future``): the slot is freed on the loop before
        # the close's awaiter resumes, so a client that closes and opens again finds it.
        call.add_done_callback(lambda _: _on_loop(loop, release))
        if self.timeout is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._expire, loop, call)
        return call

    def _expire(self, loop: asyncio.AbstractEventLoop, call: EnvCall) -> None:
        """Abandon ``call`` past the timeout, counted from when a thread took it; until
        then, check again when it would be due."""
        if call.done() or call.abandoned:
            return
        assert self.timeout is not None
        started = call.started_at
        left = self.timeout if started is None else started + self.timeout - time.monotonic()
        if left > 0:
            loop.call_later(left, self._expire, loop, call)
            return
        self.abandon_close(call)

    def abandon_close(self, call: EnvCall) -> None:
        """Count, log and let go ``call`` if it has run past the timeout (one queued, or
        started late, is left to its watch)."""
        if call in self._hung or call.done():
            return
        assert self.timeout is not None
        started = call.started_at
        if started is not None and started + self.timeout > time.monotonic():
            return
        if started is None:
            log.warning(
                "an environment's close() waited %gs for a close thread (%d hung): the session "
                "ends; the env is closed, and its slot freed, once a thread takes it",
                self.timeout, len(self._hung),
            )  # fmt: skip
            return
        self.closes.abandon(call)
        self.closes_abandoned += 1
        self._hung.add(call)
        call.add_done_callback(self._hung.discard)
        log.error(
            "an environment's close() did not return within %gs: abandoned on its thread "
            "(%d hung now, %d since the start); its env keeps its slot until close() returns",
            self.timeout, len(self._hung), self.closes_abandoned,
        )  # fmt: skip

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.creates.shutdown(wait, cancel_futures=cancel_futures)
        self.closes.shutdown(wait, cancel_futures=cancel_futures)


@functools.cache
def untimed() -> Lifecycle:
    """The lifecycle of runners made without one (tests, benches, an env process, whose
    envs run on its loop): no timeout; threads only once something is made off the loop."""
    return Lifecycle(EnvThreadPool(4, "env-create"), EnvThreadPool(4, "env-close"), None)


def _on_loop(loop: asyncio.AbstractEventLoop, release: Callable[[], None]) -> None:
    """Run ``release`` on ``loop``; nothing if the loop is closed (the server stopped)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(release)


def _log_failure(call: concurrent.futures.Future[Any]) -> None:
    if not call.cancelled() and call.exception() is not None:
        log.error("closing an abandoned environment raised", exc_info=_cause(call))


def _cause(call: concurrent.futures.Future[Any]) -> BaseException | None:
    """What env code raised in ``call`` (an ``EnvExit``'s original, with its traceback)."""
    exc = call.exception()
    return exc.original if isinstance(exc, EnvExit) else exc


def _unobserved(waiter: asyncio.Future[Any], call: concurrent.futures.Future[Any]) -> None:
    """A close nobody awaits any more: what it raises is logged by us, once."""
    _let_go(waiter)
    call.add_done_callback(_log_failure)


def _let_go(waiter: asyncio.Future[Any]) -> None:
    """Nobody awaits ``waiter`` any more: its exception, if any, is logged elsewhere (not
    by asyncio as "never retrieved")."""
    waiter.add_done_callback(lambda done: done.cancelled() or done.exception())
