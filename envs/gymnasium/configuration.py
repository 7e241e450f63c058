"""What a reset asks the gymnasium env to run, and making it: shared by one session's env
(:mod:`.environment`) and a vector stream's batch (:mod:`.batch`).

A configuration is the env id, an optional step limit, ``gymnasium.make`` kwargs, the
render mode and the backend; equal configurations reuse the running env(s).
"""

from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import gymnasium
from google.protobuf import json_format

from openenv_grpc import InvalidAction
from openenv_grpc_envs.gymnasium.convert import ConversionError, describe_space
from openenv_grpc_envs.gymnasium.kwargs_allowlist import check_kwargs
from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import (
    Backend,
    EnvDescription,
    GymnasiumResetOptions,
)

__all__ = [
    "ENV_ID_VARIABLE",
    "MAX_KWARGS_VARIABLE",
    "RENDER_MODES",
    "RESERVED_KWARGS",
    "Config",
    "config_for",
    "describe",
    "jsonable",
    "make_env",
]

#: The server environment variable naming the env a reset without an env_id starts.
ENV_ID_VARIABLE = "GYM_ENV_ID"
#: make() arguments a client may not set as kwargs: render_mode and max_episode_steps
#: have their own fields, and the others change the step semantics under the session.
RESERVED_KWARGS = frozenset(
    {"render_mode", "max_episode_steps", "autoreset", "apply_api_compatibility"}
)
#: make() arguments that multiply the work of one step (ALE's ``frameskip``, MuJoCo's
#: ``frame_skip``), with the largest value a client may set: an env step cannot be
#: interrupted once running, so ``frameskip=1e9`` would hold a server thread for good.
STEP_WORK_KWARGS = {"frameskip": 64, "frame_skip": 64}

#: The server environment variable bounding a client's kwargs, in bytes of compact JSON
#: (``0``: no bound). A constructor argument's size can make each env cost without bound:
#: a 63 KB FrozenLake ``desc`` (251 x 251) builds a ~123 MiB transition table per env.
MAX_KWARGS_VARIABLE = "GYM_MAX_KWARGS_BYTES"
#: Room for every registered option and for maps of up to 62 x 62 cells (~7 MiB per env,
#: measured with tracemalloc; 251 x 251 held ~123 MiB).
DEFAULT_MAX_KWARGS_BYTES = 4096
#: kwargs whose name says they point at the server's files (MuJoCo's ``xml_file``, ...):
#: what the server reads is the operator's to choose, never a client's.
_PATH_KWARG_ENDINGS = ("file", "path", "dir", "directory", "root")

#: The render modes a client may ask for ("" = none): the server has no display, so only
#: frames it can hand back (GymnasiumState.frame).
RENDER_MODES = ("", "rgb_array")

_ale_lock = threading.Lock()
_ale_registered = False


def register_ale() -> None:
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
class Config:
    """What gymnasium.make gets (and which backend a batch uses); equal configs reuse the
    running env."""

    env_id: str
    max_episode_steps: int | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    render_mode: str = ""
    #: As asked (a ``Backend`` value); a batch resolves UNSPECIFIED and AUTO.
    backend: int = Backend.BACKEND_UNSPECIFIED


def config_for(
    options: GymnasiumResetOptions | None, current: Config | None, default_env_id: str
) -> Config:
    """The configuration a reset asks for: ``current`` when no options were sent.

    Raises:
        InvalidAction: no env id, a module:id entry point, a step limit below 1, reserved
            kwargs, or an unknown render mode or backend.
    """
    if options is None and current is not None:
        return current
    running = current.env_id if current is not None else default_env_id
    env_id = (options.env_id.strip() if options is not None else "") or running
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
        return Config(env_id)
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
            f"kwargs {reserved} are not allowed (use the render_mode and max_episode_steps fields)"
        )
    _check_step_work(kwargs)
    _check_kwargs_size(kwargs)
    if options.render_mode not in RENDER_MODES:
        raise InvalidAction(
            f"render_mode {options.render_mode!r} is not served (the server has no display): "
            "use 'rgb_array' (frames come with state()) or leave it empty"
        )
    if options.backend not in Backend.values():
        raise InvalidAction(f"unknown backend {options.backend}")
    return Config(env_id, max_steps, kwargs, options.render_mode, options.backend)


