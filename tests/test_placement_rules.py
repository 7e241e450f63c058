"""The rules that move a group of measured calls between the event loop and the pool, and
the test that tells an env's own time from time the OS gave other processes."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from openenv_grpc import AutoresetMode
from openenv_grpc.server.local.batch import VectorBatch
from openenv_grpc.server.local.runner import EnvRunner
from openenv_grpc.server.model.placement import (
    MAX_GROUPS,
    PROBATION,
    STALL_FACTOR,
    STRIKE_WINDOW,
    CallPlacement,
    CostGroup,
    batch_threshold,
    own_cost,
    thread_usage,
)
from openenv_grpc.server.model.spec import ExecutionMode

THRESHOLD = 0.001
CHEAP = THRESHOLD / 4
SLOW = THRESHOLD * 2


def promoted(group: CostGroup) -> CostGroup:
    for _ in range(group.probation):
        group.ran_pooled(CHEAP, own=True)
    assert group.inline
    return group


@pytest.fixture
def group() -> CostGroup:
    return CallPlacement(THRESHOLD, "env").group("", "step")


def test_a_group_moves_to_the_loop_after_a_run_of_cheap_calls(group, caplog) -> None:
    caplog.set_level(logging.INFO)
    for _ in range(PROBATION - 1):
        group.ran_pooled(CHEAP, own=True)
    assert not group.inline
    group.ran_pooled(CHEAP, own=True)
    assert group.inline
    assert "env calls env.step now run on the event loop: 32 in a row" in caplog.text


def test_only_calls_under_half_the_threshold_count_and_a_slow_one_starts_over(group) -> None:
    for _ in range(PROBATION - 1):
        group.ran_pooled(CHEAP, own=True)
    group.ran_pooled(THRESHOLD * 0.75, own=True)  # under the threshold, not under half
    for _ in range(PROBATION - 1):
        group.ran_pooled(CHEAP, own=True)
    assert not group.inline


def test_time_lost_to_other_processes_is_neither_cheap_nor_slow(group) -> None:
    for _ in range(PROBATION - 1):
        group.ran_pooled(CHEAP, own=True)
    group.ran_pooled(SLOW * 10, own=False)  # preempted: the streak goes on
    group.ran_pooled(CHEAP, own=True)
    assert group.inline
    for _ in range(10):
        group.ran_inline(SLOW * 10, cpu=CHEAP, own=False)  # preempted on the loop: ignored
    assert group.inline


def test_one_slow_call_is_tolerated_a_second_within_the_window_is_not(group, caplog) -> None:
    promoted(group)
    group.ran_inline(SLOW, cpu=SLOW, own=True)
    assert group.inline
    for _ in range(STRIKE_WINDOW - 2):
        group.ran_inline(CHEAP, cpu=CHEAP, own=True)
    group.ran_inline(SLOW, cpu=SLOW, own=True)
    assert not group.inline
    assert group.probation == 2 * PROBATION
    record = next(r for r in caplog.records if "move to the thread pool" in r.message)
    assert record.levelno == logging.WARNING
    assert "one took 2.0 ms on the event loop (2.0 ms of it CPU; threshold 1.0 ms)" in (
        record.message
    )


def test_slow_calls_further_apart_than_the_window_are_tolerated(group) -> None:
    promoted(group)
    for _ in range(5):
        group.ran_inline(SLOW, cpu=SLOW, own=True)
        for _ in range(STRIKE_WINDOW):
            group.ran_inline(CHEAP, cpu=CHEAP, own=True)
    assert group.inline


def test_one_stall_moves_the_group_back_at_once(group) -> None:
    promoted(group)
    group.ran_inline(THRESHOLD * STALL_FACTOR * 1.01, cpu=0.0, own=True)  # slept, say
    assert not group.inline


def test_every_move_back_doubles_the_next_probation(group) -> None:
    for moves in range(1, 5):
        promoted(group)
        for _ in range(2):  # two strikes within the window
            group.ran_inline(SLOW, cpu=SLOW, own=True)
        assert group.probation == PROBATION << moves
    for _ in range(group.probation - 1):
        group.ran_pooled(CHEAP, own=True)
    assert not group.inline  # a near-threshold env spends ever longer on the pool


def test_a_stall_multiplies_the_next_probation_by_the_stall_factor(group) -> None:
    """A client whose action sets how long a step takes (a sleep) could stall every
    session again after each doubling; a stall makes the way back STALL_FACTOR times
    longer."""
    promoted(group)
    group.ran_inline(THRESHOLD * STALL_FACTOR * 2, cpu=0.0, own=True)
    assert group.probation == PROBATION * STALL_FACTOR
    promoted(group)
    group.ran_inline(THRESHOLD * STALL_FACTOR * 2, cpu=0.0, own=True)
    assert group.probation == PROBATION * STALL_FACTOR**2


def test_groups_are_per_method_and_cost_class() -> None:
    placement = CallPlacement(THRESHOLD, "gym")
    step = placement.group("CartPole-v1", "step")
    assert placement.group("CartPole-v1", "step") is step
    assert placement.group("CartPole-v1", "reset") is not step
    assert placement.group("ALE/Pong-v5", "step") is not step
    assert step.name == "gym.step [CartPole-v1]"
    assert placement.group("", "state").name == "gym.state"


def test_calls_of_groups_beyond_the_cap_stay_on_the_pool(caplog) -> None:
    placement = CallPlacement(THRESHOLD, "env")
    for i in range(MAX_GROUPS):
        placement.group(str(i), "step")
    beyond = placement.group("one more", "step")
    assert placement.group("and another", "step") is beyond
    for _ in range(10 * PROBATION):
        beyond.ran_pooled(CHEAP, own=True)
    assert not beyond.inline
    assert caplog.text.count(f"more than {MAX_GROUPS} cost groups") == 1


def test_a_threshold_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        CallPlacement(0.0, "env")


def test_sleeping_counts_as_the_calls_own_time() -> None:
    before = thread_usage()
    time.sleep(0.02)
    assert own_cost(before, THRESHOLD)[1]


def test_computing_past_the_limit_counts_as_the_calls_own_time() -> None:
    before = thread_usage()
    # Counted in this thread's CPU time, not the wall's: on a loaded machine 20 ms of wall
    # time can hold less than the threshold of CPU.
    deadline = time.thread_time() + 0.02
    while time.thread_time() < deadline:
        pass
    spent, own = own_cost(before, THRESHOLD)
    assert own and spent > THRESHOLD


def test_a_calls_cpu_is_measured_to_the_microsecond_not_the_tick() -> None:
    """``getrusage``'s thread CPU time is the scheduler's last account (up to a tick old):
    a 2 ms call read as 3 ms of CPU, its own, and moved a cheap env to the pool. Half a
    millisecond of computing (or what of it the OS let it run) reads as some CPU, under
    the threshold: not as none, nor as a tick's worth."""
    before = thread_usage()
    deadline = time.perf_counter() + 0.0005
    while time.perf_counter() < deadline:
        pass
    spent, _ = own_cost(before, THRESHOLD)
    assert 0 < spent < THRESHOLD


