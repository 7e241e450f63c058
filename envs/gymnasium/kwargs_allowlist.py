"""Which ``gymnasium.make`` kwargs a client may send, per env, and within which bounds.

EnvPool's approach: every env lists the constructor arguments it takes and each value's
bounds, and nothing else reaches the constructor. A size check on the bytes sent is not
enough, since what counts is what the env builds from them: a FrozenLake ``desc`` of
62 x 62 cells is 4,040 bytes of JSON and a ~7 MiB transition table per env (7.4 GiB for a
vector stream at the default capacity). The list is keyed by the registered id's entry
point, so every id of one env class (``FrozenLake-v1``, ``FrozenLake8x8-v1``; every ALE
game) shares it. An env whose entry point is not listed takes no kwargs at all: the
server cannot know what an unknown constructor makes of its arguments.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import gymnasium

from openenv_grpc import InvalidAction

__all__ = ["ALLOWED_KWARGS", "MAX_LAKE_SIDE", "check_kwargs", "served_kwargs"]

#: The largest FrozenLake ``desc`` a client may send, in cells per side: 16 x 16 builds a
#: ~320 KiB table per env (tracemalloc), less than Taxi-v4's own ~570 KiB; 62 x 62 built
#: ~7 MiB.
MAX_LAKE_SIDE = 16


class Bound(Protocol):
    """What one kwarg's value may be."""

    #: How the refusal says what is allowed ("true or false", "a number in 0..1").
    @property
    def allowed(self) -> str: ...

    def admits(self, value: Any) -> bool:
        """Whether ``value`` (as decoded from the request's Struct) is within the bound."""
        ...


@dataclass(frozen=True)
class Flag:
    """A bool."""

    allowed: str = "true or false"

    def admits(self, value: Any) -> bool:
        return isinstance(value, bool)


@dataclass(frozen=True)
class Number:
    """A finite number from ``low`` to ``high`` (inclusive); whole numbers only if
    ``whole``."""

    low: float
    high: float
    whole: bool = False

    @property
    def allowed(self) -> str:
        kind = "a whole number" if self.whole else "a number"
        return f"{kind} from {self.low:g} to {self.high:g}"

    def admits(self, value: Any) -> bool:
        kinds = (int,) if self.whole else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds):
            return False
        return math.isfinite(value) and self.low <= value <= self.high


@dataclass(frozen=True)
class Choice:
    """One of a few strings."""

    values: tuple[str, ...]

    @property
    def allowed(self) -> str:
        return "one of " + ", ".join(repr(v) for v in self.values)

    def admits(self, value: Any) -> bool:
        return isinstance(value, str) and value in self.values


@dataclass(frozen=True)
class Numbers:
    """A list of exactly ``count`` numbers, each within ``each``."""

    count: int
    each: Number

    @property
    def allowed(self) -> str:
        return f"a list of {self.count} numbers, each {self.each.allowed}"

    def admits(self, value: Any) -> bool:
        return (
            isinstance(value, list)
            and len(value) == self.count
            and all(self.each.admits(v) for v in value)
        )


@dataclass(frozen=True)
class Grid:
    """A map as a list of equal rows of ``cells`` letters, at most ``side`` x ``side``,
    with at least one ``start`` cell (an env with none fails at reset, not here)."""

    side: int
    cells: str
    start: str

    @property
    def allowed(self) -> str:
        return (
            f"a list of 1 to {self.side} equal strings of 1 to {self.side} letters from "
            f"{self.cells!r}, with at least one {self.start!r}"
        )

    def admits(self, value: Any) -> bool:
        if not isinstance(value, list) or not 1 <= len(value) <= self.side:
            return False
        if not all(isinstance(row, str) for row in value):
            return False
        width = len(value[0])
        return (
            1 <= width <= self.side
            and all(len(row) == width and set(row) <= set(self.cells) for row in value)
            and any(self.start in row for row in value)
        )


_PROBABILITY = Number(0.0, 1.0)
#: Reward weights and bonuses: finite and far from float overflow in a sum of steps.
_WEIGHT = Number(-1e6, 1e6)
#: Every MuJoCo env (v4 and v5) takes some of these; a class refuses those it lacks with
#: its own TypeError. Never ``xml_file``, the camera or the render size (server's choice).
_MUJOCO: dict[str, Bound] = {
    "frame_skip": Number(1, 64, whole=True),
    "reset_noise_scale": Number(0.0, 10.0),
    "forward_reward_weight": _WEIGHT,
    "ctrl_cost_weight": _WEIGHT,
    "contact_cost_weight": _WEIGHT,
    "healthy_reward": _WEIGHT,
    "terminate_when_unhealthy": Flag(),
    "exclude_current_positions_from_observation": Flag(),
    "include_cfrc_ext_in_observation": Flag(),
}