def make_env(config: Config) -> tuple[gymnasium.Env[Any, Any], EnvDescription]:
    """Make the gymnasium env a config describes and describe it.

    Returns:
        The env and its description (spaces, step limit, kwargs, render mode).

    Raises:
        InvalidAction: unknown id, a missing dependency, kwargs not on the id's allowlist
            (:mod:`.kwargs_allowlist`) or that the env refuses, or a space this env cannot
            serve.
    """
    env_id = config.env_id
    if env_id not in gymnasium.registry:
        register_ale()  # ALE/... and the legacy Atari ids live in ale-py
    check_kwargs(env_id, config.kwargs)  # before any constructor sees them
    try:
        env = gymnasium.make(
            env_id,
            max_episode_steps=config.max_episode_steps,
            render_mode=config.render_mode or None,
            **config.kwargs,
        )
    except gymnasium.error.UnregisteredEnv as exc:
        raise InvalidAction(f"unknown env_id {env_id!r}: {exc}") from None
    except (gymnasium.error.DependencyNotInstalled, ImportError) as exc:
        raise InvalidAction(f"env_id {env_id!r} needs a package this server lacks: {exc}") from None
    except (
        gymnasium.error.Error,
        TypeError,
        ValueError,
        KeyError,
        AssertionError,
        RuntimeError,  # ALE: a mode or difficulty the game lacks
    ) as exc:
        # Raised by make() or the env's constructor for the client's kwargs.
        raise InvalidAction(
            f"cannot make {env_id!r} with kwargs {config.kwargs}: {type(exc).__name__}: {exc}"
        ) from None
    spec = env.spec
    try:
        description = describe(
            config,
            env.observation_space,
            env.action_space,
            (spec.max_episode_steps or 0) if spec else 0,
            Backend.BACKEND_GYMNASIUM,
        )
    except InvalidAction:
        env.close()
        raise
    fps = env.metadata.get("render_fps")
    if isinstance(fps, (int, float)):
        description.render_fps = float(fps)
    return env, description


def describe(
    config: Config,
    observation_space: gymnasium.Space[Any],
    action_space: gymnasium.Space[Any],
    max_episode_steps: int,
    backend: int,
) -> EnvDescription:
    """The ``EnvDescription`` of a running configuration.

    Raises:
        InvalidAction: a space this env cannot serve.
    """
    description = EnvDescription(
        env_id=config.env_id,
        max_episode_steps=max_episode_steps,
        backend=backend,  # type: ignore[arg-type]
        render_mode=config.render_mode,
    )
    if config.kwargs:
        description.kwargs.update(config.kwargs)
    try:
        describe_space(observation_space, description.observation_space)
        describe_space(action_space, description.action_space)
    except ConversionError as exc:
        raise InvalidAction(f"env_id {config.env_id!r} cannot be served: {exc}") from None
    return description


def _check_step_work(kwargs: dict[str, Any]) -> None:
    """Refuse kwargs that would make one step cost without bound (see STEP_WORK_KWARGS).

    Raises:
        InvalidAction: such a kwarg is not a whole number from 1 to its bound.
    """
    for key, bound in STEP_WORK_KWARGS.items():
        if key not in kwargs:
            continue
        value = kwargs[key]
        if not (type(value) is int and 1 <= value <= bound):
            raise InvalidAction(
                f"kwargs {key}={value!r}: must be a whole number from 1 to {bound}: "
                "it multiplies the work of every step"
            )


def _check_kwargs_size(kwargs: dict[str, Any]) -> None:
    """Refuse kwargs that name the server's files, and kwargs larger than the server allows
    (:data:`MAX_KWARGS_VARIABLE`): their size can make every env cost without bound.

    Raises:
        InvalidAction: a path-like kwarg, or kwargs over the bound.
    """
    paths = sorted(key for key in kwargs if _names_a_path(key))
    if paths:
        raise InvalidAction(
            f"kwargs {paths} are not allowed: a client cannot choose files on the server"
        )
    if not kwargs:
        return
    limit = max_kwargs_bytes()
    size = len(json.dumps(kwargs, separators=(",", ":")).encode())
    if limit and size > limit:
        raise InvalidAction(
            f"kwargs are {size} bytes (as JSON), over this server's limit of {limit} bytes "
            f"({MAX_KWARGS_VARIABLE}): a constructor argument's size can make every env "
            "cost without bound"
        )


def _names_a_path(key: str) -> bool:
    """``xml_file``, ``model_path``, ``data_dir``, ``path`` -- not ``profile``."""
    last = key.lower().replace("-", "_").rsplit("_", 1)[-1]
    return last in _PATH_KWARG_ENDINGS


def max_kwargs_bytes() -> int:
    """The server's bound on a client's kwargs (:data:`MAX_KWARGS_VARIABLE`; 0: none).

    Raises:
        InvalidAction: the variable is not a whole number of bytes, 0 or more.
    """
    raw = os.environ.get(MAX_KWARGS_VARIABLE, "").strip()
    if not raw:
        return DEFAULT_MAX_KWARGS_BYTES
    if not raw.isascii() or not raw.isdigit():
        raise InvalidAction(f"the server's {MAX_KWARGS_VARIABLE}={raw[:32]!r} is not a number")
    return int(raw)


def _plain(obj: Any) -> Any:
    """Struct values as make() expects them: whole-number floats become ints."""
    if isinstance(obj, float) and obj.is_integer():
        return int(obj)
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    return obj


def jsonable(obj: Any) -> Any:
    """Gymnasium's info as JSON-like values: numpy scalars and small arrays become Python
    numbers and lists, non-finite floats strings; large arrays are summarised.

    Returns:
        The converted value (dicts keep their keys, as strings).
    """
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    size = getattr(obj, "size", None)
    tolist = getattr(obj, "tolist", None)  # numpy scalars and arrays
    if callable(tolist):
        if isinstance(size, int) and size > 1024:
            return f"<array shape={list(obj.shape)} dtype={obj.dtype}>"
        return jsonable(tolist())
    return repr(obj)
