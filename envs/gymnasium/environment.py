"""The gymnasium environment: serves any registered Gymnasium env, chosen at reset.

One instance holds at most one ``gymnasium.Env``. A reset whose options name another
configuration (env id, step limit, make kwargs) makes the new env first and only then
closes the old one, so a refused configuration leaves the running episode untouched.
"""

from __future__ import annotations

import os
from typing import Any

import gymnasium
import numpy as np

from openenv_grpc import AutoresetMode, Environment, InvalidAction, Transition
from openenv_grpc.environment import Rendering
from openenv_grpc_envs.gymnasium.batch import GymnasiumBatch, default_backend, rendered
from openenv_grpc_envs.gymnasium.configuration import (
    ENV_ID_VARIABLE,
    Config,
    config_for,
    jsonable,
    make_env,
)
from openenv_grpc_envs.gymnasium.convert import (
    ConversionError,
    decode,
    fill_tensor,
    fill_value,
    nbytes,
)
from openenv_grpc_envs.gymnasium.snapshots import load_episode, restorer, snapshot_of
from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import (
    Backend,
    EnvDescription,
    GymnasiumAction,
    GymnasiumObservation,
    GymnasiumResetOptions,
    GymnasiumState,
)

__all__ = ["ENV_ID_VARIABLE", "GymnasiumEnvironment"]

#: The state carries the last observation only when it is at most this many bytes.
STATE_OBSERVATION_BYTES = 4096