def test_a_short_computation_is_not_the_calls_own_slowness() -> None:
    """What a preempted cheap call looks like from inside: no block, little CPU."""
    before = thread_usage()
    sum(range(100))
    spent, own = own_cost(before, 0.5)
    assert not own and spent < 0.5


def test_the_calls_of_a_measured_env_are_counted_where_they_ran(group) -> None:
    def cheap(x: int) -> int:
        return x + 1

    for _ in range(PROBATION):
        call = group.pooled(cheap)
        assert call.run(1) == 2  # on a pool thread, in the server
        call.record()  # back on the loop
    assert group.inline
    assert group.call_inline(cheap, 2) == 3

    def stall() -> None:
        time.sleep(THRESHOLD * STALL_FACTOR * 1.2)

    group.call_inline(stall)
    assert not group.inline


def test_a_batch_call_is_held_to_n_calls_up_to_the_switch_interval() -> None:
    switch = sys.getswitchinterval()
    assert batch_threshold(0.001, 1) == 0.001
    assert batch_threshold(0.0001, 4) == pytest.approx(0.0004)
    assert batch_threshold(0.001, 64) == switch  # capped: pooled, the GIL waits that long
    assert batch_threshold(0.050, 64) == 0.050  # never below one call's threshold


def test_a_group_judged_by_process_cpu_ignores_waits_and_counts_computing() -> None:
    """A batch that waits on compute threads of its own (EnvPool's workers) blocks on
    every call: judged by the process's CPU, a call that only waited is neither a strike
    on the loop nor the end of a cheap streak on the pool; one that computed past the
    limit is a strike. A group judged by its thread's waits moves back at once."""
    placement = CallPlacement(THRESHOLD, "env")
    threaded = placement.group("envpool", "step", by_process=True)
    waits = placement.group("gymnasium", "step")
    assert threaded.by_process and not waits.by_process
    for group in (threaded, waits):
        promoted(group)

    def wait() -> None:
        time.sleep(SLOW * 2)  # a handoff to workers that other processes held up

    for _ in range(4):
        threaded.call_inline(wait)
        waits.call_inline(wait)
    assert threaded.inline and not waits.inline

    def compute() -> None:  # CPU past the limit, however busy the machine is
        deadline = time.process_time() + SLOW * 2
        while time.process_time() < deadline:
            pass

    threaded.call_inline(compute)
    threaded.call_inline(compute)  # a second strike within the window
    assert not threaded.inline

    pooled = placement.group("envpool", "reset", by_process=True)
    for _ in range(PROBATION - 1):
        pooled.ran_pooled(CHEAP, own=True)
    call = pooled.pooled(wait)
    call.run()
    call.record()  # waited, past the threshold, but not its own time: the streak goes on
    pooled.ran_pooled(CHEAP, own=True)
    assert pooled.inline


