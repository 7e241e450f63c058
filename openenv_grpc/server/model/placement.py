"""Where a measured env's calls run (``runs_inline = None``): on the event loop while
they are cheap, on the thread pool when not, per group of method and ``cost_class()``.

A group starts on the pool and moves to the loop after :data:`PROBATION` cheap calls in
a row; it moves back at a second slow call within :data:`STRIKE_WINDOW` calls, or one over
:data:`STALL_FACTOR` times the threshold; each move back doubles the probation, a stall
multiplies it by :data:`STALL_FACTOR` (a client whose actions choose how long a step
takes would otherwise stall every session again after each doubling: 11 one-second
stalls in 25 s, measured). Only the
env's own cost counts: time the OS gave other processes (the call neither blocked nor
used the CPU) is no strike. Group state is touched on the event loop only: no lock.

A call on the loop is timed by the wall clock alone: the thread's CPU time and context
switches are system calls (about 2.4 µs a call here), so they are read only for the
:data:`STRIKE_WINDOW` calls after a slow one. The first slow call is taken as the
env's own (a strike, or a stall); those after it are judged by what they cost.
"""

from __future__ import annotations

import logging
import resource
import sys
from collections.abc import Callable
from time import perf_counter, process_time, thread_time
from typing import Any, Final

__all__ = [
    "MAX_GROUPS",
    "PROBATION",
    "STALL_FACTOR",
    "STRIKE_WINDOW",
    "CallPlacement",
    "CostGroup",
    "PooledCall",
    "batch_threshold",
    "own_cost",
    "thread_usage",
]

log = logging.getLogger(__name__)

#: Cheap pooled calls in a row (each at most half the threshold) before a group moves.
PROBATION: Final = 32
#: One slow call alone (a garbage collection, say) is tolerated; a second within this many.
STRIKE_WINDOW: Final = 64
STALL_FACTOR: Final = 50
#: Groups measured per server process; calls of groups beyond it stay on the pool.
MAX_GROUPS: Final = 1024

_RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)


def batch_threshold(threshold: float, size: int) -> float:
    """The inline threshold of a batch call over ``size`` envs: ``size`` times
    ``threshold``, capped at the GIL's switch interval (a pooled GIL-bound call blocks the
    loop that long anyway), never under ``threshold``."""
    return max(threshold, min(threshold * size, sys.getswitchinterval()))


def thread_usage() -> tuple[float, int]:
    """This thread's CPU seconds and voluntary context switches so far (switches -1 where
    not counted). The CPU time is ``thread_time()``'s: ``getrusage``'s is the scheduler's
    last account of it, up to a tick old (a 2 ms call read as 3 ms of CPU, measured)."""
    if _RUSAGE_THREAD is None:
        return thread_time(), -1
    return thread_time(), resource.getrusage(_RUSAGE_THREAD).ru_nvcsw


def own_cost(before: tuple[float, int], limit: float) -> tuple[float, bool]:
    """This thread's CPU seconds since ``before`` (a :func:`thread_usage`), and whether
    the time was the call's own (it blocked, or computed more than ``limit``)."""
    cpu, switched = thread_usage()
    cpu -= before[0]
    blocked = before[1] < 0 or switched != before[1]
    return cpu, blocked or cpu > limit


