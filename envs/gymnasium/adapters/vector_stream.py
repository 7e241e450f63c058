"""The vector-stream transport of :class:`RemoteGymnasiumVectorEnv`: one ``VectorSession``
stream holds the N envs; the server batches them natively (``GymnasiumEnvironment
.make_batch``) and autoresets them.

A vector step is one request (the actions as one tensor per leaf, written with one
``tobytes``) and one response (the observations as one tensor per leaf); numpy gets
read-only views of the received bytes (:func:`.batch_convert.view_batch`), so the batch
is not copied after protobuf hands it over.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode

from openenv_grpc import EnvError, VectorOutcome
from openenv_grpc_envs.gymnasium import convert
from openenv_grpc_envs.gymnasium.adapters.transport import BACKENDS, Batch
from openenv_grpc_envs.gymnasium.batch_convert import (
    TensorLayout,
    encode_stacked,
    observation_layout,
    view_batch,
)
from openenv_grpc_envs.gymnasium.client import GymnasiumVectorEnv
from openenv_grpc_envs.gymnasium.convert import ConversionError
from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import (
    GymnasiumAction,
    GymnasiumObservation,
    GymnasiumResetOptions,
)

__all__ = ["VectorStream"]

_LEAF_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)

_MODES = {
    AutoresetMode.NEXT_STEP: "next_step",
    AutoresetMode.SAME_STEP: "same_step",
    AutoresetMode.DISABLED: "disabled",
}


class VectorStream:
    """``num_envs`` envs on one vector stream; see :class:`.transport.Transport`.

    Raises (from the constructor): CapacityError when the N slots are not free (nothing
    is admitted), SessionRefused, EnvError when the server refuses the configuration or
    does not batch the gymnasium env natively.
    """

    def __init__(
        self,
        target: str,
        num_envs: int,
        options: GymnasiumResetOptions,
        autoreset_mode: AutoresetMode,
        *,
        backend: str | None,
        credentials: grpc.ChannelCredentials | None,
        timeout: float | None,
        session_options: dict[str, Any],
    ) -> None:
        # Blocking calls from the caller's thread: no thread hop per step.
        self._num_envs = num_envs
        self._timeout = timeout
        #: Where the last batch observation's tensor lay in its message (see _view).
        self._layout: TensorLayout | None = None
        self._options = GymnasiumResetOptions()
        self._options.CopyFrom(options)
        if backend is not None:
            self._options.backend = BACKENDS[backend]  # type: ignore[assignment]
        self._session = GymnasiumVectorEnv(
            target,
            num_envs,
            autoreset=_MODES[autoreset_mode],
            credentials=credentials,
            **session_options,
        )
        self._session.open()
        try:
            if not self._session.native:
                raise EnvError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "the server does not batch the gymnasium env natively (an older server?): "
                    "use transport='sessions'",
                )
            # One unseeded reset of every env describes the spaces.
            first = self._reset(list(range(num_envs)), [None] * num_envs, self._options)
            self.description = _observation(first).env
            self._set_spaces()
        except BaseException:
            self._session.close()
            raise

    def _set_spaces(self) -> None:
        self._observation_space = convert.build_space(self.description.observation_space)
        self._action_space = convert.build_space(self.description.action_space)

    @property
    def session(self) -> GymnasiumVectorEnv:
        """The vector stream (its ``session_id`` tags the server's logs)."""
        return self._session

    def _reset(
        self,
        indices: Sequence[int],
        seeds: Sequence[int | None],
        options: GymnasiumResetOptions | None,
    ) -> VectorOutcome[GymnasiumObservation]:
        outcome = self._session.reset(
            seeds=list(seeds),
            options=None if options is None else [options] * len(indices),
            indices=None if len(indices) == self._num_envs else list(indices),
            batch=True,
            timeout=self._timeout,
        )
        _raise_first(outcome)
        return outcome

    def reset(
        self,
        indices: Sequence[int],
        seeds: Sequence[int | None],
        options: GymnasiumResetOptions | None,
    ) -> Batch:
        if options is not None:
            options.backend = self._options.backend  # the stream keeps its backend
        outcome = self._reset(indices, seeds, options)
        observation = _observation(outcome)  # a reset also describes the env: parse it
        if options is not None:
            self.description = observation.env
            self._set_spaces()
            self._options = options
        count = len(indices)
        return Batch(
            view_batch(observation.value, self._observation_space, count),
            np.zeros(count, dtype=np.float64),
            np.zeros(count, dtype=np.bool_),
            np.zeros(count, dtype=np.bool_),
            [(i, dict(outcome.infos.get(i, {}))) for i in indices],
        )

    def step(self, actions: Any) -> Batch:
        action = GymnasiumAction()
        encode_stacked(action.value, actions, self._action_space)
        outcome = self._session.step_batch(action, timeout=self._timeout)
        _raise_first(outcome)
        return self._batch(outcome)

    # -- EnvPool's asynchronous calls ---------------------------------------------------

    def async_reset(self, groups: Sequence[Sequence[int]]) -> None:
        """Send an unseeded reset of each group of envs (one request each), unanswered."""
        for indices in groups:
            self._session.send_reset(
                indices=None if len(indices) == self._num_envs else list(indices), batch=True
            )

    def send(self, actions: Any, indices: Sequence[int]) -> None:
        """Send a step of ``indices`` (increasing), one action row each, unanswered."""
        action = GymnasiumAction()
        encode_stacked(action.value, actions, self._action_space)
        self._session.send_batch(action, None if len(indices) == self._num_envs else list(indices))

    def recv(self) -> tuple[list[int], Batch]:
        """The rows of whichever request sent is answered first, and their env indices.

        Raises:
            EnvError: the request was refused, or one of its envs failed.
        """
        outcome = self._session.recv(timeout=self._timeout)
        _raise_first(outcome)
        return list(outcome.indices), self._batch(outcome)

    @property
    def in_flight(self) -> int:
        """Requests sent and not received yet."""
        return self._session.in_flight

    def _batch(self, outcome: VectorOutcome[GymnasiumObservation]) -> Batch:
        """A reset's or a step's rows as a :class:`Batch` (row r is env indices[r])."""
        indices = outcome.indices
        n = len(indices)
        batch = Batch(
            self._view(outcome.batch_payload, n),
            np.asarray(outcome.rewards, dtype=np.float64),
            np.asarray(outcome.terminated, dtype=np.bool_),
            np.asarray(outcome.truncated, dtype=np.bool_),
        )
        finals: Any = None
        ended = [r for r, reset in enumerate(outcome.autoreset) if reset]
        if outcome.batch_final_payload is not None and ended:
            finals = self._view(outcome.batch_final_payload, len(ended))
        final_row = {r: j for j, r in enumerate(ended)} if finals is not None else {}
        infos = outcome.infos
        if not infos and not final_row:
            return batch  # classic control: no row has an info
        for r, i in enumerate(indices):
            if r in final_row:  # SAME_STEP: the ended episode's last observation and info
                final_info = dict(outcome.final_infos.get(i, {}))
                batch.infos.append((r, {"final_obs": _row(finals, final_row[r]),
                                        "final_info": final_info}))  # fmt: skip
            info = infos.get(i)
            if info is not None or r in final_row:
                batch.infos.append((r, dict(info or {})))
        return batch

    def _view(self, payload: Any, rows: int) -> Any:
        """The batch observation in ``payload`` (an ``Any``) as Gymnasium batches it: a
        view into the payload's bytes when it is one tensor (reading ``payload.value`` is
        the one copy), else parsed and viewed.

        Raises:
            ConversionError: the server sent no batch, or one of another shape.
        """
        if payload is None:
            raise ConversionError("observation: the server answered without a batch")
        data = payload.value
        space = self._observation_space
        expected: tuple[int, ...] | None = None
        if isinstance(space, _LEAF_SPACES):  # one tensor: a view into the bytes
            expected = (rows, *(() if isinstance(space, spaces.Discrete) else space.shape))
            layout = self._layout
            if layout is not None and layout.dims == expected and layout.fits(data):
                return layout.view(data)  # the layout of the last batch: no parse
        layout = observation_layout(data)  # checks the bytes whatever the space
        if expected is not None and layout is not None and layout.dims == expected:
            self._layout = layout
            return layout.view(data)
        return view_batch(GymnasiumObservation.FromString(data).value, space, rows)

    def frames(self) -> tuple[Any, ...]:
        states = self._session.states(timeout=self._timeout)
        return tuple(
            convert.to_numpy(s.frame, writable=True, what="frame") if s.frame.dtype else None
            for s in states
        )

    def close(self) -> None:
        self._session.close()


def _row(batch: Any, row: int) -> Any:
    """Row ``row`` of a batched structure (a view)."""
    if isinstance(batch, dict):
        return {key: _row(value, row) for key, value in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_row(value, row) for value in batch)
    return batch[row]


def _observation(outcome: VectorOutcome[GymnasiumObservation]) -> GymnasiumObservation:
    observation = outcome.batch_observation
    if observation is None:
        raise ConversionError("observation: the server answered without a batch")
    return observation


def _raise_first(outcome: VectorOutcome[Any]) -> None:
    """A per-env error as the VectorEnv API knows errors: an exception (the others ran)."""
    if outcome.errors:
        index, error = min(outcome.errors.items())
        raise EnvError(error.code, f"env {index}: {error.message}")
