"""Where a session's requests are answered: in this process, or in an isolated worker.

The session lifecycle (``session.py``) reads raw request bytes, hands them to a backend
and writes back the raw response bytes; it never needs to know which backend it has.
"""

from __future__ import annotations

import logging
from typing import Protocol

from google.protobuf.message import DecodeError

from openenv_grpc.server.episode import EpisodeDriver
from openenv_grpc.server.metrics import NO_METRICS, Metrics
from openenv_grpc.server.runner import RunnerFactory
from openenv_grpc.server.spec import EnvSpec
from openenv_grpc.v1 import session_pb2 as pb

__all__ = [
    "EnvFactoryError",
    "LocalBackend",
    "SessionBackend",
    "SessionLostError",
    "UndecodableRequest",
]

log = logging.getLogger(__name__)


class EnvFactoryError(Exception):
    """The env factory raised where it ran (a worker process); the message says what."""


class UndecodableRequest(Exception):
    """The request bytes are not a SessionRequest: the stream is out of sync."""


class SessionLostError(Exception):
    """The backend lost the env (its worker process died): the session cannot go on."""


class SessionBackend(Protocol):
    """One session's env, wherever it runs."""

    #: Set once a close command was answered: the stream must end.
    closed: bool

    async def handle(self, raw: bytes) -> bytes:
        """Answer one serialized request with one serialized response.

        Raises:
            UndecodableRequest: ``raw`` does not parse.
            SessionLostError: the env is gone.
        """
        ...

    async def close(self) -> None:
        """Close the env; once, surviving a raising ``close`` (it is logged)."""
        ...


class LocalBackend:
    """The env runs in this process (inline, on the thread pool, or on the loop)."""

    __slots__ = ("_driver", "closed")

    def __init__(self, driver: EpisodeDriver) -> None:
        self._driver = driver
        self.closed = False

    @classmethod
    async def open(
        cls,
        spec: EnvSpec,
        new_runner: RunnerFactory,
        call_timeout: float | None,
        metrics: Metrics = NO_METRICS,
    ) -> LocalBackend:
        """Create the env. Raises whatever the factory raised."""
        runner = await new_runner()
        return cls(EpisodeDriver(spec, runner, new_runner, call_timeout, metrics))

    async def handle(self, raw: bytes) -> bytes:
        try:
            request = pb.SessionRequest.FromString(raw)
        except DecodeError as exc:
            name = pb.SessionRequest.DESCRIPTOR.full_name
            raise UndecodableRequest(f"request is not a valid {name}: {exc}") from None
        response = await self._driver.handle(request)
        self.closed = self._driver.closed
        return response.SerializeToString()

    async def close(self) -> None:
        await self._driver.runner.close_quietly()
