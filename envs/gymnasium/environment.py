"""The gymnasium environment: serves any registered Gymnasium env, chosen at reset.

One instance holds at most one ``gymnasium.Env``. A reset whose options name another
configuration (env id, step limit, make kwargs) makes the new env first and only then
closes the old one, so a refused configuration leaves the running episode untouched.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import gymnasium
from google.protobuf import json_format

from openenv_grpc import Environment, InvalidAction, Transition
from openenv_grpc_envs.gymnasium.convert import (
    ConversionError,
    decode,
    describe_space,
    fill_value,
    nbytes,
)
from openenv_grpc_envs.gymnasium.snapshots import (
    Episode,
    NotSnapshotable,
    dump_episode,
    load_episode,
    restorer,
)
from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import (
    EnvDescription,
    GymnasiumAction,
    GymnasiumObservation,
    GymnasiumResetOptions,
    GymnasiumState,
)

__all__ = ["ENV_ID_VARIABLE", "GymnasiumEnvironment"]

#: The server environment variable naming the env a reset without an env_id starts.
ENV_ID_VARIABLE = "GYM_ENV_ID"
#: The state carries the last observation only when it is at most this many bytes.
STATE_OBSERVATION_BYTES = 4096
#: make() arguments a client may not set: the server never renders, the max_episode_steps
#: field has its own place, and the others change the step semantics under the session.
RESERVED_KWARGS = frozenset(
    {"render_mode", "max_episode_steps", "autoreset", "apply_api_compatibility"}
)

_ale_lock = threading.Lock()
_ale_registered = False


def _register_ale() -> None:
    """Register the ALE (Atari) ids once per process; ale-py is imported only if needed."""
    global _ale_registered
    with _ale_lock:
        if _ale_registered:
            return
        try:
            import ale_py
        except ImportError:
            return  # the id will be reported unknown, which it is in this server
        gymnasium.register_envs(ale_py)
        _ale_registered = True


@dataclass(frozen=True)
class _Config:
    """What gymnasium.make gets; equal configs reuse the running env."""

    env_id: str
    max_episode_steps: int | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


class GymnasiumEnvironment(
    Environment[GymnasiumAction, GymnasiumObservation, GymnasiumState, GymnasiumResetOptions]
):
    """Any registered Gymnasium environment, chosen by id in the reset options."""

    name = "gymnasium"
    version = "1.0.0"
    description = (
        "Any registered Gymnasium environment (classic control, toy text, Box2D, "
        "Atari via ale-py), chosen by env_id at reset."
    )
    # Execution hint: measured by the server per env id (see cost_class). Classic control
    # steps take microseconds and run on the event loop; what measures slow (a first
    # reset that makes the env, a heavy id) stays on the thread pool.
    runs_inline = None

    def __init__(self) -> None:
        # Read here, not at import, so each server process (and test) sets its own.
        self._default_env_id = os.environ.get(ENV_ID_VARIABLE, "").strip()
        self._env: gymnasium.Env[Any, Any] | None = None
        self._config: _Config | None = None
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
        config = self._config_for(options)
        if self._env is None or config != self._config:
            env, description = self._make(config)  # raises before anything changes
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
        return Transition(message, info=_jsonable(info))

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
            info=_jsonable(info),
        )

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
        return state

    def snapshot(self) -> bytes:
        """The episode as JSON (see :mod:`.snapshots`): the configuration (env id, step
        limit, kwargs), the session's counters, the last observation when :meth:`state`
        shows it, and the gymnasium env's own state (classic control and toy text
        attributes, or ALE's emulator state with its generator, plus ``np_random`` and
        the wrappers' counters).

        Raises:
            InvalidAction: no episode yet, or the env id cannot snapshot (Box2D, MuJoCo,
                JAX-based and unlisted envs; the message says why).
        """
        env, config = self._env, self._config
        if env is None or config is None:  # the server never asks before a reset
            raise InvalidAction("no episode to snapshot: call reset first")
        options = GymnasiumResetOptions(env_id=config.env_id)
        if config.max_episode_steps is not None:
            options.max_episode_steps = config.max_episode_steps
        if config.kwargs:
            options.kwargs.update(config.kwargs)
        last = self._last_observation
        shown = last if last is not None and nbytes(last) <= STATE_OBSERVATION_BYTES else None
        episode = Episode(
            options, self._seed, self._steps, self._return, self._terminated, self._truncated
        )
        try:
            return dump_episode(episode, shown, env)
        except NotSnapshotable as exc:
            raise InvalidAction(f"{config.env_id} cannot snapshot: {exc}") from None

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
        config = self._config_for(episode.options)
        reuse = self._env is not None and config == self._config
        if reuse:
            env, description = self._env, self._description
        else:
            env, description = self._make(config)  # raises before anything changes
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

    def _config_for(self, options: GymnasiumResetOptions | None) -> _Config:
        """The configuration a reset asks for, or InvalidAction."""
        if options is None and self._config is not None:
            return self._config
        current = self._config.env_id if self._config is not None else self._default_env_id
        env_id = (options.env_id.strip() if options is not None else "") or current
        if not env_id:
            raise InvalidAction(
                "no environment chosen: set GymnasiumResetOptions.env_id "
                f"(or start the server with {ENV_ID_VARIABLE})"
            )
        if ":" in env_id:  # gymnasium.make would import the module named before the colon
            raise InvalidAction(
                f"env_id {env_id!r} must be a registered id; module:id entry points are refused"
            )
        if options is None:
            return _Config(env_id)
        max_steps: int | None = None
        if options.HasField("max_episode_steps"):
            max_steps = options.max_episode_steps
            if max_steps < 1:
                raise InvalidAction(
                    "max_episode_steps must be at least 1 (leave it unset for the registry's limit)"
                )
        kwargs = _plain(json_format.MessageToDict(options.kwargs)) if options.kwargs.fields else {}
        reserved = sorted(RESERVED_KWARGS.intersection(kwargs))
        if reserved:
            raise InvalidAction(
                f"kwargs {reserved} are not allowed (the server never renders; use the "
                "max_episode_steps field for a step limit)"
            )
        return _Config(env_id, max_steps, kwargs)

    def _make(self, config: _Config) -> tuple[gymnasium.Env[Any, Any], EnvDescription]:
        """Make the env a config describes and describe it, or raise InvalidAction."""
        env_id = config.env_id
        if env_id not in gymnasium.registry:
            _register_ale()  # ALE/... and the legacy Atari ids live in ale-py
        try:
            env = gymnasium.make(
                env_id, max_episode_steps=config.max_episode_steps, **config.kwargs
            )
        except gymnasium.error.UnregisteredEnv as exc:
            raise InvalidAction(f"unknown env_id {env_id!r}: {exc}") from None
        except (gymnasium.error.DependencyNotInstalled, ImportError) as exc:
            raise InvalidAction(
                f"env_id {env_id!r} needs a package this server lacks: {exc}"
            ) from None
        except (gymnasium.error.Error, TypeError, ValueError, KeyError, AssertionError) as exc:
            # Raised by make() or the env's constructor for the client's kwargs.
            raise InvalidAction(
                f"cannot make {env_id!r} with kwargs {config.kwargs}: {type(exc).__name__}: {exc}"
            ) from None
        try:
            description = EnvDescription(env_id=env_id)
            if config.kwargs:
                description.kwargs.update(config.kwargs)
            spec = env.spec
            description.max_episode_steps = (spec.max_episode_steps or 0) if spec else 0
            describe_space(env.observation_space, description.observation_space)
            describe_space(env.action_space, description.action_space)
        except ConversionError as exc:
            env.close()
            raise InvalidAction(f"env_id {env_id!r} cannot be served: {exc}") from None
        return env, description


def _plain(obj: Any) -> Any:
    """Struct values as make() expects them: whole-number floats become ints."""
    if isinstance(obj, float) and obj.is_integer():
        return int(obj)
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    return obj


def _jsonable(obj: Any) -> Any:
    """Gymnasium's info as JSON-like values: numpy scalars and small arrays become Python
    numbers and lists, non-finite floats strings; large arrays are summarised."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    size = getattr(obj, "size", None)
    tolist = getattr(obj, "tolist", None)  # numpy scalars and arrays
    if callable(tolist):
        if isinstance(size, int) and size > 1024:
            return f"<array shape={list(obj.shape)} dtype={obj.dtype}>"
        return _jsonable(tolist())
    return repr(obj)
