"""The byte budget's account (openenv_grpc/server/process/budget.py), in process: takes and gives
pair up, one message always fits an empty budget, waiters are served first come first
served, and a waiter cancelled at any point takes nothing and loses no one's bytes."""

from __future__ import annotations

import asyncio

import pytest

from openenv_grpc.server.process.budget import ByteBudget


def test_takes_fit_the_total_and_one_oversize_take_fits_an_empty_budget() -> None:
    budget = ByteBudget(100)
    assert budget.try_take(60) and not budget.try_take(41) and budget.try_take(40)
    assert (budget.used, budget.free) == (100, 0)
    assert budget.try_take(0) and budget.used == 100  # nothing asked: always "taken"
    budget.give(100)
    assert budget.try_take(1_000)  # nothing else held: one large message gets through
    assert not budget.try_take(1)
    budget.give(1_000)
    assert budget.used == 0 and budget.peak == 1_000
    with pytest.raises(AssertionError, match="more than taken"):
        budget.give(1)


def test_waiters_are_served_in_order_and_a_cancelled_one_takes_nothing() -> None:
    async def scenario() -> list[str]:
        budget = ByteBudget(100)
        assert budget.try_take(100)
        served: list[str] = []

        async def wait(name: str, n: int) -> None:
            await budget.take(n)
            served.append(name)

        first = asyncio.create_task(wait("first", 80))
        cancelled = asyncio.create_task(wait("cancelled", 10))
        last = asyncio.create_task(wait("last", 20))
        await asyncio.sleep(0)
        assert not budget.try_take(1)  # waiters come first, even for a byte that fits
        cancelled.cancel()
        await asyncio.sleep(0)
        budget.give(100)  # the cancelled waiter is skipped, not handed bytes
        await asyncio.wait_for(asyncio.gather(first, last), 1)
        assert budget.used == 100
        # A waiter that times out (wait_for cancels it) leaves the account as it was.
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(budget.take(50), 0.01)
        budget.give(100)
        assert budget.used == 0
        return served

    assert asyncio.run(scenario()) == ["first", "last"]
