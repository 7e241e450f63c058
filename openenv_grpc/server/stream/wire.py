"""What the session core needs of a stream's transport: the one surface every wire gives.

:meth:`SessionManager.run <openenv_grpc.server.stream.session.SessionManager.run>` drives a
stream through this and nothing else, so admission, the idle reaper, the drain, the byte
budget and the metrics are the same on every wire. gRPC's ``ServicerContext`` is one (the
``Session`` and ``VectorSession`` RPCs); the OpenEnv door's (``integrations/openenv/
streams.py``) are the others: a WebSocket's frames, or calls handed over in process.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NoReturn, Protocol

import grpc

__all__ = ["Wire"]


class Wire(Protocol):
    """One stream as the session core sees it: request bytes in, answer bytes out, a
    status at the end. A wire authenticates its caller before the core sees the stream.

    A wire that answers some of its client's messages itself, or makes a request wait on
    work of its own, may also have ``heard() -> float``: the loop time its client last
    did something the core cannot see (``math.inf`` while such work goes on). The idle
    reaper then ends the stream only once both that and the core's own clock are past the
    idle timeout. gRPC's contexts have none: every message of theirs is a request.
    """

    async def read(self) -> Any:
        """The next request's bytes, or ``grpc.aio.EOF`` once the client is done."""
        ...

    async def write(self, message: bytes) -> None:
        """Send one answer; returns once the wire has taken it (its bytes are held
        against the byte budget until then)."""
        ...

    async def send_initial_metadata(self, initial_metadata: Sequence[tuple[str, str]]) -> None:
        """Tell the client it was admitted (the headers the core names)."""
        ...

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: Sequence[tuple[str, str]] = (),
    ) -> NoReturn:
        """End the stream with ``code``.

        Raises:
            Exception: always (``grpc.aio.AbortError``), ending the stream's handler.
        """
        ...

    def cancelled(self) -> bool:
        """The client has gone (nothing it sends will be read)."""
        ...

    def invocation_metadata(self) -> Iterable[tuple[str, Any]] | None:
        """The metadata the client opened the stream with."""
        ...
