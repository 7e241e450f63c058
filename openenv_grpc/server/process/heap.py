"""Gives the heap memory the server has freed back to the kernel, every few seconds.

glibc keeps freed memory inside its per-thread arenas: after 48 streams had each buffered
15 MiB of an unfinished request in grpc-core and their connection closed, everything was
freed yet the server's resident memory stayed +578 MiB until something called
``malloc_trim`` (then +2 MiB). gRPC's threads allocate in arenas of their own, whose
free pages glibc returns only on ``malloc_trim``; ``MALLOC_ARENA_MAX=1`` would return them
too, at the price of one lock for every allocating thread. A trim that finds nothing to
return costs well under a millisecond; one that returns 700 MiB about 0.1 s, on a daemon
thread, without the GIL (ctypes releases it), so the event loop never waits for it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable

__all__ = ["TRIM_INTERVAL", "malloc_trim", "start_heap_trimmer"]

log = logging.getLogger(__name__)

#: Seconds between two trims.
TRIM_INTERVAL = 5.0

_started: threading.Thread | None = None
_lock = threading.Lock()


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None on a libc without it (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        function = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function


_malloc_trim = _load_malloc_trim()


def malloc_trim() -> bool:
    """Return the heap's free pages to the kernel now; False if nothing could be returned
    (or this libc has no ``malloc_trim``)."""
    return _malloc_trim is not None and bool(_malloc_trim(0))


def start_heap_trimmer(interval: float = TRIM_INTERVAL) -> bool:
    """Trim every ``interval`` seconds on a daemon thread, once per process (later calls
    do nothing). Returns whether trimming runs (False without glibc)."""
    global _started
    if _malloc_trim is None:
        return False
    with _lock:
        if _started is None or not _started.is_alive():
            _started = threading.Thread(
                target=_trim_forever, args=(interval,), name="openenv-heap-trim", daemon=True
            )
            _started.start()
    return True


def _trim_forever(interval: float) -> None:
    wake = threading.Event()  # never set: a sleep that does not hold the GIL
    while True:
        wake.wait(interval)
        try:
            malloc_trim()
        except Exception:  # pragma: no cover - a libc that misbehaves must not kill us
            log.exception("malloc_trim failed; heap trimming stops")
            return
