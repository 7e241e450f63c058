"""The threads blocking env code runs on, and :class:`Lifecycle`, the create and close
pools. Not ``ThreadPoolExecutor``: a call records when it started (a timeout counts from
there), the pool counts busy threads (to report saturation), and its threads are daemons
(``ThreadPoolExecutor``'s are joined at exit: one hung call would block it for ever).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from openenv_grpc.server.errors import EnvExit

__all__ = ["EnvCall", "EnvThreadPool", "Lifecycle"]

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


class Lifecycle(concurrent.futures.Executor):
    """Where envs are made (``submit``) and closed: two pools, so a hung close never
    delays an open, and one ``timeout`` (None: none). A close past it is abandoned:
    logged, counted, its thread let go; its env keeps its slot until it returns."""

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

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> EnvCall:
        return self.creates.submit(fn, *args, **kwargs)

    def close(
        self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], /, *args: Any
    ) -> EnvCall:
        """Run the close ``fn(*args)`` on ``closes``, watched by ``loop`` for the timeout;
        from any thread.

        Raises:
            RuntimeError: the pool was shut down.
        """
        call = self.closes.submit(fn, *args)
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
