"""What a snapshot of a running ``gymnasium.Env`` holds, and how it is put back.

Gymnasium has no state API, so each supported env class is listed here with the
attributes that make up its episode (found by reading its source): classic control
(CartPole, MountainCar, MountainCarContinuous, Acrobot, Pendulum) and toy text
(FrozenLake, CliffWalking, Taxi, Blackjack) keep a few numbers and arrays; Atari keeps an
emulator whose whole state ALE serializes itself (``ALEInterface.cloneState(
include_rng=True)``: RAM, CPU, TIA, frame counters and the sticky-action generator;
``cloneSystemState`` is ALE's deprecated older name for the same). Every one of them also
keeps ``np_random`` (a PCG64 generator: its bit generator state is saved), and the
wrappers ``gymnasium.make`` adds keep counters (``TimeLimit``'s elapsed steps,
``OrderEnforcing``'s has-reset flag).

Anything else is refused with :class:`NotSnapshotable`: Box2D envs (LunarLander,
BipedalWalker, CarRacing) hold a pybox2d world that cannot be serialized; MuJoCo envs
and the JAX-based ``phys2d/`` and ``tabular/`` ids are not listed (their state lives in
simulator or array objects this module does not capture); so is any env class or wrapper
not named here, because an attribute missed would silently break determinism.

Values are plain data: numbers, strings, lists, tuples (tagged) and numpy arrays and
scalars (dtype, shape and raw bytes; only boolean, numeric and unicode dtypes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium
import numpy as np
from google.protobuf import json_format
from gymnasium.wrappers import OrderEnforcing, PassiveEnvChecker, TimeLimit

from openenv_grpc import InvalidAction
from openenv_grpc_envs import snapshot_body
from openenv_grpc_envs.gymnasium.configuration import Config
from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import GymnasiumResetOptions
from openenv_grpc_envs.snapshot_body import Body, b64

__all__ = [
    "SNAPSHOT_LAYOUT",
    "STATE_ATTRIBUTES",
    "Episode",
    "NotSnapshotable",
    "Recorded",
    "capture",
    "decode_value",
    "dump_episode",
    "encode_value",
    "load_episode",
    "restorer",
    "snapshot_of",
]

#: The layout of the gymnasium env's snapshots.
SNAPSHOT_LAYOUT = "gymnasium/1"

#: Per env class (``module:qualname`` of the unwrapped env), the attributes its episode is
#: made of. Constructor settings are not listed: the snapshot remakes the env from the
#: same configuration.
STATE_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "gymnasium.envs.classic_control.cartpole:CartPoleEnv": ("state", "steps_beyond_terminated"),
    "gymnasium.envs.classic_control.mountain_car:MountainCarEnv": ("state",),
    "gymnasium.envs.classic_control.continuous_mountain_car:Continuous_MountainCarEnv": ("state",),
    "gymnasium.envs.classic_control.acrobot:AcrobotEnv": ("state",),
    "gymnasium.envs.classic_control.pendulum:PendulumEnv": ("state", "last_u"),
    "gymnasium.envs.toy_text.frozen_lake:FrozenLakeEnv": ("s", "lastaction"),
    "gymnasium.envs.toy_text.cliffwalking:CliffWalkingEnv": ("s", "lastaction"),
    "gymnasium.envs.toy_text.taxi:TaxiEnv": ("s", "lastaction", "fickle_step", "taxi_orientation"),
    "gymnasium.envs.toy_text.blackjack:BlackjackEnv": (
        "dealer",
        "player",
        "dealer_top_card_suit",
        "dealer_top_card_value_str",
    ),
}
#: The Atari env class, whose state is the emulator's.
ATARI = "ale_py.env:AtariEnv"
#: Why the well-known families that cannot snapshot cannot (by module prefix).
_WHY_NOT = {
    "gymnasium.envs.box2d.": "Box2D envs hold a pybox2d world, which cannot be serialized",
    "gymnasium.envs.mujoco.": "MuJoCo envs are not supported by this server's snapshots",
    "gymnasium.envs.phys2d.": "the JAX-based phys2d envs are not supported by snapshots",
    "gymnasium.envs.tabular.": "the JAX-based tabular envs are not supported by snapshots",
}
#: The only bit generator Gymnasium's seeding makes.
_BIT_GENERATOR = "PCG64"
#: numpy dtype kinds a snapshot may hold: boolean, integers, floats, complex, unicode.
_DTYPE_KINDS = frozenset("biufcU")


class NotSnapshotable(Exception):
    """This env (or a wrapper around it) cannot be snapshot; the message says why."""


@dataclass(frozen=True)
class Episode:
    """The session's part of a snapshot: the configuration and the counters."""

    #: The configuration as reset options (env id, step limit, kwargs).
    options: GymnasiumResetOptions
    seed: int | None
    steps: int
    episode_return: float
    terminated: bool
    truncated: bool