class GymnasiumEnvironment(
    Environment[GymnasiumAction, GymnasiumObservation, GymnasiumState, GymnasiumResetOptions]
):
    """Any registered Gymnasium environment, chosen by id in the reset options."""

    name = "gymnasium"
    version = "1.0.0"
    description = (
        "Any registered Gymnasium environment (classic control, toy text, Box2D, "
        "Atari via ale-py), chosen by env_id at reset. Vector streams are answered as one "
        "native batch with SyncVectorEnv's semantics, or (reset option backend=ENVPOOL) "
        "by one EnvPool pool: seeded per pool when made (a seeded reset of some envs is "
        "refused), EnvPool's generators, float32 rewards, its own ids."
    )
    # Execution hint: measured by the server per env id (see cost_class). Classic control
    # steps take microseconds and run on the event loop; what measures slow (a first
    # reset that makes the env, a heavy id) stays on the thread pool.
    runs_inline = None

    def __init__(self) -> None:
        # Read here, not at import, so each server process (and test) sets its own.
        self._default_env_id = os.environ.get(ENV_ID_VARIABLE, "").strip()
        self._env: gymnasium.Env[Any, Any] | None = None
        self._config: Config | None = None
        self._description: EnvDescription | None = None
        self._seed: int | None = None
        self._steps = 0
        self._return = 0.0
        self._last_observation: Any = None
        self._terminated = False
        self._truncated = False

    # -- the contract -------------------------------------------------------------------

    def reset(
        self, *, seed: int | None, episode_id: str, options: GymnasiumResetOptions | None
    ) -> Transition[GymnasiumObservation]:
        config = config_for(options, self._config, self._default_env_id)
        if config.backend == Backend.BACKEND_ENVPOOL:
            raise InvalidAction(
                "BACKEND_ENVPOOL serves vector streams only; a session runs Gymnasium"
            )
        if self._env is None or config != self._config:
            env, description = make_env(config)  # raises before anything changes
            old, self._env = self._env, env
            self._config, self._description = config, description
            self._last_observation = None  # it belonged to the old env's space
            if old is not None:
                old.close()
        env = self._env
        assert env is not None and self._description is not None
        observation, info = env.reset(seed=seed)
        if seed is not None:
            env.action_space.seed(seed)
        self._seed = seed
        self._steps = 0
        self._return = 0.0
        self._terminated = self._truncated = False
        self._last_observation = observation
        message = self._observation(observation)
        message.env.CopyFrom(self._description)
        return Transition(message, info=jsonable(info))

    def step(self, action: GymnasiumAction) -> Transition[GymnasiumObservation]:
        env = self._env
        if env is None:  # the server only steps after a successful reset
            raise RuntimeError("step before reset")
        try:
            value = decode(action.value, env.action_space, "action")
        except ConversionError as exc:
            raise InvalidAction(str(exc)) from None
        observation, reward, terminated, truncated, info = env.step(value)
        self._steps += 1
        self._return += float(reward)
        self._terminated, self._truncated = bool(terminated), bool(truncated)
        self._last_observation = observation
        return Transition(
            self._observation(observation),
            reward=float(reward),
            terminated=bool(terminated),
            truncated=bool(truncated),
            info=jsonable(info),
        )

    @classmethod
    def make_batch(cls, size: int, autoreset: AutoresetMode) -> GymnasiumBatch:
        """``size`` envs answered natively for a vector stream (see :mod:`.batch`): one
        batch action (a Tensor per leaf, leading dimension k) in, one batch observation out;
        Gymnasium's SyncVectorEnv semantics, or one EnvPool pool (``backend``).

        Raises:
            InvalidAction: the server's GYM_VECTOR_BACKEND names no backend.
        """
        default_env_id = os.environ.get(ENV_ID_VARIABLE, "").strip()
        return GymnasiumBatch(size, autoreset, default_env_id, default_backend())

    def state(self) -> GymnasiumState:
        state = GymnasiumState(
            default_env_id=self._default_env_id,
            episode_steps=self._steps,
            episode_return=self._return,
            terminated=self._terminated,
            truncated=self._truncated,
        )
        if self._description is not None:
            state.env.CopyFrom(self._description)
        if self._seed is not None:
            state.seed = self._seed
        env, last = self._env, self._last_observation
        if env is not None and last is not None and nbytes(last) <= STATE_OBSERVATION_BYTES:
            fill_value(state.last_observation, last, env.observation_space)
        if env is not None and env.render_mode == "rgb_array":
            frame = env.render()
            if isinstance(frame, np.ndarray):
                fill_tensor(state.frame, frame)
        return state

    def snapshot(self) -> bytes:
        """The episode as JSON (see :mod:`.snapshots`): the configuration (env id, step
        limit, kwargs), the session's counters, the last observation when :meth:`state`
        shows it, and the gymnasium env's own state (classic control and toy text
        attributes, or ALE's emulator state with its generator, plus ``np_random`` and
        the wrappers' counters).

        Raises:
            InvalidAction: no episode yet.
            NotImplementedError: the env id cannot snapshot (Box2D, MuJoCo, JAX-based and
                unlisted envs; the message says why): UNIMPLEMENTED in-band.
        """
        env, config = self._env, self._config
        if env is None or config is None:  # the server never asks before a reset
            raise InvalidAction("no episode to snapshot: call reset first")
        last = self._last_observation
        shown = last if last is not None and nbytes(last) <= STATE_OBSERVATION_BYTES else None
        counters = (self._seed, self._steps, self._return, self._terminated, self._truncated)
        return snapshot_of(config, counters, shown, env)

    def restore(self, snapshot: bytes) -> None:
        """Continue from :meth:`snapshot`'s bytes. The env is made from the recorded
        configuration through the same checks as a reset (a running env of the same
        configuration is reused), then its state is put back.

        Raises:
            InvalidAction: a field is malformed, or the configuration is refused or makes
                another env (the episode is unchanged).
        """
        recorded = load_episode(snapshot)
        episode = recorded.episode
        config = config_for(episode.options, self._config, self._default_env_id)
        reuse = self._env is not None and config == self._config
        if reuse:
            env, description = self._env, self._description
        else:
            env, description = make_env(config)  # raises before anything changes
        assert env is not None and description is not None
        try:
            put_back = restorer(env, recorded.env)
        except BaseException:
            if not reuse:
                env.close()
            raise
        put_back()
        if not reuse:
            old, self._env = self._env, env
            self._config, self._description = config, description
            if old is not None:
                old.close()
        self._seed, self._steps, self._return = episode.seed, episode.steps, episode.episode_return
        self._terminated, self._truncated = episode.terminated, episode.truncated
        self._last_observation = recorded.last_observation

    def render(self) -> Rendering:
        """The env's current frame (uint8, height x width x 3).

        Raises:
            InvalidAction: no env runs yet (reset first).
            NotImplementedError: the env was made without ``render_mode="rgb_array"``.
        """
        if self._env is None:
            raise InvalidAction("no env runs yet: reset first, then render")
        return rendered(self._env.render() if self._env.render_mode == "rgb_array" else None)

    def close(self) -> None:
        env, self._env = self._env, None
        if env is not None:
            env.close()

    def cost_class(self) -> str:
        """The running env id: the server measures each id's calls apart ("" before the
        first reset)."""
        config = self._config
        return config.env_id if config is not None else ""

    # -- helpers ------------------------------------------------------------------------

    def _observation(self, observation: Any) -> GymnasiumObservation:
        """Fill the message in place: the frame's bytes are copied into it only once."""
        assert self._env is not None
        message = GymnasiumObservation()
        fill_value(message.value, observation, self._env.observation_space)
        return message
