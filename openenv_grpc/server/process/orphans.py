"""Runs the env's ``reclaim_orphans`` hook: once at server start, and after each isolated
worker process dies (:class:`OrphanReaper`). Never on the event loop; what it raises is
logged.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["OrphanReaper", "reclaim_orphans_quietly"]

log = logging.getLogger(__name__)

#: Seconds a worker that closed its end of the pipe may take to exit before it is killed.
_EXIT_WAIT = 5.0


def reclaim_orphans_quietly(env_class: type[Any]) -> None:
    """Call ``env_class.reclaim_orphans()``, logging what it raises."""
    try:
        env_class.reclaim_orphans()
    except BaseException:  # env code's SystemExit too: the reaper must outlive it
        log.exception("%s.reclaim_orphans() raised", env_class.__qualname__)


class OrphanReaper:
    """A thread that reaps dead worker processes, then calls the hook (only then: a
    zombie still holds its pid). Reaps asked for while it runs get one more call."""

    def __init__(self, env_class: type[Any]) -> None:
        self._env_class = env_class
        self._lock = threading.Lock()
        self._dead: list[Any] = []  # multiprocessing.Process objects to reap
        self._wanted = False
        self._thread: threading.Thread | None = None

    def reap(self, process: Any) -> None:
        """Reap ``process`` (a worker that died or was killed), then reclaim. Never blocks."""
        with self._lock:
            self._dead.append(process)
            self._wanted = True
            if self._thread is None:
                # A daemon: a hook that hangs must not keep the server from exiting.
                self._thread = threading.Thread(
                    target=self._run, name="openenv-orphan-reaper", daemon=True
                )
                self._thread.start()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for pending reaps and reclaims; True when none is left."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._wanted:
                    self._thread = None
                    return
                dead, self._dead, self._wanted = self._dead, [], False
            for process in dead:
                _reap(process)
            reclaim_orphans_quietly(self._env_class)


def _reap(process: Any) -> None:
    process.join(_EXIT_WAIT)
    if process.is_alive():
        log.warning("env worker pid %s did not exit: killing it", process.pid)
        process.kill()
        process.join(1.0)
    log.info("env worker pid %s exited with %s", process.pid, process.exitcode)