#: Entry point (``module:Class``) -> the kwargs its ids take. Gymnasium 1.x's envs and
#: ALE's; the bounds are each constructor's documented ranges (or what it asserts).
ALLOWED_KWARGS: dict[str, dict[str, Bound]] = {
    "gymnasium.envs.classic_control.cartpole:CartPoleEnv": {"sutton_barto_reward": Flag()},
    "gymnasium.envs.classic_control.mountain_car:MountainCarEnv": {
        "goal_velocity": Number(0.0, 0.07)  # 0.07: the car's top speed
    },
    "gymnasium.envs.classic_control.continuous_mountain_car:Continuous_MountainCarEnv": {
        "goal_velocity": Number(0.0, 0.07)
    },
    "gymnasium.envs.classic_control.pendulum:PendulumEnv": {"g": Number(0.0, 100.0)},
    "gymnasium.envs.classic_control.acrobot:AcrobotEnv": {},
    "gymnasium.envs.box2d.lunar_lander:LunarLander": {
        "continuous": Flag(),
        "gravity": Number(-11.99, -0.01),  # the constructor asserts -12 < gravity < 0
        "enable_wind": Flag(),
        "wind_power": Number(0.0, 20.0),
        "turbulence_power": Number(0.0, 2.0),
    },
    "gymnasium.envs.box2d.bipedal_walker:BipedalWalker": {"hardcore": Flag()},
    "gymnasium.envs.box2d.car_racing:CarRacing": {
        "lap_complete_percent": _PROBABILITY,
        "domain_randomize": Flag(),
        "continuous": Flag(),
    },
    "gymnasium.envs.toy_text.blackjack:BlackjackEnv": {"natural": Flag(), "sab": Flag()},
    "gymnasium.envs.toy_text.frozen_lake:FrozenLakeEnv": {
        "desc": Grid(MAX_LAKE_SIDE, "SFHG", "S"),
        "map_name": Choice(("4x4", "8x8")),
        "is_slippery": Flag(),
        "success_rate": _PROBABILITY,
        "reward_schedule": Numbers(3, _WEIGHT),
    },
    "gymnasium.envs.toy_text.cliffwalking:CliffWalkingEnv": {"is_slippery": Flag()},
    "gymnasium.envs.toy_text.taxi:TaxiEnv": {
        "is_rainy": Flag(),
        "fickle_passenger": Flag(),
        "rainy_probability": _PROBABILITY,
        "fickle_probability": _PROBABILITY,
    },
    "ale_py.env:AtariEnv": {
        "mode": Number(0, 255, whole=True),  # ALE checks the game's own modes
        "difficulty": Number(0, 255, whole=True),
        "obs_type": Choice(("rgb", "grayscale", "ram")),
        "frameskip": Number(1, 64, whole=True),
        "repeat_action_probability": _PROBABILITY,
        "full_action_space": Flag(),
        "continuous": Flag(),
        "continuous_action_threshold": _PROBABILITY,
        "max_num_frames_per_episode": Number(1, 108_000, whole=True),
    },
}
#: Entry-point prefixes whose envs share one list (every MuJoCo version).
_FAMILIES: dict[str, dict[str, Bound]] = {"gymnasium.envs.mujoco.": _MUJOCO}


def served_kwargs(env_id: str) -> Mapping[str, Bound] | None:
    """The kwargs ``env_id`` takes: None when the id is not registered (make() names it);
    empty when its entry point is not on the list."""
    spec = gymnasium.registry.get(env_id)
    if spec is None:
        return None
    entry = spec.entry_point if isinstance(spec.entry_point, str) else ""
    if entry in ALLOWED_KWARGS:
        return ALLOWED_KWARGS[entry]
    for prefix, allowed in _FAMILIES.items():
        if entry.startswith(prefix):
            return allowed
    return {}


def check_kwargs(env_id: str, kwargs: Mapping[str, Any]) -> None:
    """Refuse kwargs ``env_id`` does not take, before any env is made.

    Raises:
        InvalidAction: naming the env id, the kwarg and what is allowed: a kwarg not on
            the id's list (an unlisted env takes none), or a value outside its bound.
    """
    if not kwargs:
        return
    served = served_kwargs(env_id)
    if served is None:
        return  # make() refuses the unknown id before any constructor runs
    for key, value in kwargs.items():
        bound = served.get(key)
        if bound is None:
            takes = ", ".join(sorted(served)) if served else "no kwargs"
            raise InvalidAction(
                f"kwarg {key!r} is not served for {env_id!r}: it takes {takes} on this "
                "server (an env's constructor arguments are allowed per env, with bounds)"
            )
        if not bound.admits(value):
            raise InvalidAction(
                f"kwarg {key}={_short(value)} is not served for {env_id!r}: {key} must be "
                f"{bound.allowed}"
            )


def _short(value: Any) -> str:
    """A value for a message: its repr, cut to 60 characters (a refused map can be long)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
