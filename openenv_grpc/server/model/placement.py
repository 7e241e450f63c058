"""Where a measured env's calls run: on the event loop while they are cheap, on the thread
pool when they are not (``runs_inline = None``, see ``environment.py``).

Calls are grouped by method name (``reset``, ``step``, ``state``, ...) and by the
instance's :meth:`~openenv_grpc.environment.Environment.cost_class` (e.g. the gymnasium
env's env id), across every session of the server process. A group starts on the pool,
where each call is timed on its thread; it moves to the loop after :data:`PROBATION` calls
in a row that each took at most half the threshold. On the loop a call cannot be
interrupted, only timed once it returns: a call over the threshold is a strike, and the
group moves back to the pool at a second strike within :data:`STRIKE_WINDOW` calls, or at
once for a call over :data:`STALL_FACTOR` times the threshold. Every move back doubles the
run of cheap calls the next move to the loop needs, so an env whose cost sits near the
threshold settles on the pool instead of flapping.

What counts is the env's own cost: a call that took long only because the OS ran other
processes meanwhile (it neither blocked nor used more CPU than allowed: the thread's CPU
clock and its count of voluntary context switches say so) is neither a strike nor a cheap
call. A loaded machine therefore does not push cheap envs off the loop; a call that
sleeps, waits on I/O or a lock, or computes, does count. An env whose calls wait only on
compute threads of its own (EnvPool's workers: ``BatchEnvironment.computes_in_threads``)
blocks on every call, so its groups are judged by the process's CPU during the call
instead (``by_process``): the time the OS gave other processes meanwhile is not its own.

Each move is logged (INFO to the loop, WARNING back to the pool with what the call took),
so an operator can see which calls blocked the loop and for how long.

All group state is touched on the event loop only (a pooled call's timing is recorded
after its future resolved), so it needs no lock.
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
    "switches",
]

log = logging.getLogger(__name__)

#: Cheap pooled calls in a row (each at most half the threshold) before a group moves to
#: the loop; doubled at every move back.
PROBATION: Final = 32
#: A second call over the threshold within this many calls on the loop moves the group
#: back (one alone may be a garbage collection: tolerated).
STRIKE_WINDOW: Final = 64
#: One call on the loop taking this many times the threshold moves the group back at once.
STALL_FACTOR: Final = 50
#: Groups measured per server process; calls of groups beyond it stay on the pool.
MAX_GROUPS: Final = 1024

_RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)


def batch_threshold(threshold: float, size: int) -> float:
    """The inline threshold of a batch call over ``size`` envs: ``size`` times one env
    call's ``threshold``, at most the interpreter's switch interval (5 ms), never less
    than ``threshold``.

    Why the switch interval: a pooled call that holds the GIL keeps the event loop waiting
    up to that long anyway before the loop gets the GIL back, so a GIL-bound batch under it
    blocks the loop no longer inline than pooled, and inline it saves the thread hop and
    the loop's wake-up (for 64 CartPoles, ~0.6 ms of env work, a third of the server's CPU
    per vector step).
    """
    return max(threshold, min(threshold * size, sys.getswitchinterval()))


def switches() -> int:
    """Voluntary context switches of this thread so far (it blocked: slept, waited on I/O,
    a lock or the GIL); -1 where the OS does not count them per thread."""
    if _RUSAGE_THREAD is None:
        return -1
    return resource.getrusage(_RUSAGE_THREAD).ru_nvcsw


def own_cost(cpu_before: float, switches_before: int, limit: float) -> tuple[float, bool]:
    """Since ``thread_time()`` was ``cpu_before`` and :func:`switches` ``switches_before``
    on this thread: its CPU seconds, and whether the time counts as the call's own (the
    thread blocked, or computed more than ``limit``) rather than lost to other processes.
    """
    cpu = thread_time() - cpu_before
    blocked = switches_before < 0 or switches() != switches_before
    return cpu, blocked or cpu > limit


class CostGroup:
    """The calls of one method of one cost class, and where they run now."""

    __slots__ = ("_calls", "_last_strike", "_longest", "_placement", "_streak", "by_process",
                 "inline", "name", "probation")  # fmt: skip

    def __init__(self, placement: CallPlacement, name: str, by_process: bool = False) -> None:
        self._placement = placement
        #: A slow call is judged by the process's CPU during it, not by its thread's
        #: waits: the env's calls wait on compute threads of its own.
        self.by_process = by_process
        #: How logs name the group: ``env.method [cost class]``.
        self.name = name
        #: Calls run on the event loop now (else on the pool).
        self.inline = False
        #: Cheap pooled calls in a row this group needs before moving to the loop.
        self.probation = PROBATION
        self._streak = 0
        self._longest = 0.0  # of the current streak, for the log line
        self._calls = 0  # calls run on the loop since the group last moved there
        self._last_strike = -STRIKE_WINDOW - 1

    def call_inline(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` here (on the event loop), timed; returns what it returned.

        Raises:
            Exception: whatever ``method`` raised (the call is counted all the same).
        """
        cpu, switched, started = thread_time(), switches(), perf_counter()
        process = process_time() if self.by_process else 0.0
        try:
            return method(*args, **kwargs)
        finally:
            seconds = perf_counter() - started
            limit = self._placement.threshold
            if seconds <= limit:
                self._calls += 1  # the common case, kept short
            elif self.by_process:
                used = process_time() - process
                self.ran_inline(seconds, used, used > limit)
            else:
                self.ran_inline(seconds, *own_cost(cpu, switched, limit))

    def pooled(self, method: Callable[..., Any]) -> PooledCall:
        """A timed call of ``method`` to submit to the pool (see :class:`PooledCall`)."""
        return PooledCall(self, method, self._placement.promote_below)

    def ran_inline(self, seconds: float, cpu: float, own: bool) -> None:
        """Count one call that took ``seconds`` (``cpu`` of them on the CPU) on the loop;
        ``own``: that time was the call's own, not lost to other processes. Moves the
        group back to the pool if the call was slow."""
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
        self.probation *= 2
        log.warning(
            "env calls %s move to the thread pool: one took %s on the event loop (%s of "
            "it CPU; threshold %s), blocking every other session meanwhile; back on the loop "
            "after %d calls in a row under %s",
            self.name, _duration(seconds), _duration(cpu), _duration(placement.threshold),
            self.probation, _duration(placement.promote_below),
        )  # fmt: skip

    def ran_pooled(self, seconds: float, own: bool) -> None:
        """Count one call that took ``seconds`` on a pool thread (``own``: that time was
        the call's own, not lost to other processes); move the group to the loop after
        enough cheap ones in a row."""
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
            self._last_strike = -STRIKE_WINDOW - 1
            log.info(
                "env calls %s now run on the event loop: %d in a row took at most %s "
                "(under half of the %s threshold)",
                self.name, self._streak, _duration(self._longest),
                _duration(placement.threshold),
            )  # fmt: skip


