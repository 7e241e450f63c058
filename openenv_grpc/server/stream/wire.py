"""What the session core needs of a stream's transport: gRPC's ``ServicerContext``, or the
OpenEnv door's wires (``integrations/openenv/streams.py``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NoReturn, Protocol

import grpc

__all__ = ["Wire"]


class Wire(Protocol):
    """One stream as the session core sees it: requests in, answer bytes out, a status at
    the end. A wire authenticates its caller before the core sees the stream.
    """

    async def read(self) -> Any:
        """The next request (gRPC's bytes; what the stream's backend reads), or
        ``grpc.aio.EOF`` once the client is done."""
        ...

    async def write(self, message: bytes) -> None:
        """Send one answer; returns once the wire has taken it."""
        ...

    async def send_initial_metadata(self, initial_metadata: Sequence[tuple[str, str]]) -> None: ...

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: Sequence[tuple[str, str]] = (),
    ) -> NoReturn:
        """End the stream with ``code``; always raises (``grpc.aio.AbortError``)."""
        ...

    def cancelled(self) -> bool: ...

    def invocation_metadata(self) -> Iterable[tuple[str, Any]] | None: ...
