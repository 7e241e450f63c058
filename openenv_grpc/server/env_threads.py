"""The threads that run blocking env code: a bounded pool that knows which calls started.

Why not ``concurrent.futures.ThreadPoolExecutor``:

- a step timeout counts from when the env call *starts*, not from when it was queued, so
  each call records the moment a thread picked it up (:attr:`EnvCall.started_at`);
- a saturated pool is reported as such, so the pool counts its busy threads;
- its threads are daemons: an env call that never returns must not keep a drained server
  from exiting (``ThreadPoolExecutor`` threads are joined by an ``atexit`` hook of
  ``concurrent.futures``, so one hung call would block the exit for ever).

Threads start on demand up to ``size`` and then stay, like ``ThreadPoolExecutor``'s.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["EnvCall", "EnvThreadPool"]


class EnvCall(concurrent.futures.Future[Any]):
    """A future that also records when a pool thread started running it."""

    def __init__(self) -> None:
        super().__init__()
        #: ``time.monotonic()`` when a thread picked the call up; None while queued.
        self.started_at: float | None = None


_Work = tuple[EnvCall, Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class EnvThreadPool(concurrent.futures.Executor):
    """At most ``size`` daemon threads running submitted calls in order of submission."""

    def __init__(self, size: int, name: str) -> None:
        if size < 1:
            raise ValueError(f"thread pool size must be >= 1, got {size}")
        self.size = size
        self._name = name
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        # Counts threads waiting for work, as ThreadPoolExecutor does: a submit that
        # finds one idle starts no new thread.
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._busy = 0
        self._shutdown = False

    @property
    def busy(self) -> int:
        """Threads running a call now."""
        return self._busy

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> EnvCall:
        """Queue ``fn(*args, **kwargs)``; returns its future.

        Raises:
            RuntimeError: the pool was shut down.
        """
        future = EnvCall()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot run env calls after the pool was shut down")
            self._queue.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self.size:
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
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
            if future.set_running_or_notify_cancel():
                with self._lock:
                    self._busy += 1
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # as ThreadPoolExecutor: the caller sees it
                    future.set_exception(exc)
                else:
                    future.set_result(result)
                finally:
                    with self._lock:
                        self._busy -= 1
                    del future, fn, args, kwargs
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Accept no more calls; with ``cancel_futures``, cancel those still queued; with
        ``wait``, wait for the running ones (never use it while a call may hang)."""
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
            for thread in self._threads:
                thread.join()
