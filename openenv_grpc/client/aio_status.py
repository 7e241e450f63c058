"""The status an asyncio stream ended with, kept where grpc.aio would lose it.

A write that gRPC refuses because the server has already ended the stream makes grpc.aio
set the call's status to its own INTERNAL ("Internal error from Core"), and that can
overwrite the server's status just read (grpc/grpc#36066): the caller would learn
"INTERNAL" instead of "idle for 0.5s" or "draining". :class:`EndStatus` watches the call
from its start and keeps the first status that is not that placeholder.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

import grpc

from openenv_grpc.client.errors import SessionLost
from openenv_grpc.client.protocol import lost

__all__ = ["EndStatus", "write_request"]

_T = TypeVar("_T")

#: What grpc.aio sets when Core refuses a batch (see the module's docstring).
_PLACEHOLDER = (grpc.StatusCode.INTERNAL, "Internal error from Core")
#: How long a refused write waits for the server's status to be read, when it was not yet.
_STATUS_AFTER_REFUSED_WRITE_SECONDS = 0.5


def _ready(awaitable: Awaitable[_T]) -> _T | None:
    """The result of an awaitable that finishes without suspending, else None (grpc.aio's
    status accessors finish at once on a call that is done)."""
    steps = awaitable.__await__()
    try:
        steps.send(None)
    except StopIteration as finished:
        return finished.value  # type: ignore[no-any-return]
    steps.close()
    return None


class EndStatus:
    """The first real status ``call`` ends with (its done callbacks run on every status
    grpc.aio sets, the server's and a later placeholder alike)."""

    def __init__(self, call: grpc.aio.Call) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None
        self.known = asyncio.Event()
        call.add_done_callback(self._done)

    def _done(self, call: Any) -> None:
        if self.status is not None:
            return
        try:
            code, details = _ready(call.code()), _ready(call.details())
        except Exception:  # never break grpc.aio's own callbacks; the write says INTERNAL
            return
        if code is not None and (code, details) != _PLACEHOLDER:
            self.status = (code, details or "")
            self.known.set()


async def write_request(call: Any, request: Any, ended: EndStatus | None) -> SessionLost | None:
    """Write ``request`` on ``call``: None, or the SessionLost to raise because the server
    had already ended the stream, with the server's code and details."""
    try:
        await call.write(request)
    except grpc.aio.AioRpcError as exc:
        if (exc.code(), exc.details()) != _PLACEHOLDER or ended is None:
            return lost(exc.code(), exc.details())
        # The server's status may still be on its way to the loop: it lands after this.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(ended.known.wait(), _STATUS_AFTER_REFUSED_WRITE_SECONDS)
        if ended.status is not None:
            return lost(*ended.status)
        return lost(
            grpc.StatusCode.UNAVAILABLE,
            "the server ended the session before the request was sent (it may be draining "
            f"or have closed the session; gRPC: {exc.details()})",
        )
    except asyncio.InvalidStateError:  # written after the stream finished cleanly
        return lost(await call.code(), await call.details())
    return None
