"""The per-env queries of the four client shells (``state``, ``render``): commands that
read something of an env and change no episode.

Each is written once per shell kind here, over the shell's one ``_ask`` (build the query
command by its field name, send it, read the result field), so a new query is a method in
each class below and nothing else on the client: the request and the answer's error
handling are the protocol's generic ``query_request`` / ``result`` / ``rows``, recovery
passes every query through (``RecoveringCalls.ask``). A snapshot is a query on the wire
but not here: it is kept by recovery and documented with restore and fork.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic

from openenv_grpc.client.session_core import StateT
from openenv_grpc.v1 import session_pb2 as pb

if TYPE_CHECKING:  # only the type checker needs these
    from openenv_grpc.client.protocol import SessionProtocol
    from openenv_grpc.client.vector_protocol import Indices, VectorProtocol

__all__ = ["AsyncSessionQueries", "AsyncVectorQueries", "SessionQueries", "VectorQueries"]


class SessionQueries(Generic[StateT]):
    """The queries of a :class:`~openenv_grpc.Session`."""

    def _ask(self, command: str, result: str, timeout: float | None) -> Any:
        """The ``result`` field of the answer to the query ``command`` (the shell's)."""
        raise NotImplementedError

    def _session_protocol(self) -> SessionProtocol:
        raise NotImplementedError

    def state(self, *, timeout: float | None = None) -> StateT:
        """The environment's current state.

        Raises:
            EnvError: the environment raised (the episode goes on).
            SessionLost: the stream ended. SessionTimeout: no answer within ``timeout``.
        """
        result = self._ask("state", "state", timeout)
        state: StateT = self._session_protocol().decode(result.state, "state")
        return state

    def render(self, *, timeout: float | None = None) -> pb.Frame:
        """A picture of the environment as it is now: ``frame.image`` (uint8 pixels,
        height x width x channels; :func:`openenv_grpc.frame_array` makes it a numpy
        array) or ``frame.text``. The episode is not changed.

        Raises:
            EnvError: UNIMPLEMENTED, the env does not render (or not as configured: the
                message says why); INTERNAL, its render raised. The episode goes on.
            SessionLost: the stream ended. SessionTimeout: no answer within ``timeout``.
        """
        frame: pb.Frame = self._ask("render", "rendered", timeout).frame
        return frame


class AsyncSessionQueries(Generic[StateT]):
    """The queries of an :class:`~openenv_grpc.AsyncSession` (see :class:`SessionQueries`)."""

    async def _ask(self, command: str, result: str, timeout: float | None) -> Any:
        raise NotImplementedError

    def _session_protocol(self) -> SessionProtocol:
        raise NotImplementedError

    async def state(self, *, timeout: float | None = None) -> StateT:
        """The environment's current state; see :meth:`Session.state`."""
        result = await self._ask("state", "state", timeout)
        state: StateT = self._session_protocol().decode(result.state, "state")
        return state

    async def render(self, *, timeout: float | None = None) -> pb.Frame:
        """A picture of the environment; see :meth:`Session.render`."""
        frame: pb.Frame = (await self._ask("render", "rendered", timeout)).frame
        return frame


class VectorQueries(Generic[StateT]):
    """The queries of a :class:`~openenv_grpc.VectorSession`."""

    def _ask(self, command: str, indices: Indices, timeout: float | None) -> Any:
        """The answer to the query ``command`` of the envs named (all by default)."""
        raise NotImplementedError

    def _vector_protocol(self) -> VectorProtocol:
        raise NotImplementedError

    def state(self, index: int, *, timeout: float | None = None) -> StateT:
        """The state of env ``index``.

        Raises:
            EnvError: that env's state() raised (its episode goes on), or a bad index.
            SessionLost: the stream ended. SessionTimeout: no answer within ``timeout``.
        """
        states = self._vector_protocol().states(self._ask("state", [index], timeout))
        state: StateT = states.one(index)
        return state

    def states(self, indices: Indices = None, *, timeout: float | None = None) -> list[StateT]:
        """The states of the envs named (all by default), in index order.

        Raises:
            EnvError: an env's state() raised (the message names it), or bad indices.
            SessionLost: the stream ended. SessionTimeout: no answer within ``timeout``.
        """
        return self._vector_protocol().states(self._ask("state", indices, timeout)).all()

    def render(self, indices: Indices = None, *, timeout: float | None = None) -> list[pb.Frame]:
        """A picture of each env named (all by default), in index order; see
        :meth:`Session.render`. No episode changes.

        Raises:
            VectorEnvError: some envs drew nothing (``errors`` by index: UNIMPLEMENTED,
                the env does not render; INTERNAL, its render raised); the others'
                frames are its ``results``, by index.
            EnvError: the request was refused (bad indices; RESOURCE_EXHAUSTED: the whole
                answer is over the message limit, ask for fewer envs at a time).
            SessionLost: the stream ended. SessionTimeout: no answer within ``timeout``.
        """
        answer = self._ask("render", indices, timeout)
        return self._vector_protocol().rows(answer, "frames", "render", _frame)


class AsyncVectorQueries(Generic[StateT]):
    """The queries of an :class:`~openenv_grpc.AsyncVectorSession` (see
    :class:`VectorQueries`)."""

    async def _ask(self, command: str, indices: Indices, timeout: float | None) -> Any:
        raise NotImplementedError

    def _vector_protocol(self) -> VectorProtocol:
        raise NotImplementedError

    async def state(self, index: int, *, timeout: float | None = None) -> StateT:
        """The state of env ``index``; see :meth:`VectorSession.state`."""
        answer = await self._ask("state", [index], timeout)
        state: StateT = self._vector_protocol().states(answer).one(index)
        return state

    async def states(
        self, indices: Indices = None, *, timeout: float | None = None
    ) -> list[StateT]:
        """The states of the envs named; see :meth:`VectorSession.states`."""
        answer = await self._ask("state", indices, timeout)
        return self._vector_protocol().states(answer).all()

    async def render(
        self, indices: Indices = None, *, timeout: float | None = None
    ) -> list[pb.Frame]:
        """A picture of each env named; see :meth:`VectorSession.render`."""
        answer = await self._ask("render", indices, timeout)
        return self._vector_protocol().rows(answer, "frames", "render", _frame)


def _frame(entry: pb.RenderResult) -> pb.Frame:
    return entry.frame
