"""``VectorSession``: N environment instances over one stream, for blocking code.

``with VectorSession(target, 64) as envs: envs.reset(seeds=0); envs.step(actions)``: one
message each way per vector step, whatever N. It moves its bytes like ``Session`` (the
blocking transport :class:`~openenv_grpc.client.sync_session.SyncStream`); what a vector
stream is lives in :mod:`openenv_grpc.client.vector_core` and
:mod:`openenv_grpc.client.vector_protocol`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic

import grpc

from openenv_grpc.client.session_core import ActionT, ObservationT, ResetOptionsT, StateT
from openenv_grpc.client.sync_session import SyncStream
from openenv_grpc.client.vector_core import VectorBase
from openenv_grpc.client.vector_outcome import VectorOutcome
from openenv_grpc.client.vector_protocol import EpisodeIds, Indices, Options, Seeds
from openenv_grpc.environment import AutoresetMode
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # only the type checker needs these
    from typing_extensions import Unpack

    from openenv_grpc.client.session_core import SessionOptions

__all__ = ["VectorSession"]


class VectorSession(SyncStream, VectorBase, Generic[ActionT, ObservationT, StateT, ResetOptionsT]):
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
        self._configure(num_envs, autoreset)
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

    def state(self, index: int, *, timeout: float | None = None) -> StateT:
        """The state of env ``index``.

        Raises:
            EnvError: that env's state() raised (its episode goes on), or a bad index.
            SessionLost: the stream ended. SessionTimeout: no answer within ``timeout``.
        """
        protocol = self._core.protocol
        answer = protocol.states(self._roundtrip(protocol.state_request([index]), timeout))
        state: StateT = self._single_state(index, answer)
        return state

    def states(self, indices: Indices = None, *, timeout: float | None = None) -> list[StateT]:
        """The states of the envs named (all by default), in index order.

        Raises:
            EnvError: an env's state() raised (the message names it), or bad indices.
            SessionLost: the stream ended. SessionTimeout: no answer within ``timeout``.
        """
        protocol = self._core.protocol
        answer = protocol.states(self._roundtrip(protocol.state_request(indices), timeout))
        states: list[Any] = self._all_states(answer)
        return states


VectorSession._generic_origin = VectorSession