def test_a_batch_that_computes_in_threads_gets_groups_judged_by_process_cpu() -> None:
    """The runner asks a measured batch ``computes_in_threads()`` for the group it makes."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from openenv_grpc.server.local.batch import VectorBatch
    from openenv_grpc.server.local.runner import EnvRunner
    from openenv_grpc.server.model.spec import ExecutionMode

    class Threaded(VectorBatch):
        def computes_in_threads(self) -> bool:
            return True

        def cost_class(self) -> str:
            return "pool"

        def step(self) -> str:
            return "stepped"

    async def main() -> bool:
        placement = CallPlacement(THRESHOLD, "env")
        with ThreadPoolExecutor(1) as pool:
            runner = EnvRunner(
                Threaded(1, AutoresetMode.NEXT_STEP), ExecutionMode.MEASURED, pool,
                placement=placement,
            )  # fmt: skip
            assert await runner.call(runner.env.step) == "stepped"
        return placement.group("pool", "step").by_process

    assert asyncio.run(main())


def test_a_cheap_call_on_the_loop_reads_no_thread_clock(group, monkeypatch) -> None:
    """The thread's CPU time and switches are a system call: a cheap call on the loop is
    timed by the wall clock alone."""
    from openenv_grpc.server.model import placement

    reads = []
    monkeypatch.setattr(placement, "thread_usage", lambda: reads.append("usage") or (0.0, 0))
    promoted(group)
    for _ in range(100):
        assert group.call_inline(lambda: 7) == 7
    assert reads == []


def test_after_a_slow_call_the_next_ones_are_judged_by_what_they_cost(group, monkeypatch) -> None:
    """A slow call that was not measured counts as the env's own (a first strike); the
    :data:`STRIKE_WINDOW` calls after it are measured: a preempted one is excused, one of
    the env's own is the second strike."""
    from openenv_grpc.server.model import placement

    promoted(group)

    def wait() -> None:
        time.sleep(SLOW * 2)

    measured = []
    real_own_cost = placement.own_cost

    def preempted(before: tuple[float, int], limit: float) -> tuple[float, bool]:
        measured.append(before)
        return CHEAP, False  # as if the OS had run another process meanwhile

    group.call_inline(wait)  # unmeasured: a strike, tolerated
    assert group.inline and measured == []
    monkeypatch.setattr(placement, "own_cost", preempted)
    for _ in range(5):
        group.call_inline(wait)  # measured, and not the env's own: excused
    assert group.inline and len(measured) == 5
    monkeypatch.setattr(placement, "own_cost", real_own_cost)
    group.call_inline(wait)  # measured: it blocked, its own: the second strike
    assert not group.inline


def test_measuring_stops_a_window_of_cheap_calls_after_a_slow_one(group, monkeypatch) -> None:
    from openenv_grpc.server.model import placement

    promoted(group)
    group.call_inline(lambda: time.sleep(SLOW * 2))
    reads = []
    monkeypatch.setattr(placement, "thread_usage", lambda: reads.append(1) or (0.0, 0))
    for _ in range(STRIKE_WINDOW + 10):
        group.call_inline(lambda: None)
    assert len(reads) == STRIKE_WINDOW  # each call of the window, then none


class _Batch(VectorBatch):
    def step(self) -> int:
        return 1


class _Classed(_Batch):
    def __init__(self) -> None:
        super().__init__(1, AutoresetMode.DISABLED)
        self.classes = iter(["small", "large", "small"])
        self._cost_class = lambda: next(self.classes)


def test_a_runner_asks_for_the_group_once_only_when_the_method_alone_decides_it() -> None:
    """A batch with no ``cost_class`` (and no compute threads of its own) is grouped by
    method alone: its runner keeps the group (a step's hot path). One whose cost class may
    change between calls is grouped anew on each."""

    async def main() -> None:
        placement = CallPlacement(THRESHOLD, "env")
        asked: list[tuple[str, ...]] = []
        real = placement.group
        placement.group = lambda *key: asked.append(key) or real(*key)  # type: ignore[method-assign]
        with ThreadPoolExecutor(1) as pool:
            plain = EnvRunner(_Batch(1, AutoresetMode.DISABLED), ExecutionMode.MEASURED, pool,
                              placement=placement)  # fmt: skip
            for _ in range(3):
                plain.group_on_loop(plain.env.step)
            assert asked == [("", "step", False)]
            asked.clear()
            classed = EnvRunner(_Classed(), ExecutionMode.MEASURED, pool, placement=placement)
            for _ in range(3):
                classed.group_on_loop(classed.env.step)
            small, large = ("small", "step", False), ("large", "step", False)
            assert asked == [small, large, small]

    asyncio.run(main())