@dataclass(frozen=True)
class Recorded:
    """A snapshot read back: the session's part, the env's part (checked against an env
    by :func:`restorer`) and the last observation :meth:`state` shows (or None)."""

    episode: Episode
    env: Body
    last_observation: Any


def dump_episode(episode: Episode, last_observation: Any, env: gymnasium.Env[Any, Any]) -> bytes:
    """The snapshot of ``episode`` running in ``env``.

    Raises:
        NotSnapshotable: the env or a wrapper around it is not supported.
    """
    return snapshot_body.dump(
        SNAPSHOT_LAYOUT,
        {
            "options": json_format.MessageToDict(episode.options),
            "seed": episode.seed,
            "steps": episode.steps,
            "return": episode.episode_return,
            "terminated": episode.terminated,
            "truncated": episode.truncated,
            "last_observation": (
                None if last_observation is None else encode_value(last_observation)
            ),
            "env": capture(env),
        },
    )


def snapshot_of(
    config: Config,
    counters: tuple[int | None, int, float, bool, bool],
    shown: Any,
    env: gymnasium.Env[Any, Any],
) -> bytes:
    """The snapshot of one env running ``config`` -- a session's env, or one env of a
    vector batch: the same bytes either way, so each restores into the other.
    ``counters`` are (seed, steps, return, terminated, truncated); ``shown`` the last
    observation ``state()`` shows (None when it shows none).

    Raises:
        NotImplementedError: the env id cannot snapshot (the message says why).
    """
    options = GymnasiumResetOptions(env_id=config.env_id)
    if config.max_episode_steps is not None:
        options.max_episode_steps = config.max_episode_steps
    if config.kwargs:
        options.kwargs.update(config.kwargs)
    try:
        return dump_episode(Episode(options, *counters), shown, env)
    except NotSnapshotable as exc:
        # UNIMPLEMENTED with the reason: this configuration cannot, others can.
        raise NotImplementedError(f"{config.env_id} cannot snapshot: {exc}") from None


def load_episode(data: bytes) -> Recorded:
    """What :func:`dump_episode` wrote, checked but for the env's part.

    Raises:
        InvalidAction: a field is malformed.
    """
    body = snapshot_body.load(SNAPSHOT_LAYOUT, data)
    try:
        options = json_format.ParseDict(body.mapping("options"), GymnasiumResetOptions())
    except json_format.ParseError as exc:
        raise body.invalid("options", f"is not a GymnasiumResetOptions: {exc}") from None
    seed = None
    if body.has("seed"):
        seed = body.integer("seed", low=0, high=snapshot_body.MAX_SEED)
    episode = Episode(
        options,
        seed,
        body.integer("steps", low=0),
        body.number("return"),
        body.boolean("terminated"),
        body.boolean("truncated"),
    )
    last = decode_value(body, "last_observation") if body.has("last_observation") else None
    return Recorded(episode, body.child("env"), last)


def _class_path(obj: object) -> str:
    kind = type(obj)
    return f"{kind.__module__}:{kind.__qualname__}"


def _wrappers(env: gymnasium.Env[Any, Any]) -> list[gymnasium.Wrapper[Any, Any, Any, Any]]:
    """The wrappers around the unwrapped env, outermost first."""
    chain = []
    while isinstance(env, gymnasium.Wrapper):
        chain.append(env)
        env = env.env
    return chain


def _wrapper_state(wrapper: gymnasium.Wrapper[Any, Any, Any, Any]) -> dict[str, Any]:
    """The counters a wrapper made by ``gymnasium.make`` keeps.

    Raises:
        NotSnapshotable: a wrapper this module does not know.
    """
    if isinstance(wrapper, TimeLimit):
        return {"wrapper": "TimeLimit", "elapsed_steps": wrapper._elapsed_steps}
    if isinstance(wrapper, OrderEnforcing):
        return {"wrapper": "OrderEnforcing", "has_reset": wrapper._has_reset}
    if isinstance(wrapper, PassiveEnvChecker):
        return {"wrapper": "PassiveEnvChecker"}  # checks only; it keeps nothing of the episode
    raise NotSnapshotable(f"the wrapper {type(wrapper).__name__} cannot snapshot")


