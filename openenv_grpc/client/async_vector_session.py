"""``AsyncVectorSession``: N environment instances over one stream, for asyncio trainers.

The asyncio twin of :class:`~openenv_grpc.client.sync_vector_session.VectorSession`,
moving its bytes like ``AsyncSession`` (the transport
:class:`~openenv_grpc.client.async_session.AsyncStream`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, NoReturn

import grpc

from openenv_grpc.client.aio_status import write_request
from openenv_grpc.client.async_session import AsyncStream
from openenv_grpc.client.errors import SessionLost, SessionTimeout
from openenv_grpc.client.outcome import Restored
from openenv_grpc.client.protocol import lost
from openenv_grpc.client.queries import AsyncVectorQueries
from openenv_grpc.client.session_core import ActionT, ObservationT, ResetOptionsT, StateT
from openenv_grpc.client.vector_core import VectorBase
from openenv_grpc.client.vector_outcome import VectorOutcome
from openenv_grpc.client.vector_protocol import (
    EpisodeIds,
    Indices,
    Options,
    Seeds,
    VectorProtocol,
    snapshot_bytes,
)
from openenv_grpc.environment import AutoresetMode
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # only the type checker needs these
    from typing_extensions import Self, Unpack

    from openenv_grpc.client.session_core import SessionOptions

__all__ = ["AsyncVectorSession"]


class AsyncVectorSession(
    AsyncStream,
    VectorBase,
    AsyncVectorQueries[StateT],
    Generic[ActionT, ObservationT, StateT, ResetOptionsT],
):
    """An asyncio vector session: ``async with AsyncVectorSession(target, 64) as envs:``.
    Arguments, options and errors as in
    :class:`~openenv_grpc.client.sync_vector_session.VectorSession`."""

    def __init__(
        self,
        target: str | grpc.aio.Channel | pb_grpc.EnvServiceAsyncStub,
        num_envs: int,
        *,
        autoreset: str | AutoresetMode = "next_step",
        **options: Unpack[SessionOptions],
    ) -> None:
        self._configure(num_envs, autoreset, options)
        super().__init__(target, **options)

    # -- commands: see VectorSession for what each returns and raises ----------------

    async def reset(
        self, *, seeds: Seeds = None, options: Options = None, episode_ids: EpisodeIds = None,
        indices: Indices = None, batch: bool = False, timeout: float | None = None,
    ) -> VectorOutcome[ObservationT]:  # fmt: skip
        """Start new episodes in the envs named; see :meth:`VectorSession.reset`."""
        protocol = self._core.protocol
        request = protocol.reset_request(seeds, options, episode_ids, indices, batch)
        answer = await self._roundtrip(request, timeout)
        return protocol.outcome(answer)

    async def step(
        self, actions: Sequence[ActionT], *, indices: Indices = None, timeout: float | None = None
    ) -> VectorOutcome[ObservationT]:
        """Apply one action per env named; see :meth:`VectorSession.step`."""
        protocol = self._core.protocol
        answer = await self._roundtrip(protocol.step_request(actions, indices), timeout)
        return protocol.outcome(answer)

    async def send(self, actions: Sequence[ActionT], indices: Indices = None) -> int:
        """Send a step without waiting for its answer; see :meth:`VectorSession.send`."""
        request = self._core.protocol.step_request(actions, indices)
        await self._send(request)
        self._inbox.sent[request.request_id] = None
        return int(request.request_id)

    async def send_batch(self, action: ActionT, indices: Indices = None) -> int:
        """Send a step whose actions are one batch-form message (as :meth:`step_batch`)
        without waiting for its answer; :meth:`recv` returns it. Only where
        :attr:`native` is True.

        Raises:
            SessionLost: the stream ended.
        """
        request = self._core.protocol.step_batch_request(action, indices)
        await self._send(request)
        self._inbox.sent[request.request_id] = None
        return int(request.request_id)

    async def send_reset(
        self, *, seeds: Seeds = None, options: Options = None, episode_ids: EpisodeIds = None,
        indices: Indices = None, batch: bool = False,
    ) -> int:  # fmt: skip
        """Send a reset without waiting for its answer; see :meth:`VectorSession.send_reset`."""
        request = self._core.protocol.reset_request(seeds, options, episode_ids, indices, batch)
        await self._send(request)
        self._inbox.sent[request.request_id] = None
        return int(request.request_id)

    async def recv(self, *, timeout: float | None = None) -> VectorOutcome[ObservationT]:
        """The outcome of a request :meth:`send` sent, whichever is answered first; see
        :meth:`VectorSession.recv`."""
        response = await self._answer(None, _deadline(timeout))
        outcome: VectorOutcome[ObservationT] = self._core.protocol.outcome(response)
        return outcome

    async def _roundtrip(self, request: Any, timeout: float | None) -> Any:
        """Send ``request`` and wait for its own answer; see ``VectorSession._roundtrip``."""
        deadline = _deadline(timeout)
        inbox = self._inbox
        while inbox.abandoned and self._core.call is not None:
            await self._answer(-1, deadline)  # files the answers read until none is abandoned
        await self._send(request)
        request_id = request.request_id
        try:
            return await self._answer(request_id, deadline)
        except SessionTimeout:
            inbox.abandoned.add(request_id)
            raise

    async def _send(self, request: Any) -> None:
        core = self._core
        if core.must_reopen():
            self._inbox.clear()
            await self.open()
        call = core.open_call()
        error = await write_request(call, request, self._ended)
        if error is not None:
            await self._lose(error)

    async def _answer(self, wanted: int | None, deadline: float | None) -> Any:
        """The answer to request ``wanted`` (None: to any request of :meth:`send`).

        Raises:
            SessionTimeout: none by ``deadline``. SessionLost: the stream ended.
        """
        inbox = self._inbox
        found = inbox.take(wanted)
        if found is not None:
            return found
        core = self._core
        call = core.call
        protocol = core.protocol
        loop = asyncio.get_running_loop()
        while True:
            if wanted == -1 and not inbox.abandoned:
                return None
            left = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                response = await self._read(call, left)
            except grpc.aio.AioRpcError as exc:
                await self._lose(lost(exc.code(), exc.details()))
            if response is grpc.aio.EOF:
                await self._lose(lost(await call.code(), await call.details()))
            if inbox.route(response, wanted, protocol):
                return response

    async def _lose(self, error: SessionLost) -> NoReturn:
        self._inbox.clear()
        self._pending = None
        await self._let_go(self._core.stream_lost())
        raise error

    async def step_batch(
        self, action: ActionT, *, indices: Indices = None, timeout: float | None = None
    ) -> VectorOutcome[ObservationT]:
        """Apply a batch-form action; see :meth:`VectorSession.step_batch`."""
        protocol = self._core.protocol
        answer = await self._roundtrip(protocol.step_batch_request(action, indices), timeout)
        return protocol.outcome(answer)

    async def _ask(self, command: str, indices: Indices, timeout: float | None) -> Any:
        protocol = self._core.protocol
        return await self._roundtrip(protocol.query_request(command, indices), timeout)

    def _vector_protocol(self) -> VectorProtocol:
        return self._core.protocol

    async def snapshot(
        self, indices: Indices = None, *, timeout: float | None = None
    ) -> list[bytes]:
        """Snapshots of the envs named; see :meth:`VectorSession.snapshot`."""
        answer = await self._ask("snapshot", indices, timeout)
        return self._core.protocol.rows(answer, "snapshots", "snapshot", snapshot_bytes)

    async def restore(
        self, snapshots: Sequence[bytes], *, indices: Indices = None, timeout: float | None = None
    ) -> list[Restored]:
        """Continue the envs named from snapshots; see :meth:`VectorSession.restore`."""
        protocol = self._core.protocol
        answer = await self._roundtrip(protocol.restore_request(snapshots, indices), timeout)
        return protocol.restored(answer)

    @classmethod
    async def forked(
        cls,
        target: str | grpc.aio.Channel | pb_grpc.EnvServiceAsyncStub | AsyncStream,
        snapshots: Sequence[bytes],
        *,
        autoreset: str | AutoresetMode = "next_step",
        timeout: float | None = None,
        **options: Unpack[SessionOptions],
    ) -> Self:
        """An open vector stream of one env per snapshot; see :meth:`VectorSession.forked`
        (``async with await AsyncVectorSession.forked(env, [data] * 8) as group:``)."""
        fork = cls._unopened_fork(target, snapshots, autoreset, options)
        try:
            await fork.open()
            await fork.restore(snapshots, timeout=timeout)
        except BaseException:
            await fork.abort()
            raise
        return fork


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else asyncio.get_running_loop().time() + timeout


AsyncVectorSession._generic_origin = AsyncVectorSession