class PooledCall:
    """One call of a measured env on a pool thread: :meth:`run` there, :meth:`record` on
    the event loop once it returned (the wait for a thread is not the env's cost)."""

    __slots__ = ("_group", "_limit", "_method", "_own", "_seconds")

    def __init__(self, group: CostGroup, method: Callable[..., Any], limit: float) -> None:
        self._group = group
        self._method = method
        self._limit = limit  # longer than this, find out whether the time was its own
        self._seconds = 0.0
        self._own = True

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Call the method, timed (on the pool thread); returns what it returned.

        Raises:
            Exception: whatever the method raised (its time is kept all the same).
        """
        by_process = self._group.by_process
        cpu, switched, started = thread_time(), switches(), perf_counter()
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
                    self._own = own_cost(cpu, switched, limit)[1]

    def record(self) -> None:
        """Count the finished call in its group (on the event loop)."""
        self._group.ran_pooled(self._seconds, self._own)


class CallPlacement:
    """The cost groups of one env class in one server process.

    Args:
        threshold: Seconds: calls that take longer do not belong on the event loop.
        env_name: The env's name, for log lines.

    Raises:
        ValueError: ``threshold`` is not positive.
    """

    def __init__(self, threshold: float, env_name: str) -> None:
        if threshold <= 0:
            raise ValueError(f"the inline threshold must be > 0 seconds, got {threshold}")
        self.threshold = threshold
        #: A pooled call at most this long counts toward moving its group to the loop.
        self.promote_below = threshold / 2
        #: One call on the loop longer than this moves its group back at once.
        self.stall = threshold * STALL_FACTOR
        self._env_name = env_name
        self._groups: dict[tuple[str, str], CostGroup] = {}
        #: Shared by the calls of every group beyond MAX_GROUPS: never moved to the loop.
        self._overflow = _Unmeasured(self, f"{env_name} (groups beyond {MAX_GROUPS})")

    def group(self, cost_class: str, method: str, by_process: bool = False) -> CostGroup:
        """The group of ``method`` calls for instances of ``cost_class`` (made on first use,
        judged ``by_process`` CPU if asked then; beyond :data:`MAX_GROUPS` a shared group
        that stays on the pool)."""
        key = (cost_class, method)
        found = self._groups.get(key)
        if found is not None:
            return found
        if len(self._groups) >= MAX_GROUPS:
            if not self._overflow.warned:
                self._overflow.warned = True
                log.warning(
                    "%s: more than %d cost groups (methods x cost_class() values); calls of "
                    "new ones stay on the thread pool",
                    self._env_name, MAX_GROUPS,
                )  # fmt: skip
            return self._overflow
        name = f"{self._env_name}.{method}" + (f" [{cost_class[:80]}]" if cost_class else "")
        made = self._groups[key] = CostGroup(self, name, by_process)
        return made


class _Unmeasured(CostGroup):
    """A group whose calls stay on the pool whatever they cost."""

    __slots__ = ("warned",)

    def __init__(self, placement: CallPlacement, name: str) -> None:
        super().__init__(placement, name)
        self.warned = False

    def ran_pooled(self, seconds: float, own: bool) -> None:
        pass


def _duration(seconds: float) -> str:
    """``seconds`` for a log line, in the unit that reads best (µs, ms or s)."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"
