"""``VectorSession``: N environment instances over one stream, for blocking code.

``with VectorSession(target, 64) as envs: envs.reset(seeds=0); envs.step(actions)``: one
message each way per vector step, whatever N. It moves its bytes like ``Session`` (the
blocking transport :class:`~openenv_grpc.client.sync_session.SyncStream`); what a vector
stream is lives in :mod:`openenv_grpc.client.vector_core` and
:mod:`openenv_grpc.client.vector_protocol`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, NoReturn

import grpc

from openenv_grpc.client.errors import SessionLost, SessionTimeout
from openenv_grpc.client.outcome import Restored
from openenv_grpc.client.protocol import lost
from openenv_grpc.client.queries import VectorQueries
from openenv_grpc.client.session_core import ActionT, ObservationT, ResetOptionsT, StateT
from openenv_grpc.client.sync_session import _END, SyncStream
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

__all__ = ["VectorSession"]


class VectorSession(
    SyncStream,
    VectorBase,
    VectorQueries[StateT],
    Generic[ActionT, ObservationT, StateT, ResetOptionsT],
):
    """A blocking vector session: ``num_envs`` envs on one stream, stepped together.

    The server admits all ``num_envs`` slots or none (:class:`CapacityError` names N and
    what is free) and closes every env when the stream ends. ``autoreset`` is
    Gymnasium's mode: ``"next_step"`` (default), ``"same_step"`` or ``"disabled"``.
    ``target`` and the options (``credentials``, ``token``, ``metadata``, ``retry``,
    ``reconnect``) work as for :class:`~openenv_grpc.client.sync_session.Session`, and so
    does each call's ``timeout``. Subclass it with concrete types
    (``VectorSession[A, O, S, R]``) for a typed client.

    Each call names the envs it is about with ``indices`` (increasing, no repeats; None:
    all). A refused request raises :class:`EnvError` (nothing was done); an env that
    failed answers in the outcome's ``errors`` and its neighbours still answer.
    """

    def __init__(
        self,
        target: str | grpc.Channel | pb_grpc.EnvServiceStub,
        num_envs: int,
        *,
        autoreset: str | AutoresetMode = "next_step",
        **options: Unpack[SessionOptions],
    ) -> None:
        self._configure(num_envs, autoreset, options)
        super().__init__(target, **options)

    def reset(
        self, *, seeds: Seeds = None, options: Options = None, episode_ids: EpisodeIds = None,
        indices: Indices = None, batch: bool = False, timeout: float | None = None,
    ) -> VectorOutcome[ObservationT]:  # fmt: skip
        """Start new episodes in the envs named; returns their first observations.

        ``seeds``: one int (env ``i`` gets ``seed + i``), one per env named, or None.
        ``options``: one message for all, one per env, or None. ``batch``: the
        observations in batch form (``outcome.batch_observation``; native envs only).

        Raises:
            EnvError: the request was refused (INVALID_ARGUMENT: bad indices or options).
            InvalidRequest: a list is not one entry per env named (nothing sent).
            SessionLost: the stream ended. SessionTimeout: no answer within ``timeout``.
        """
        protocol = self._core.protocol
        request = protocol.reset_request(seeds, options, episode_ids, indices, batch)
        outcome: VectorOutcome[ObservationT] = protocol.outcome(self._roundtrip(request, timeout))
        return outcome

    def step(
        self, actions: Sequence[ActionT], *, indices: Indices = None, timeout: float | None = None
    ) -> VectorOutcome[ObservationT]:
        """Apply one action per env named (all by default); returns one row per env.

        Raises:
            EnvError: the request was refused (INVALID_ARGUMENT: wrong action count, bad
                indices, a wrong-typed action; nothing was done).
            PayloadTypeError: a typed client got an action of another type (not sent).
            SessionLost: the stream ended. SessionTimeout: no answer within ``timeout``.
        """
        protocol = self._core.protocol
        request = protocol.step_request(actions, indices)
        outcome: VectorOutcome[ObservationT] = protocol.outcome(self._roundtrip(request, timeout))
        return outcome

    def send(self, actions: Sequence[ActionT], indices: Indices = None) -> int:
        """Send a step of the envs named (all by default) without waiting for its answer
        (EnvPool's ``send``); returns its request id. Several steps may be in flight at
        once, each on envs of its own; :meth:`recv` returns their outcomes as they come.
        A step naming an env that a step in flight names is refused (``recv`` raises
        EnvError FAILED_PRECONDITION); so is one past the server's cap on requests in
        flight (RESOURCE_EXHAUSTED, ``--max-vector-in-flight``, 4 by default).

        Raises:
            PayloadTypeError: a typed client got an action of another type (not sent).
            SessionLost: the stream ended.
        """
        request = self._core.protocol.step_request(actions, indices)
        self._send(request)
        self._inbox.sent[request.request_id] = None
        return int(request.request_id)

    def send_batch(self, action: ActionT, indices: Indices = None) -> int:
        """Send a step whose actions are one batch-form message (as :meth:`step_batch`)
        without waiting for its answer; :meth:`recv` returns it. Only where
        :attr:`native` is True.

        Raises:
            SessionLost: the stream ended.
        """
        request = self._core.protocol.step_batch_request(action, indices)
        self._send(request)
        self._inbox.sent[request.request_id] = None
        return int(request.request_id)

    def send_reset(
        self, *, seeds: Seeds = None, options: Options = None, episode_ids: EpisodeIds = None,
        indices: Indices = None, batch: bool = False,
    ) -> int:  # fmt: skip
        """Send a reset of the envs named without waiting for its answer (:meth:`recv`
        returns it, as for :meth:`send`); arguments as for :meth:`reset`.

        Raises:
            InvalidRequest: a list is not one entry per env named (nothing sent).
            SessionLost: the stream ended.
        """
        request = self._core.protocol.reset_request(seeds, options, episode_ids, indices, batch)
        self._send(request)
        self._inbox.sent[request.request_id] = None
        return int(request.request_id)

    def recv(self, *, timeout: float | None = None) -> VectorOutcome[ObservationT]:
        """The outcome of a request :meth:`send` sent, whichever is answered first (its
        ``indices`` say which envs). After a timeout the requests stay in flight: call
        again.

        Raises:
            EnvError: that request was refused as a whole (FAILED_PRECONDITION: an env
                it named is in flight; RESOURCE_EXHAUSTED: too many requests in flight).
            SessionStateError: nothing is in flight.
            SessionLost: the stream ended. SessionTimeout: no answer within ``timeout``.
        """
        response = self._answer(None, _deadline(timeout))
        outcome: VectorOutcome[ObservationT] = self._core.protocol.outcome(response)
        return outcome

    def _roundtrip(self, request: Any, timeout: float | None = None) -> Any:
        """Send ``request`` and wait for its own answer (answers to requests ``send``
        sent are kept for ``recv``). A call given up on holds its envs on the server until
        it is answered: its answer is awaited (and dropped) before the next request."""
        deadline = _deadline(timeout)
        inbox = self._inbox
        while inbox.abandoned and self._core.call is not None:
            self._answer(-1, deadline)  # files the answers read until none is abandoned
        self._send(request)
        request_id = request.request_id
        try:
            return self._answer(request_id, deadline)
        except SessionTimeout:
            inbox.abandoned.add(request_id)
            raise

    def _send(self, request: Any) -> None:
        core = self._core
        if core.must_reopen():
            self._inbox.clear()
            self.open()
        core.open_call()
        assert self._requests is not None  # set with the call
        self._requests.put(request)

    def _answer(self, wanted: int | None, deadline: float | None) -> Any:
        """The answer to request ``wanted`` (None: to any request of :meth:`send`).

        Raises:
            SessionTimeout: none by ``deadline``. SessionLost: the stream ended.
        """
        inbox = self._inbox
        found = inbox.take(wanted)
        if found is not None:
            return found
        call = self._core.call
        protocol = self._core.protocol
        while True:
            if wanted == -1 and not inbox.abandoned:
                return None
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                response = self._read(call, left)
            except grpc.RpcError as exc:
                self._lose(lost(exc.code(), exc.details()))
            if response is _END:
                self._lose(lost(call.code(), call.details()))
            if inbox.route(response, wanted, protocol):
                return response

    def _lose(self, error: SessionLost) -> NoReturn:
        self._inbox.clear()
        self._end_stream()
        self._let_go(self._core.stream_lost())
        raise error

    def step_batch(
        self, action: ActionT, *, indices: Indices = None, timeout: float | None = None
    ) -> VectorOutcome[ObservationT]:
        """Apply every action at once, given as one message in the env's batch form
        (a row per env named); the observations come back in batch form too. Only where
        :attr:`native` is True.

        Raises:
            EnvError: INVALID_ARGUMENT (the envs do not batch natively, or the batch does
                not fit), FAILED_PRECONDITION (an env named cannot step now).
            SessionLost: the stream ended. SessionTimeout: no answer within ``timeout``.
        """
        protocol = self._core.protocol
        request = protocol.step_batch_request(action, indices)
        outcome: VectorOutcome[ObservationT] = protocol.outcome(self._roundtrip(request, timeout))
        return outcome

    def _ask(self, command: str, indices: Indices, timeout: float | None) -> Any:
        return self._roundtrip(self._core.protocol.query_request(command, indices), timeout)

    def _vector_protocol(self) -> VectorProtocol:
        return self._core.protocol

    def snapshot(self, indices: Indices = None, *, timeout: float | None = None) -> list[bytes]:
        """Snapshots of the envs named (all by default), one per env in index order: the
        same bytes a :class:`Session`'s ``snapshot`` makes, so each restores into any env
        of a vector stream or into a ``Session`` (same env and version, a server holding
        the key). No episode changes.

        Raises:
            VectorEnvError: some envs could not be captured (``errors`` by index:
                UNIMPLEMENTED without snapshots, FAILED_PRECONDITION with no episode,
                RESOURCE_EXHAUSTED over the snapshot limit); their episodes go on.
            EnvError: the request was refused (bad indices; RESOURCE_EXHAUSTED: the whole
                answer is over the message limit, ask for fewer envs at a time).
            SessionLost: the stream ended. SessionTimeout: no answer within ``timeout``.
        """
        answer = self._ask("snapshot", indices, timeout)
        return self._core.protocol.rows(answer, "snapshots", "snapshot", snapshot_bytes)

    def restore(
        self, snapshots: Sequence[bytes], *, indices: Indices = None, timeout: float | None = None
    ) -> list[Restored]:
        """Continue the envs named (all by default) from one snapshot each (a vector's
        or a ``Session``'s); returns where each now is, in index order.

        Raises:
            VectorEnvError: some envs were not restored (``errors`` by index, ``done``:
                those that were): INVALID_ARGUMENT (not one intact snapshot),
                FAILED_PRECONDITION (another key, env or env version), UNIMPLEMENTED (no
                snapshots) leave that env's episode as it was; INTERNAL: reset it.
            InvalidRequest: not one snapshot per env named. TypeError: not bytes.
            EnvError: the request was refused (bad indices; nothing was restored).
            SessionLost: the stream ended. SessionTimeout: no answer within ``timeout``.
        """
        protocol = self._core.protocol
        request = protocol.restore_request(snapshots, indices)
        return protocol.restored(self._roundtrip(request, timeout))

    @classmethod
    def forked(
        cls,
        target: str | grpc.Channel | pb_grpc.EnvServiceStub | SyncStream,
        snapshots: Sequence[bytes],
        *,
        autoreset: str | AutoresetMode = "next_step",
        timeout: float | None = None,
        **options: Unpack[SessionOptions],
    ) -> Self:
        """An open vector stream of one env per snapshot, each env continuing from its
        snapshot: e.g. a GRPO group, ``VectorSession.forked(env, [env.snapshot()] * 8)``,
        G branches of one prefix stepped together. ``target`` is where (a target, channel
        or stub; or an open session: its server, channel and options). Admitted like any
        vector open, all N slots or none; if any env cannot be restored the stream is
        closed (every slot freed) and the error raised.

        Raises:
            ValueError: no snapshots. CapacityError, SessionRefused: as :meth:`open`.
            VectorEnvError, EnvError, SessionLost, SessionTimeout: as :meth:`restore`.
        """
        fork = cls._unopened_fork(target, snapshots, autoreset, options)
        try:
            fork.open()
            fork.restore(snapshots, timeout=timeout)
        except BaseException:
            fork.abort()
            raise
        return fork


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


VectorSession._generic_origin = VectorSession