class CostGroup:
    """The calls of one method of one cost class, and where they run now."""

    __slots__ = ("_calls", "_careful", "_last_strike", "_longest", "_placement", "_streak",
                 "by_process", "inline", "name", "probation")  # fmt: skip

    def __init__(self, placement: CallPlacement, name: str, by_process: bool = False) -> None:
        self._placement = placement
        #: Slow calls are judged by the process's CPU (the env computes in its own threads).
        self.by_process = by_process
        self.name = name
        self.inline = False
        self.probation = PROBATION
        self._streak = 0
        self._longest = 0.0  # of the current streak, for the log line
        self._calls = 0  # calls run on the loop since the group last moved there
        self._last_strike = -STRIKE_WINDOW - 1
        #: Calls on the loop still to be judged by their CPU time and context switches.
        self._careful = 0

    def call_inline(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` on the event loop, timed (also when it raises)."""
        careful = self._careful
        if careful:  # a slow call came lately: measure what this one costs the thread
            usage = thread_usage()
            process = process_time() if self.by_process else 0.0
        started = perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds = perf_counter() - started
            limit = self._placement.threshold
            if seconds <= limit:
                self._calls += 1  # the common case, kept short
                if careful:
                    self._careful = careful - 1
            elif not careful:  # unmeasured: the env's own, and the next calls measured
                self._careful = STRIKE_WINDOW
                self.ran_inline(seconds, -1.0, True)
            elif self.by_process:
                used = process_time() - process
                self.ran_inline(seconds, used, used > limit)
            else:
                self.ran_inline(seconds, *own_cost(usage, limit))

    def pooled(self, method: Callable[..., Any]) -> PooledCall:
        return PooledCall(self, method, self._placement.promote_below)

    def ran_inline(self, seconds: float, cpu: float, own: bool) -> None:
        """Count a call on the loop (``own``: its time was its own; ``cpu`` < 0: not
        measured); a slow one may move the group back to the pool."""
        self._calls += 1
        placement = self._placement
        if seconds <= placement.threshold:
            return
        if not own:
            return  # the OS ran other processes: the machine was busy, not the env
        calls = self._calls
        if seconds <= placement.stall and calls - self._last_strike > STRIKE_WINDOW:
            self._last_strike = calls  # the first strike: tolerated
            return
        self.inline = False
        self._streak = 0
        self._longest = 0.0
        self.probation *= STALL_FACTOR if seconds > placement.stall else 2
        log.warning(
            "env calls %s move to the thread pool: one took %s on the event loop (%s; "
            "threshold %s), blocking every other session meanwhile; back on the loop after "
            "%d calls in a row under %s",
            self.name, _duration(seconds),
            f"{_duration(cpu)} of it CPU" if cpu >= 0 else "its CPU not measured",
            _duration(placement.threshold), self.probation, _duration(placement.promote_below),
        )  # fmt: skip

    def ran_pooled(self, seconds: float, own: bool) -> None:
        """Count a call on a pool thread; enough cheap ones in a row move the group to
        the loop."""
        placement = self._placement
        if self.inline:
            return  # moved to the loop while this call ran: nothing left to decide
        if seconds > placement.promote_below:
            if own:
                self._streak = 0
                self._longest = 0.0
            return  # else the machine was busy: neither cheap nor slow
        self._streak += 1
        self._longest = max(self._longest, seconds)
        if self._streak >= self.probation:
            self.inline = True
            self._calls = 0
            self._careful = 0
            self._last_strike = -STRIKE_WINDOW - 1
            log.info(
                "env calls %s now run on the event loop: %d in a row took at most %s "
                "(under half of the %s threshold)",
                self.name, self._streak, _duration(self._longest),
                _duration(placement.threshold),
            )  # fmt: skip


class PooledCall:
    """One call of a measured env: :meth:`run` on a pool thread, :meth:`record` on the
    event loop once it returned."""

    __slots__ = ("_group", "_limit", "_method", "_own", "_seconds")

    def __init__(self, group: CostGroup, method: Callable[..., Any], limit: float) -> None:
        self._group = group
        self._method = method
        self._limit = limit  # longer than this, find out whether the time was its own
        self._seconds = 0.0
        self._own = True

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Call the method, timed (also when it raises)."""
        by_process = self._group.by_process
        usage, started = thread_usage(), perf_counter()
        process = process_time() if by_process else 0.0
        try:
            return self._method(*args, **kwargs)
        finally:
            self._seconds = seconds = perf_counter() - started
            if seconds > self._limit:
                limit = self._limit
                if by_process:
                    self._own = process_time() - process > limit
                else:
                    self._own = own_cost(usage, limit)[1]

    def record(self) -> None:
        self._group.ran_pooled(self._seconds, self._own)


class CallPlacement:
    """The cost groups of one env class in one server process; ``threshold``: seconds a
    call on the event loop may take.

    Raises:
        ValueError: ``threshold`` is not positive.
    """

    def __init__(self, threshold: float, env_name: str) -> None:
        if threshold <= 0:
            raise ValueError(f"the inline threshold must be > 0 seconds, got {threshold}")
        self.threshold = threshold
        self.promote_below = threshold / 2
        self.stall = threshold * STALL_FACTOR
        self._env_name = env_name
        self._groups: dict[tuple[str, str], CostGroup] = {}
        self._overflow = _Unmeasured(self, f"{env_name} (groups beyond {MAX_GROUPS})")
        self._overflowed = False

    def group(self, cost_class: str, method: str, by_process: bool = False) -> CostGroup:
        """Made on first use; beyond :data:`MAX_GROUPS`, a shared group kept on the pool."""
        key = (cost_class, method)
        found = self._groups.get(key)
        if found is not None:
            return found
        if len(self._groups) >= MAX_GROUPS:
            if not self._overflowed:
                self._overflowed = True
                log.warning(
                    "%s: more than %d cost groups (methods x cost_class() values); calls of "
                    "new ones stay on the thread pool",
                    self._env_name, MAX_GROUPS,
                )  # fmt: skip
            return self._overflow
        name = f"{self._env_name}.{method}" + (f" [{cost_class[:80]}]" if cost_class else "")
        self._groups[key] = found = CostGroup(self, name, by_process)
        return found


class _Unmeasured(CostGroup):
    """A group kept on the pool whatever its calls cost."""

    __slots__ = ()

    def ran_pooled(self, seconds: float, own: bool) -> None:
        pass


def _duration(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"
