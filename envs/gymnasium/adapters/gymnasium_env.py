"""One remote session of the ``gymnasium`` env as a local ``gymnasium.Env``.

::

    from openenv_grpc_envs.gymnasium.adapters import RemoteGymnasiumEnv

    with RemoteGymnasiumEnv("127.0.0.1:50051", "CartPole-v1") as env:
        obs, info = env.reset(seed=0)             # a float32 ndarray of shape (4,)
        obs, reward, terminated, truncated, info = env.step(env.action_space.sample())

Where the spaces come from: the Info RPC names the message types only
(``GymnasiumObservation`` ...), not the spaces of the env a session will run, because the
server picks that env at reset. The server describes the spaces (``EnvDescription``) in
every reset observation and in ``state()``; the constructor therefore opens the session,
makes one unseeded reset and builds ``observation_space`` / ``action_space`` from that
description with :func:`openenv_grpc_envs.gymnasium.convert.build_space`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, SupportsFloat

import grpc
import gymnasium
import numpy as np
import numpy.typing as npt

from openenv_grpc.client.fields import set_field
from openenv_grpc.client.outcome import StepOutcome
from openenv_grpc_envs.gymnasium import convert
from openenv_grpc_envs.gymnasium.adapters.registration import spec_for
from openenv_grpc_envs.gymnasium.client import GymnasiumEnv
from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import (
    EnvDescription,
    GymnasiumAction,
    GymnasiumObservation,
    GymnasiumResetOptions,
)

__all__ = ["RemoteGymnasiumEnv", "reset_options"]

#: Keys a ``reset(options=...)`` mapping may hold; they reconfigure the remote env.
OPTION_KEYS = frozenset({"env_id", "max_episode_steps", "kwargs"})


#: The render modes the adapters offer: frames come from the server (state().frame).
RENDER_MODES = ["rgb_array"]


def reset_options(
    env_id: str = "",
    max_episode_steps: int | None = None,
    kwargs: Mapping[str, Any] | None = None,
    render_mode: str | None = None,
) -> GymnasiumResetOptions:
    """The ``GymnasiumResetOptions`` for an env id, an optional step limit, make kwargs and
    a render mode (None or "rgb_array").

    Returns:
        The message; ``kwargs`` travel as a ``Struct`` (JSON-like values only).

    Raises:
        PayloadTypeError: a value of the wrong type (a ``TypeError``, naming the field).
        InvalidRequest: a value out of range, or a kwarg value a ``Struct`` cannot hold
            (a ``ValueError``, naming the field).
    """
    options = GymnasiumResetOptions()
    set_field(options, "env_id", env_id)
    set_field(options, "render_mode", render_mode or "")
    if max_episode_steps is not None:
        set_field(options, "max_episode_steps", max_episode_steps)
    if kwargs:
        set_field(options, "kwargs", kwargs)
    return options


def _options_from_mapping(
    options: Mapping[str, Any], current: GymnasiumResetOptions
) -> GymnasiumResetOptions:
    """``current`` with the keys of a gymnasium ``reset(options=...)`` mapping applied.

    Raises:
        ValueError: an unknown key. PayloadTypeError, InvalidRequest: a value the field
            does not take (naming it, see :func:`reset_options`).
    """
    unknown = sorted(set(options) - OPTION_KEYS)
    if unknown:
        raise ValueError(
            f"unknown reset options {unknown}; a remote gymnasium env takes {sorted(OPTION_KEYS)}"
        )
    merged = GymnasiumResetOptions()
    merged.CopyFrom(current)
    if "env_id" in options:
        set_field(merged, "env_id", options["env_id"])
    if "max_episode_steps" in options:
        steps = options["max_episode_steps"]
        if steps is None:
            merged.ClearField("max_episode_steps")
        else:
            set_field(merged, "max_episode_steps", steps)
    if "kwargs" in options:
        merged.ClearField("kwargs")
        if options["kwargs"]:
            set_field(merged, "kwargs", options["kwargs"])
    return merged


class RemoteGymnasiumEnv(gymnasium.Env[Any, Any]):
    """A session of the catalogue's ``gymnasium`` env, usable wherever a ``gymnasium.Env`` is.

    Args:
        target: ``"host:port"`` (the adapter opens and owns a session and its channel), a
            ``grpc.Channel`` (the adapter opens a session on it), or a ``GymnasiumEnv``
            session that is already open (the adapter takes it over and closes it).
        env_id: The registered id to run, e.g. ``"CartPole-v1"``; empty means the server's
            default (``GYM_ENV_ID``).
        max_episode_steps: A TimeLimit override; None keeps the registry's limit.
        kwargs: Keyword arguments for ``gymnasium.make`` on the server.
        render_mode: None, or ``"rgb_array"``: the server renders and :meth:`render`
            returns its current frame (one ``state`` call).
        session_options: Passed to ``GymnasiumEnv`` when the adapter opens the session
            (``token``, ``credentials``, ``retry``, ``metadata``, ``reconnect``).

    ``spec``: ``gymnasium.make("openenv-grpc/<id>", target=...)`` sets Gymnasium's own;
    made directly, the adapter carries the same (its id and the keyword arguments that
    make it again, with ``target`` when it is an address), so ``spec.make`` and
    Gymnasium's checker (which makes one env per render mode from it) work either way.

    Values: observations are numpy elements of ``observation_space`` (new arrays on every
    call); actions may be anything ``convert.encode`` turns into an element of
    ``action_space`` (ints, numpy arrays, dicts, tuples); rewards are floats;
    ``terminated``, ``truncated`` and ``info`` come from the remote env unchanged (info as
    JSON-like values). A seed goes to the remote ``env.reset(seed=...)``, so the same seed
    and actions replay the same episode.

    Raises (from the constructor): ``CapacityError`` / ``SessionRefused`` when the session
    cannot be opened, ``EnvError`` when the server refuses the configuration (unknown id,
    missing dependency, bad kwargs).
    """

    metadata: dict[str, Any] = {"render_modes": RENDER_MODES}  # noqa: RUF012 (gymnasium's)

    def __init__(
        self,
        target: str | grpc.Channel | GymnasiumEnv,
        env_id: str = "",
        *,
        max_episode_steps: int | None = None,
        kwargs: Mapping[str, Any] | None = None,
        render_mode: str | None = None,
        **session_options: Any,
    ) -> None:
        if render_mode is not None and render_mode not in RENDER_MODES:
            raise ValueError(f"render_mode {render_mode!r} is not one of {RENDER_MODES}")
        self.render_mode = render_mode
        self._options = reset_options(env_id, max_episode_steps, kwargs, render_mode)
        remake: dict[str, Any] = {"env_id": env_id}
        if isinstance(target, str):
            remake["target"] = target
        if max_episode_steps is not None:
            remake["max_episode_steps"] = max_episode_steps
        if kwargs:
            remake["kwargs"] = dict(kwargs)
        self.spec = spec_for(env_id, remake)
        if isinstance(target, GymnasiumEnv):
            self._session = target
        else:
            self._session = GymnasiumEnv(target, **session_options)
            self._session.open()
        self._closed = False
        try:
            # The one reset that tells us the spaces (see the module docstring).
            first = self._session.reset(options=self._options)
        except BaseException:
            self._session.abort()
            raise
        self._apply_description(first.observation.env)
        # Later resets without options keep the server's configuration; ours is kept only
        # to merge reset(options=...) mappings into.

    def _apply_description(self, description: EnvDescription) -> None:
        self.description = description
        #: The TimeLimit the server applies (0 = none).
        self.max_episode_steps = int(description.max_episode_steps)
        self.observation_space = convert.build_space(description.observation_space)
        self.action_space = convert.build_space(description.action_space)
        self.metadata = dict(type(self).metadata)
        if description.render_fps:
            self.metadata["render_fps"] = description.render_fps

    def render(self) -> npt.NDArray[np.uint8] | None:
        """The env's current frame (``render_mode="rgb_array"``: uint8, H x W x 3, asked
        of the server with one ``state`` call), or None without a render mode."""
        if self.render_mode is None:
            return None
        frame = self._session.state().frame
        return convert.to_numpy(frame, writable=True, what="frame") if frame.dtype else None

    @property
    def session(self) -> GymnasiumEnv:
        """The underlying session (for ``state()`` or ``session_id``)."""
        return self._session

    @property
    def episode_id(self) -> str:
        """The server's id of the current episode."""
        return self._session.episode_id

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Start a new remote episode.

        ``options`` may hold ``env_id``, ``max_episode_steps`` and ``kwargs``: they
        reconfigure the remote env (kept for later resets) and the spaces are rebuilt from
        the new description. Empty or None keeps the running configuration.

        Returns:
            ``(observation, info)``.

        Raises:
            ValueError: unknown option keys. EnvError: the server refused the reset.
            SessionLost: the stream ended.
        """
        super().reset(seed=seed)  # seeds self.np_random, as gymnasium expects
        message: GymnasiumResetOptions | None = None
        if options:
            message = _options_from_mapping(options, self._options)
        result = self._session.reset(seed=seed, options=message)
        if message is not None:
            self._options = message
            self._apply_description(result.observation.env)
        return self._observation(result), dict(result.info)

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        """Apply ``action`` remotely.

        Returns:
            ``(observation, reward, terminated, truncated, info)``.

        Raises:
            EnvError: INVALID_ARGUMENT (the action is not in ``action_space``) or
                FAILED_PRECONDITION (the episode is over: reset first).
            ConversionError: ``action`` cannot be written as an element of the space.
            SessionLost: the stream ended.
        """
        value = convert.encode(action, self.action_space)
        result = self._session.step(GymnasiumAction(value=value))
        return (
            self._observation(result),
            result.reward,
            result.terminated,
            result.truncated,
            dict(result.info),
        )

    def _observation(self, result: StepOutcome[GymnasiumObservation]) -> Any:
        """The observation as an element of ``observation_space`` (new, writable arrays)."""
        return convert.decode(result.observation.value, self.observation_space, "observation")

    def close(self) -> None:
        """Close the remote env and the session (and its channel if owned). Idempotent."""
        if not self._closed:
            self._closed = True
            self._session.close()
        super().close()
