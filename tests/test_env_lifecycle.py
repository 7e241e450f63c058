"""``Lifecycle``, the one path by which an env off the loop is made and closed with a
timeout: in every way a make or a close ends, the slot is freed exactly once, and what
env code raised after nobody waits for it any more is logged by the server with its own
traceback (not by asyncio as "never retrieved"). The server-level behaviour is in
test_close_timeout.py and test_reliability_lifecycle.py; these are the corners no client
can reach."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from openenv_grpc.server.local.env_threads import (
    CloseAbandoned,
    CreateTimeout,
    EnvThreadPool,
    Lifecycle,
)

pytestmark = pytest.mark.timeout(30)


def _logged(caplog: pytest.LogCaptureFixture, message: str) -> list[logging.LogRecord]:
    """The records of ``message``, waited for up to 5 s: a close thread logs what its
    close raised after it has handed the slot back to the loop."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        records = [r for r in caplog.records if r.getMessage() == message]
        if records:
            return records
        time.sleep(0.01)
    return []


def _lifecycle(timeout: float | None) -> Lifecycle:
    return Lifecycle(EnvThreadPool(2, "test-create"), EnvThreadPool(2, "test-close"), timeout)


class _Frees:
    """A slot's release: counts its calls."""

    def __init__(self) -> None:
        self.count = 0
        self.freed = asyncio.Event()

    def __call__(self) -> None:
        self.count += 1
        self.freed.set()


def test_a_close_in_time_frees_its_slot_before_its_awaiter_resumes() -> None:
    async def main() -> int:
        frees = _Frees()
        await _lifecycle(5).close(lambda: None, frees)
        return frees.count

    assert asyncio.run(main()) == 1


def test_an_abandoned_close_that_raises_later_is_logged_with_the_envs_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gate = threading.Event()

    def env_close() -> None:
        gate.wait(5)
        raise ValueError("late close error")

    async def main() -> int:
        frees = _Frees()
        with pytest.raises(CloseAbandoned):
            await _lifecycle(0.1).close(env_close, frees)
        gate.set()
        await asyncio.wait_for(frees.freed.wait(), 5)
        await asyncio.sleep(0.05)
        gc.collect()
        return frees.count

    with caplog.at_level(logging.ERROR):
        assert asyncio.run(main()) == 1
        raised = _logged(caplog, "closing an abandoned environment raised")
    assert len(raised) == 1 and "env_close" in caplog.text
    assert "never retrieved" not in caplog.text


def test_a_close_whose_awaiter_is_cancelled_frees_its_slot_and_logs_what_it_raised_later(
    caplog: pytest.LogCaptureFixture,
) -> None:
    started = threading.Event()
    gate = threading.Event()

    def env_close() -> None:
        started.set()
        gate.wait(5)
        raise ValueError("raised after the session went")

    async def main() -> int:
        frees = _Frees()
        closing = asyncio.ensure_future(_lifecycle(5).close(env_close, frees))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        assert frees.count == 0  # the close still runs: its slot is held
        gate.set()
        await asyncio.wait_for(frees.freed.wait(), 5)
        await asyncio.sleep(0.05)
        gc.collect()
        return frees.count

    with caplog.at_level(logging.ERROR):
        assert asyncio.run(main()) == 1
        raised = _logged(caplog, "closing an abandoned environment raised")
    assert len(raised) == 1 and "raised after the session went" in caplog.text
    assert "never retrieved" not in caplog.text


def test_a_background_close_raising_system_exit_logs_where_env_code_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def env_close() -> None:
        raise SystemExit(3)

    async def main() -> int:
        frees = _Frees()
        _lifecycle(5).close_later(asyncio.get_running_loop(), env_close, frees)
        await asyncio.wait_for(frees.freed.wait(), 5)
        return frees.count

    with caplog.at_level(logging.ERROR):
        assert asyncio.run(main()) == 1
        assert _logged(caplog, "closing an abandoned environment raised")
    assert "in env_close" in caplog.text and "SystemExit: 3" in caplog.text


def _cancelled_make(factory: Callable[[], Any], timeout: float | None) -> int:
    """Start making with ``factory``, cancel the open while it runs, and count the frees
    once it has returned."""
    started = threading.Event()
    gate = threading.Event()

    def make() -> Any:
        started.set()
        gate.wait(5)
        return factory()

    async def main() -> int:
        frees = _Frees()
        opening = asyncio.ensure_future(_lifecycle(timeout).make(make, frees))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening
        gate.set()
        await asyncio.wait_for(frees.freed.wait(), 5)
        await asyncio.sleep(0.05)
        gc.collect()
        return frees.count

    return asyncio.run(main())


def test_a_cancelled_open_whose_env_is_born_later_is_closed_then_freed_once() -> None:
    closed: list[bool] = []

    class Env:
        def close(self) -> None:
            closed.append(True)

    assert _cancelled_make(Env, 5) == 1
    assert closed == [True]


def test_a_cancelled_open_whose_factory_raises_later_is_freed_once_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken() -> Any:
        raise RuntimeError("factory broke late")

    with caplog.at_level(logging.ERROR):
        assert _cancelled_make(broken, 5) == 1
        assert _logged(caplog, "an abandoned environment's factory raised")
    assert "factory broke late" in caplog.text and "never retrieved" not in caplog.text


def test_a_cancelled_open_whose_env_has_no_close_still_frees_its_slot(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR):
        assert _cancelled_make(object, 5) == 1
        assert _logged(caplog, "an abandoned environment could not be closed")


def test_a_factory_still_queued_at_the_timeout_never_runs_and_is_freed_at_once() -> None:
    gate = threading.Event()
    ran: list[str] = []

    async def main() -> tuple[int, int]:
        lifecycle = Lifecycle(EnvThreadPool(1, "test-create"), EnvThreadPool(1, "test-close"), 0.2)
        first, second = _Frees(), _Frees()
        # The one create thread is held by a factory that outlives the timeout.
        holding = asyncio.ensure_future(lifecycle.make(lambda: gate.wait(5), first))
        await asyncio.sleep(0.05)  # it is submitted first
        with pytest.raises(CreateTimeout):
            await lifecycle.make(lambda: ran.append("queued"), second)
        freed_at_once = second.count
        gate.set()
        with pytest.raises(CreateTimeout):
            await holding
        await asyncio.wait_for(first.freed.wait(), 5)
        return freed_at_once, first.count

    assert asyncio.run(main()) == (1, 1)
    assert ran == []