def _why_not(path: str) -> str:
    for prefix, why in _WHY_NOT.items():
        if path.startswith(prefix):
            return why
    return (
        f"{path} is not one of the env classes snapshots support (classic control, toy text, Atari)"
    )


def capture(env: gymnasium.Env[Any, Any]) -> dict[str, Any]:
    """The episode state of ``env`` (a ``gymnasium.make`` result) as plain data.

    Raises:
        NotSnapshotable: the env or a wrapper around it is not supported (see the module
            docstring).
    """
    wrappers = [_wrapper_state(w) for w in _wrappers(env)]
    unwrapped = env.unwrapped
    path = _class_path(unwrapped)
    rng = unwrapped._np_random
    body: dict[str, Any] = {
        "class": path,
        "wrappers": wrappers,
        "np_random": None if rng is None else _generator_state(rng),
        "np_random_seed": unwrapped._np_random_seed,
    }
    if path == ATARI:
        ale = unwrapped.ale  # type: ignore[attr-defined]
        body["ale"] = b64(bytes(ale.cloneState(include_rng=True).serialize()))
    elif path in STATE_ATTRIBUTES:
        body["attributes"] = {
            name: encode_value(getattr(unwrapped, name)) for name in STATE_ATTRIBUTES[path]
        }
    else:
        raise NotSnapshotable(_why_not(path))
    return body


def restorer(env: gymnasium.Env[Any, Any], body: Body) -> Callable[[], None]:
    """Check that ``body`` (from :func:`capture`) fits ``env`` and decode it; returns the
    function that puts it into ``env``, which cannot fail.

    Raises:
        InvalidAction: ``body`` is malformed or of another env class or wrapper chain.
    """
    unwrapped: Any = env.unwrapped  # its private fields are typed for Env's defaults
    path = _class_path(unwrapped)
    recorded = body.string("class")
    if recorded != path:
        raise body.invalid("class", f"is {recorded}, but this configuration makes {path}")
    wrappers = _wrappers(env)
    states = body.children("wrappers", max_items=len(wrappers))
    names = [s.string("wrapper") for s in states]
    try:
        here = [_wrapper_state(w)["wrapper"] for w in wrappers]
    except NotSnapshotable as exc:
        raise InvalidAction(str(exc)) from None
    if names != here:
        raise body.invalid("wrappers", f"are {names}, but this configuration makes {here}")
    steps: list[Callable[[], None]] = []
    for wrapper, state in zip(wrappers, states, strict=True):
        steps.append(_wrapper_restorer(wrapper, state))
    rng = _generator_from(body.child("np_random")) if body.has("np_random") else None
    seed = body.integer("np_random_seed") if body.has("np_random_seed") else None
    if path == ATARI:
        steps.append(_ale_restorer(unwrapped, body))
    elif path in STATE_ATTRIBUTES:
        attributes = body.child("attributes")
        values = {name: decode_value(attributes, name) for name in STATE_ATTRIBUTES[path]}
        steps.append(lambda: _set_attributes(unwrapped, values))
    else:  # the class matched the recorded one, so capture() accepted it once
        raise InvalidAction(_why_not(path))

    def restore() -> None:
        for step in steps:
            step()
        unwrapped._np_random = rng
        unwrapped._np_random_seed = seed

    return restore


def _set_attributes(env: object, values: dict[str, Any]) -> None:
    for name, value in values.items():
        setattr(env, name, value)


def _wrapper_restorer(
    wrapper: gymnasium.Wrapper[Any, Any, Any, Any], state: Body
) -> Callable[[], None]:
    if isinstance(wrapper, TimeLimit):
        elapsed = state.integer("elapsed_steps", low=0) if state.has("elapsed_steps") else None
        timed: Any = wrapper  # TimeLimit types the counter by its initial None

        def set_elapsed() -> None:
            timed._elapsed_steps = elapsed

        return set_elapsed
    if isinstance(wrapper, OrderEnforcing):
        has_reset = state.boolean("has_reset")

        def set_has_reset() -> None:
            wrapper._has_reset = has_reset

        return set_has_reset
    assert isinstance(wrapper, PassiveEnvChecker)  # _wrapper_state() knows no other

    def mark_checked() -> None:
        # The checks ran (or were due) on the original; none of them changes a result,
        # and the data-reuse check would compare against an observation it never saw.
        wrapper.checked_reset = wrapper.checked_step = True
        wrapper.checked_data_reuse = True
        wrapper._previous_data = None

    return mark_checked


