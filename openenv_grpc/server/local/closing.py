"""What happens when an env's close hangs, for envs in this process: one path.

Every close someone waits for goes through :func:`close_within`: a runner's close of its
batch (on a lifecycle thread for a pooled env, on the event loop for an async or inline
one), and a session's close of its envs (with no limit, or in a drain the rest of the
drain's budget, ``session.CLOSE_BUDGET``). It waits up to the close's deadline. Past it,
or when its waiter is cancelled, it stops waiting: a close on the event loop is
cancelled when given up (nothing keeps running), a close on a thread goes on unobserved
(a thread cannot be stopped). Either way the slots the env holds are freed once its close
has ended, never before (until then it exists), and what the close raised then is
logged, once. The waiter says what giving up means (``given_up``): a lifecycle thread is
abandoned, counted and logged (``env_threads.Lifecycle.abandon_close``, whose watch does
the same for closes nobody waits for); a drain logs its budget. :func:`close_unobserved`
is the same tail for a close nobody waits for at all (an abandoned async env's).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from openenv_grpc.server.errors import contained

__all__ = ["close_unobserved", "close_within"]

log = logging.getLogger(__name__)

#: Closes nobody waits for any more, referenced until they end (the loop does not).
_unobserved: set[asyncio.Future[Any]] = set()


def _nothing() -> None:
    pass


async def close_within(
    close: Awaitable[Any],
    timeout: float | None,
    *,
    release: Callable[[], None] = _nothing,
    given_up: Callable[[], None] = _nothing,
    cancel: bool = False,
) -> bool:
    """Wait for ``close`` (a coroutine, or a close thread's future wrapped for the loop) up
    to ``timeout`` seconds (None: for ever); ``release`` runs on the loop once it has
    ended, however. True: it ended in time (what it raised is raised here). False: past
    the timeout ``given_up`` was called, and the close is cancelled (``cancel``: it runs
    on the loop) or left to end unobserved. A cancelled waiter leaves it the same way.

    Raises:
        Exception: what the close raised (env code's ``SystemExit`` as ``EnvExit``).
    """
    # A thread's future is waited on as it is: a task around it would cancel a close
    # still queued at the server's exit, and that env would never be closed.
    closing = close if asyncio.isfuture(close) else asyncio.ensure_future(contained(close))
    try:
        done, _ = await asyncio.wait((closing,), timeout=timeout)
    except asyncio.CancelledError:
        _leave(closing, release, cancel)
        raise
    if not done:
        given_up()
        _leave(closing, release, cancel)
        return False
    try:
        closing.result()
    finally:
        release()
    return True


def close_unobserved(close: Awaitable[Any], release: Callable[[], None]) -> None:
    """Run ``close`` without waiting for it: ``release`` once it has ended, what it raised
    logged (as for a close :func:`close_within` gave up on)."""
    _leave(asyncio.ensure_future(contained(close)), release, cancel=False)


def _leave(closing: asyncio.Future[Any], release: Callable[[], None], cancel: bool) -> None:
    if cancel:
        closing.cancel()
    _unobserved.add(closing)
    closing.add_done_callback(functools.partial(_ended, release))


def _ended(release: Callable[[], None], closing: asyncio.Future[Any]) -> None:
    _unobserved.discard(closing)
    release()
    if not closing.cancelled() and (exc := closing.exception()) is not None:
        log.error("closing an abandoned environment raised", exc_info=exc)
