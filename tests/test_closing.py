"""The one hung-close path (``server/local/closing.py``), on the event loop itself: a close
is waited for up to its deadline; past it, or when its waiter is cancelled, a close on a
thread goes on and one on the loop is cancelled; either way the slots are freed once the
close has ended, never before, and what it raised then is logged once. (Servers whose
closes hang: tests/test_close_timeout.py, tests/test_reliability_lifecycle.py.)"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading

import pytest

from openenv_grpc.server.local.closing import close_unobserved, close_within

pytestmark = pytest.mark.timeout(30)

#: Seconds a test waits for what it expects before it fails (never slept).
WAIT = 10.0


class Tally:
    """Counts the calls of the hooks close_within is given; wakes a waiter on each."""

    def __init__(self) -> None:
        self.released = 0
        self.given_up = 0
        self.changed = asyncio.Event()

    def release(self) -> None:
        self.released += 1
        self.changed.set()

    def give_up(self) -> None:
        self.given_up += 1

    async def until_released(self) -> None:
        async def released() -> None:
            while not self.released:
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(released(), WAIT)


def test_a_close_in_time_frees_its_slots_and_raises_what_it_raised() -> None:
    async def scenario() -> Tally:
        tally = Tally()

        async def close() -> None:
            raise ValueError("close broke")

        with pytest.raises(ValueError, match="close broke"):
            await close_within(close(), 5.0, release=tally.release, given_up=tally.give_up)
        return tally

    tally = asyncio.run(scenario())
    assert (tally.released, tally.given_up) == (1, 0)


def test_a_threads_close_past_its_deadline_goes_on_and_frees_when_it_returns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gate = threading.Event()

    def hung_close() -> None:
        gate.wait(WAIT)
        raise RuntimeError("closed late, badly")

    async def scenario() -> tuple[bool, int, int, Tally]:
        tally = Tally()
        with concurrent.futures.ThreadPoolExecutor(1) as threads:
            future = threads.submit(hung_close)
            closed = await close_within(
                asyncio.wrap_future(future), 0.05, release=tally.release, given_up=tally.give_up
            )
            given_up, released = tally.given_up, tally.released  # at the give-up
            assert not future.done()  # not cancelled: a thread cannot be stopped
            gate.set()
            await tally.until_released()
        return closed, given_up, released, tally

    with caplog.at_level(logging.ERROR, "openenv_grpc.server.local.closing"):
        closed, given_up, released, tally = asyncio.run(scenario())
    assert not closed and given_up == 1 and released == 0
    assert tally.released == 1
    logged = [
        r for r in caplog.records if r.getMessage() == "closing an abandoned environment raised"
    ]
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert str(logged[0].exc_info[1]) == "closed late, badly"


def test_a_loop_close_past_its_deadline_is_cancelled_then_frees() -> None:
    async def scenario() -> tuple[bool, bool, Tally]:
        tally = Tally()
        cancelled = asyncio.Event()

        async def hung_close() -> None:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise

        closed = await close_within(
            hung_close(), 0.05, release=tally.release, given_up=tally.give_up, cancel=True
        )
        await tally.until_released()
        return closed, cancelled.is_set(), tally

    closed, cancelled, tally = asyncio.run(scenario())
    assert not closed and cancelled
    assert (tally.released, tally.given_up) == (1, 1)


def test_a_cancelled_waiter_leaves_the_close_running_and_its_slots_freed_at_its_end() -> None:
    """A session whose end is cancelled while its envs close (a second cancel) still
    gives its slots back, once the close has ended."""

    async def scenario() -> tuple[bool, int, Tally]:
        tally = Tally()
        entered, finish = asyncio.Event(), asyncio.Event()

        async def slow_close() -> None:
            entered.set()
            await finish.wait()

        waiter = asyncio.ensure_future(close_within(slow_close(), None, release=tally.release))
        await asyncio.wait_for(entered.wait(), WAIT)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        released_at_cancel = tally.released
        finish.set()
        await tally.until_released()
        return waiter.cancelled(), released_at_cancel, tally

    cancelled, released_at_cancel, tally = asyncio.run(scenario())
    assert cancelled and released_at_cancel == 0
    assert (tally.released, tally.given_up) == (1, 0)


def test_a_close_nobody_waits_for_frees_at_its_end() -> None:
    async def scenario() -> Tally:
        tally = Tally()
        finish = asyncio.Event()

        async def close() -> None:
            await finish.wait()

        close_unobserved(close(), tally.release)
        assert tally.released == 0
        finish.set()
        await tally.until_released()
        return tally

    assert asyncio.run(scenario()).released == 1