def _ale_restorer(unwrapped: Any, body: Body) -> Callable[[], None]:
    from ale_py import ALEState  # present: the env is an AtariEnv

    blob = body.blob("ale")
    try:
        state = ALEState(blob)
    except Exception:  # nanobind reports ALE's C++ deserialization errors as SystemError
        raise body.invalid("ale", "is not an ALE state") from None
    ale = unwrapped.ale
    return lambda: ale.restoreState(state)


def _generator_state(rng: np.random.Generator) -> dict[str, Any]:
    state = rng.bit_generator.state
    if state.get("bit_generator") != _BIT_GENERATOR:
        raise NotSnapshotable(f"the env's np_random uses {state.get('bit_generator')}, not PCG64")
    return dict(state)


def _generator_from(body: Body) -> np.random.Generator:
    name = body.string("bit_generator")
    if name != _BIT_GENERATOR:
        raise body.invalid("bit_generator", f"is {name!r}; only {_BIT_GENERATOR} is restored")
    inner = body.child("state")
    state = {
        "bit_generator": name,
        "state": {"state": inner.integer("state", low=0), "inc": inner.integer("inc", low=0)},
        "has_uint32": body.integer("has_uint32", low=0, high=1),
        "uinteger": body.integer("uinteger", low=0, high=(1 << 32) - 1),
    }
    generator = np.random.Generator(np.random.PCG64())
    try:
        generator.bit_generator.state = state
    except (TypeError, ValueError, OverflowError) as exc:
        raise body.invalid("state", f"is not a PCG64 state: {exc}") from None
    return generator


# -- plain values -------------------------------------------------------------------------


def encode_value(value: Any) -> Any:
    """``value`` (None, bool, int, float, str, list, tuple, numpy array or scalar, nested)
    as JSON data; :func:`decode_value` gives back an equal value of the same types.

    Raises:
        NotSnapshotable: another type (e.g. a dict or an object).
    """
    if isinstance(value, (np.ndarray, np.generic)):  # first: np.float64 is a float too
        array = np.asarray(value)
        if array.dtype.kind not in _DTYPE_KINDS:
            raise NotSnapshotable(f"a numpy value of dtype {array.dtype} cannot snapshot")
        return {
            "scalar" if isinstance(value, np.generic) else "array": b64(array.tobytes()),
            "dtype": array.dtype.str,
            "shape": list(array.shape),
        }
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [encode_value(v) for v in value]}
    raise NotSnapshotable(f"a value of type {type(value).__name__} cannot snapshot")


def decode_value(body: Body, key: str) -> Any:
    """The value :func:`encode_value` wrote as field ``key`` of ``body``.

    Raises:
        InvalidAction: the field is malformed.
    """
    return _decode(body, key, body.raw(key), depth=0)


_MAX_DEPTH = 8


def _decode(body: Body, key: str, data: Any, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise body.invalid(key, f"nests deeper than {_MAX_DEPTH} levels")
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [_decode(body, key, v, depth + 1) for v in data]
    if not isinstance(data, dict):
        raise body.invalid(key, f"holds a {type(data).__name__}")
    if "tuple" in data:
        items = Body(data, "").array("tuple")
        return tuple(_decode(body, key, v, depth + 1) for v in items)
    return _decode_numpy(body, key, Body(data, ""))


def _decode_numpy(body: Body, key: str, value: Body) -> Any:
    scalar = value.has("scalar")
    raw = value.blob("scalar" if scalar else "array")
    try:
        dtype = np.dtype(value.string("dtype", max_chars=16))
    except (TypeError, ValueError):
        raise body.invalid(key, f"has an unknown dtype {value.string('dtype')!r}") from None
    if dtype.kind not in _DTYPE_KINDS:
        raise body.invalid(key, f"has dtype {dtype}, which a snapshot may not hold")
    shape = value.array("shape", max_items=32)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise body.invalid(key, f"has a malformed shape {shape}")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if count * dtype.itemsize != len(raw):
        raise body.invalid(key, f"holds {len(raw)} bytes, not {count} x {dtype}")
    array = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()  # writable, like the env's
    return array[()] if scalar else array
