"""A vector stream's N gymnasium envs answered natively: one batch action in, one batch
observation out (see :mod:`.batch_convert` for the batch form).

:class:`GymnasiumBatch` is what ``GymnasiumEnvironment.make_batch`` returns. It keeps the
configuration (chosen at reset like the one-env session: env id, step limit, kwargs, render
mode, backend), checks and decodes batch actions, encodes the rows a backend returns, does
the autoreset bookkeeping and answers ``state``. Two backends step the envs:

* ``BACKEND_GYMNASIUM`` (:mod:`.gymnasium_backend`): N ``gymnasium.make`` envs in a loop,
  with the semantics of ``gymnasium.vector.SyncVectorEnv`` in NEXT_STEP, SAME_STEP and
  DISABLED, for any subset of indices.
* ``BACKEND_ENVPOOL`` (:mod:`.envpool_backend`): one EnvPool pool, for the ids it knows,
  with the differences its module lists.

The backend comes from the reset options (``backend``), else from the server's
``GYM_VECTOR_BACKEND`` (``gymnasium``, ``envpool`` or ``auto``: EnvPool where it serves
the id), else Gymnasium.

Snapshots per index (``snapshot(i)`` / ``restore(i, data)``) use the one-env session's
format, so an env of a vector and a session trade them; the Gymnasium backend serves them
for the ids the session can snapshot, the EnvPool backend not at all (UNIMPLEMENTED).

Errors: a batch action of the wrong structure, shape or dtype refuses the request
(INVALID_ARGUMENT); a row outside the action space refuses that index only; an env that
raises answers INTERNAL for its index; the neighbours' rows still come.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from openenv_grpc import AutoresetMode, BatchEnvironment, BatchTransition, InvalidAction
from openenv_grpc.environment import Rendering
from openenv_grpc_envs.gymnasium.backends import BatchBackend, Rows, rows_index
from openenv_grpc_envs.gymnasium.batch_convert import (
    BatchDecoder,
    encode_rows,
    encode_stacked,
    join_values,
    row_error,
    split_value,
)
from openenv_grpc_envs.gymnasium.configuration import Config, config_for
from openenv_grpc_envs.gymnasium.convert import ConversionError, fill_tensor, fill_value, nbytes
from openenv_grpc_envs.gymnasium.envpool_backend import EnvPoolEnvs, envpool_ids
from openenv_grpc_envs.gymnasium.gymnasium_backend import GymnasiumEnvs
from openenv_grpc_envs.gymnasium.snapshots import load_episode, restorer, snapshot_of
from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import (
    Backend,
    EnvDescription,
    GymnasiumAction,
    GymnasiumObservation,
    GymnasiumResetOptions,
    GymnasiumState,
)

__all__ = [
    "BACKEND_VARIABLE",
    "STATE_OBSERVATION_BYTES",
    "GymnasiumBatch",
    "default_backend",
    "rendered",
]

#: The server environment variable choosing the backend when a reset does not.
BACKEND_VARIABLE = "GYM_VECTOR_BACKEND"
_BACKEND_NAMES = {
    "": Backend.BACKEND_GYMNASIUM,
    "gymnasium": Backend.BACKEND_GYMNASIUM,
    "envpool": Backend.BACKEND_ENVPOOL,
    "auto": Backend.BACKEND_AUTO,
}
#: The state carries the last observation only when it is at most this many bytes.
STATE_OBSERVATION_BYTES = 4096


def default_backend() -> int:
    """The server's ``GYM_VECTOR_BACKEND`` as a ``Backend`` value (read at each call).

    Raises:
        InvalidAction: the variable holds another name (the open is refused, naming it).
    """
    name = os.environ.get(BACKEND_VARIABLE, "").strip().lower()
    if name not in _BACKEND_NAMES:
        raise InvalidAction(
            f"the server's {BACKEND_VARIABLE}={name!r} is not one of gymnasium, envpool, auto"
        )
    return int(_BACKEND_NAMES[name])


class GymnasiumBatch(
    BatchEnvironment[GymnasiumAction, GymnasiumObservation, GymnasiumState, GymnasiumResetOptions]
):
    """``size`` gymnasium envs of one configuration answered together.

    Args:
        size: How many envs.
        autoreset: What a step does when an episode ends (see ``AutoresetMode``).
        default_env_id: The env a reset without an env id starts (the server's GYM_ENV_ID).
        backend: The ``Backend`` used when a reset's options leave it unspecified.
    """

    def __init__(
        self, size: int, autoreset: AutoresetMode, default_env_id: str, backend: int
    ) -> None:
        super().__init__(size, autoreset)
        self._default_env_id = default_env_id
        self._default_backend = backend
        self._config: Config | None = None
        self._backend: BatchBackend | None = None
        # Per env: its episode ended at its last step and no reset followed yet.
        self._ended = np.zeros(size, dtype=np.bool_)
        self._steps = np.zeros(size, dtype=np.int64)
        self._returns = np.zeros(size, dtype=np.float64)
        self._terminated = np.zeros(size, dtype=np.bool_)
        self._truncated = np.zeros(size, dtype=np.bool_)
        self._seeds: list[int | None] = [None] * size
        self._decoder: BatchDecoder | None = None  # of the running backend's action space

    @property
    def description(self) -> EnvDescription | None:
        """The running configuration's description (None before the first reset)."""
        return self._backend.description if self._backend is not None else None

    # -- the contract -------------------------------------------------------------------

    def reset(
        self,
        indices: Sequence[int],
        seeds: Sequence[int | None],
        options: Sequence[GymnasiumResetOptions | None],
    ) -> BatchTransition[GymnasiumObservation]:
        config = self._common_config(options)
        backend = self._backend
        whole = len(indices) == self.size
        remake = backend is None or config != self._config
        if remake and backend is not None and not whole:
            raise InvalidAction(
                "a new configuration (env id, step limit, kwargs, render mode or backend) "
                f"needs a reset of all {self.size} envs; the envs of a vector stream run one"
            )
        pool = isinstance(backend, EnvPoolEnvs) and not remake
        if pool and any(seed is not None for seed in seeds):
            if not whole:
                raise InvalidAction(
                    "the EnvPool backend seeds its whole pool at once: seed a reset of every "
                    "env, or reset some envs without seeds"
                )
            remake = True  # a pool takes its seeds when it is made
        if remake:
            all_seeds: list[int | None] = [None] * self.size
            for i, seed in zip(indices, seeds, strict=True):
                all_seeds[i] = seed
            new = self._make_backend(config, all_seeds)  # raises before anything changes
            old, self._backend, self._config = backend, new, config
            if old is not None:
                old.close()
            self._ended[:] = False
            backend = new
        assert backend is not None
        rows = backend.reset(indices, seeds)
        done = rows.indices
        self._ended[done] = False
        self._steps[done] = 0
        self._returns[done] = 0.0
        self._terminated[done] = self._truncated[done] = False
        for i, seed in zip(indices, seeds, strict=True):
            if i not in rows.errors:
                self._seeds[i] = seed
        transition = self._transition(rows)
        transition.observation.env.CopyFrom(backend.description)
        return transition

    def step(
        self, indices: Sequence[int], actions: GymnasiumAction
    ) -> BatchTransition[GymnasiumObservation]:
        backend = self._require_backend()
        decoder = self._decoder
        if decoder is None or decoder.space is not backend.action_space:
            decoder = self._decoder = BatchDecoder(backend.action_space)
        try:
            batch, outside = decoder(actions.value, len(indices))
        except ConversionError as exc:
            raise InvalidAction(str(exc)) from None
        errors: dict[int, Exception] = {}
        disabled = self.autoreset is AutoresetMode.DISABLED
        ended = self._ended[rows_index(indices)].copy()
        refused = outside | ended if disabled else outside
        if refused.any():
            for row in np.flatnonzero(refused):
                index = indices[int(row)]
                if outside[row]:
                    message = row_error(batch, backend.action_space, int(row), "action")
                    errors[index] = InvalidAction(message)
                else:  # the server steps no ended env in DISABLED mode; guard all the same
                    errors[index] = RuntimeError(f"env {index} ended its episode: reset it")
            keep = ~refused
            indices = [i for i, k in zip(indices, keep, strict=True) if k]
            batch = _take(batch, keep)
            ended = ended[keep]
        resetting = (
            ended.tolist() if self.autoreset is AutoresetMode.NEXT_STEP else [False] * len(indices)
        )
        rows = backend.step(indices, batch, resetting) if indices else _no_rows()
        rows.errors.update(errors)
        self._account(rows)
        return self._transition(rows)

    def state(self, index: int) -> GymnasiumState:
        state = GymnasiumState(
            default_env_id=self._default_env_id,
            episode_steps=int(self._steps[index]),
            episode_return=float(self._returns[index]),
            terminated=bool(self._terminated[index]),
            truncated=bool(self._truncated[index]),
        )
        backend = self._backend
        if backend is None:
            return state
        state.env.CopyFrom(backend.description)
        seed = self._seeds[index]
        if seed is not None:
            state.seed = seed
        last = backend.last_observation(index)
        if last is not None and nbytes(last) <= STATE_OBSERVATION_BYTES:
            fill_value(state.last_observation, last, backend.observation_space)
        frame = backend.render(index)
        if isinstance(frame, np.ndarray):
            fill_tensor(state.frame, frame)
        return state

    def render(self, index: int) -> Rendering:
        """Env ``index``'s current frame (``GymnasiumEnvironment.render``).

        Raises:
            InvalidAction: no env runs yet. NotImplementedError: made without rendering.
        """
        if self._backend is None:
            raise InvalidAction("no env runs yet: reset first, then render")
        return rendered(self._backend.render(index))

    def snapshot(self, index: int) -> bytes:
        """Env ``index``'s episode, in ``GymnasiumEnvironment.snapshot``'s format.

        Raises:
            NotImplementedError: the EnvPool backend (EnvPool has no per-env state), or an
                env id that cannot snapshot (the message says why).
            InvalidAction: no env runs yet.
        """
        backend, config = self._require_backend(), self._config
        assert config is not None
        envs = _snapshot_backend(backend)
        last = envs.last_observation(index)
        shown = last if last is not None and nbytes(last) <= STATE_OBSERVATION_BYTES else None
        counters = (
            self._seeds[index], int(self._steps[index]), float(self._returns[index]),
            bool(self._terminated[index]), bool(self._truncated[index]),
        )  # fmt: skip
        return snapshot_of(config, counters, shown, envs.env(index))

    def restore(self, index: int, snapshot: bytes, *, ended: bool) -> None:
        """Env ``index`` continues from a snapshot of a session or of another batch's env.
        A batch that runs no env yet (a fork's fresh stream) takes the snapshot's
        configuration; one that runs another configuration refuses it.

        Raises:
            InvalidAction: the bytes are malformed, or of another configuration than the
                one the batch runs (the env is unchanged).
            NotImplementedError: the EnvPool backend.
        """
        recorded = load_episode(snapshot)
        episode = recorded.episode
        current = self._config
        config = config_for(episode.options, current, self._default_env_id)
        made: BatchBackend | None = None
        if current is None:
            made = self._make_backend(config, [None] * self.size)
        else:  # a snapshot records no render mode or backend: the running ones go on
            config = dataclasses.replace(
                config, render_mode=current.render_mode, backend=current.backend
            )
            if config != current:
                raise InvalidAction(
                    f"the snapshot runs {config.env_id} (step limit {config.max_episode_steps},"
                    f" kwargs {config.kwargs}) and this stream's envs run {current.env_id} "
                    f"(step limit {current.max_episode_steps}, kwargs {current.kwargs}): a "
                    "vector stream's envs run one configuration"
                )
        backend = made or self._require_backend()
        try:
            envs = _snapshot_backend(backend)
            restorer(envs.env(index), recorded.env)()
        except BaseException:
            if made is not None:
                made.close()
            raise
        envs.restored(index, recorded.last_observation)
        if made is not None:
            self._backend, self._config = made, config
        self._seeds[index] = episode.seed
        self._steps[index] = episode.steps
        self._returns[index] = episode.episode_return
        self._terminated[index] = episode.terminated
        self._truncated[index] = episode.truncated
        self._ended[index] = ended

    def join_actions(self, actions: Sequence[GymnasiumAction]) -> GymnasiumAction:
        backend = self._require_backend()
        try:
            value = join_values([a.value for a in actions], backend.action_space)
        except ConversionError as exc:
            raise InvalidAction(str(exc)) from None
        return GymnasiumAction(value=value)

    def split_observation(
        self, observation: GymnasiumObservation, rows: int
    ) -> list[GymnasiumObservation]:
        backend = self._require_backend()
        values = split_value(observation.value, backend.observation_space, rows)
        out = [GymnasiumObservation(value=v) for v in values]
        if observation.HasField("env"):
            for message in out:
                message.env.CopyFrom(observation.env)
        return out

    def cost_class(self) -> str:
        """What the server's measured placement groups this batch's calls by: the env id,
        the backend and the size ("" before the first reset), as the one-env session's
        ``cost_class`` gives its env id."""
        description = self.description
        if description is None:
            return ""
        return f"{description.env_id}/{Backend.Name(description.backend)}/{self.size}"

    def computes_in_threads(self) -> bool:
        """EnvPool's calls wait on its worker threads (see the server's placement)."""
        return isinstance(self._backend, EnvPoolEnvs)

    def close(self) -> None:
        backend, self._backend = self._backend, None
        if backend is not None:
            backend.close()

    # -- helpers ------------------------------------------------------------------------

    def _require_backend(self) -> BatchBackend:
        if self._backend is None:  # the server steps no env before its reset
            raise InvalidAction("reset the envs first: no environment runs yet")
        return self._backend

    def _common_config(self, options: Sequence[GymnasiumResetOptions | None]) -> Config:
        """The one configuration the options ask for (None keeps the running one)."""
        configs = [config_for(o, self._config, self._default_env_id) for o in options if o]
        if not configs:
            return config_for(None, self._config, self._default_env_id)
        if any(config != configs[0] for config in configs[1:]):
            raise InvalidAction(
                "the envs of a vector stream run one configuration: the reset options differ"
            )
        return configs[0]

    def _make_backend(self, config: Config, seeds: Sequence[int | None]) -> BatchBackend:
        backend = config.backend
        if backend == Backend.BACKEND_UNSPECIFIED:
            backend = self._default_backend
        if backend == Backend.BACKEND_AUTO:
            served = config.env_id in envpool_ids() and not config.render_mode
            backend = Backend.BACKEND_ENVPOOL if served else Backend.BACKEND_GYMNASIUM
        if backend == Backend.BACKEND_ENVPOOL:
            return EnvPoolEnvs(config, self.size, self.autoreset, seeds)
        return GymnasiumEnvs(config, self.size, self.autoreset)

    def _account(self, rows: Rows) -> None:
        """Step counts, returns and flags per env (for ``state`` and autoreset)."""
        if not rows.indices:
            return
        index = rows_index(rows.indices)
        columns = rows.columns
        if columns is None:
            rewards: Any = np.asarray(rows.rewards, dtype=np.float64)
            terminated: Any = np.asarray(rows.terminated, dtype=np.bool_)
            truncated: Any = np.asarray(rows.truncated, dtype=np.bool_)
        else:
            rewards, terminated, truncated = columns
        steps = self._steps[index] + 1
        returns = self._returns[index] + rewards
        reset = np.asarray(rows.reset, dtype=np.bool_) if rows.reset is not None else None
        if reset is not None:
            # NEXT_STEP: reset instead of stepped; SAME_STEP: stepped, then reset. Either
            # way the row starts a new episode.
            steps[reset] = 0
            returns[reset] = 0.0
        self._steps[index] = steps
        self._returns[index] = returns
        self._terminated[index] = terminated
        self._truncated[index] = truncated
        ended = terminated | truncated
        if reset is not None and self.autoreset is AutoresetMode.SAME_STEP:
            ended &= ~reset
        self._ended[index] = ended

    def _transition(self, rows: Rows) -> BatchTransition[GymnasiumObservation]:
        backend = self._backend
        assert backend is not None
        space = backend.observation_space
        encode = encode_stacked if rows.stacked else encode_rows
        observation = GymnasiumObservation()
        encode(observation.value, rows.observations, space)
        final: GymnasiumObservation | None = None
        if rows.final_observations is not None:
            final = GymnasiumObservation()
            encode(final.value, rows.final_observations, space)
        return BatchTransition(
            observation=observation,
            rewards=rows.rewards,
            terminated=rows.terminated,
            truncated=rows.truncated,
            infos=rows.infos,
            reset=rows.reset,
            final_observation=final,
            final_infos=rows.final_infos,
            errors=rows.errors or None,
        )


def _snapshot_backend(backend: BatchBackend) -> GymnasiumEnvs:
    """``backend`` when its envs can be captured one by one.

    Raises:
        NotImplementedError: the EnvPool backend (UNIMPLEMENTED, with the reason).
    """
    if not isinstance(backend, GymnasiumEnvs):
        raise NotImplementedError(
            "the EnvPool backend cannot snapshot or restore one env (EnvPool keeps no "
            "per-env state it can hand out); reset with backend BACKEND_GYMNASIUM"
        )
    return backend


def _take(batch: Any, keep: npt.NDArray[np.bool_]) -> Any:
    """The rows of a decoded batch where ``keep`` is True."""
    if isinstance(batch, Mapping):
        return {key: _take(value, keep) for key, value in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_take(value, keep) for value in batch)
    return batch[keep]


def _no_rows() -> Rows:
    return Rows([], [], False, [], [], [])


def rendered(frame: Any) -> Rendering:
    """A gymnasium env's frame, as ``render()`` answers it.

    Raises:
        NotImplementedError: there is none: the env was made without rendering.
    """
    if frame is None:
        raise NotImplementedError(
            "the env was made without rendering: reset it with the reset option "
            'render_mode="rgb_array"'
        )
    return cast(Rendering, frame)  # an RGB array: gymnasium's render() is untyped
