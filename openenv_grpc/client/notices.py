"""What the server tells a session unasked: :class:`Draining`.

The server sends notices with request id 0, between answers (``SessionResponse.notice``);
a session reads them on its way to the answer of its next call and keeps the last one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from openenv_grpc.v1 import session_pb2 as pb

__all__ = ["Draining", "read_notice"]


@dataclass(frozen=True, slots=True)
class Draining:
    """The server is draining: this session ends at ``deadline`` (UNAVAILABLE) and its env
    is closed. Finish the episode, or move to another server.

    Attributes:
        message: The server's words.
        deadline: When the server ends the session, in seconds since the epoch (the
            server's wall clock).
        seconds_left: Seconds left when the server sent the notice.
    """

    message: str
    deadline: float
    seconds_left: float
    #: Monotonic time at which this client read the notice.
    received: float = field(default_factory=time.monotonic, compare=False)

    def remaining(self) -> float:
        """Seconds left now, by this machine's monotonic clock (never below 0)."""
        return max(0.0, self.seconds_left - (time.monotonic() - self.received))


def read_notice(notice: pb.Notice) -> Draining | None:
    """The client's view of a notice (None for a kind this client does not know)."""
    if notice.kind == pb.NOTICE_KIND_DRAINING:
        deadline = notice.deadline.ToNanoseconds() / 1e9
        return Draining(notice.message, deadline, notice.seconds_left)
    return None
