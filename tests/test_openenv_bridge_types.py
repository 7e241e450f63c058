"""The OpenEnv adapter in-process: how pydantic types become protobuf fields, what falls
back to JSON, and the error paths (missing types, wrong returns, empty unions). The
served behaviour is in test_openenv_bridge.py."""

from __future__ import annotations

import asyncio
import datetime
import enum
import pickle
import threading
from typing import Any, ClassVar, Literal

import pytest
from google.protobuf.descriptor import FieldDescriptor
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import BaseModel, Field

from openenv_grpc import InvalidAction
from openenv_grpc.environment import message_types
from openenv_grpc.integrations.openenv import openenv_environment
from openenv_grpc.server.spec import EnvSpec, ExecutionMode


class Color(enum.Enum):
    RED = 1
    DARK_BLUE = 2


class Point(BaseModel):
    x: float
    y: float = 0.0


class AllAction(Action):
    text: str
    count: int = 0
    ratio: float | int = 1
    flag: bool | None = None
    raw: bytes = b""
    kind: Literal["a", "b"] = "a"
    color: Color = Color.RED
    point: Point | None = None
    points: list[Point] = Field(default_factory=list)
    tags: tuple[str, ...] = ()
    scores: dict[str, float] = Field(default_factory=dict)
    named: dict[str, Point] = Field(default_factory=dict)
    loose: dict[str, Any] = Field(default_factory=dict)
    anything: Any = None
    either: int | str = 0
    grid: list[list[int]] = Field(default_factory=list)
    pair: tuple[int, str] = (0, "")
    when: datetime.date | None = None


class AllObservation(Observation):
    echo: AllAction | None = None


class AllEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed=None, episode_id=None, level: int = 1, **kwargs: Any) -> AllObservation:  # type: ignore[no-untyped-def]
        self.seen = {"seed": seed, "episode_id": episode_id, "level": level, **kwargs}
        return AllObservation(reward=None, metadata={"seen": self.seen})

    def step(self, action: AllAction) -> AllObservation:  # type: ignore[override]
        return AllObservation(echo=action, reward=True, done=True)

    @property
    def state(self) -> State:
        return State(step_count=3)


def fields(message_class: Any) -> dict[str, tuple[str, str]]:
    """field -> (label-ish, type name) for a compact check of the built descriptor."""
    out = {}
    for field in message_class.DESCRIPTOR.fields:
        if field.message_type is not None:
            kind = field.message_type.full_name
            if field.message_type.GetOptions().map_entry:
                value = field.message_type.fields_by_name["value"]
                inner = value.message_type.name if value.message_type else value.type
                out[field.name] = ("map", str(inner))
                continue
        elif field.enum_type is not None:
            kind = field.enum_type.name
        else:
            kind = str(field.type)
        label = "repeated" if field.is_repeated else "optional" if field.has_presence else ""
        out[field.name] = (label, kind.rpartition(".")[2])
    return out


def test_every_type_maps_to_its_field() -> None:
    adapter = openenv_environment(AllEnv)
    action = message_types(adapter).action
    f = FieldDescriptor
    assert fields(action) == {
        "metadata": ("optional", "Struct"),
        "text": ("optional", str(f.TYPE_STRING)),
        "count": ("optional", str(f.TYPE_INT64)),
        "ratio": ("optional", str(f.TYPE_DOUBLE)),
        "flag": ("optional", str(f.TYPE_BOOL)),
        "raw": ("optional", str(f.TYPE_BYTES)),
        "kind": ("optional", str(f.TYPE_STRING)),
        "color": ("optional", "Color"),
        "point": ("optional", "Point"),
        "points": ("repeated", "Point"),
        "tags": ("repeated", str(f.TYPE_STRING)),
        "scores": ("map", str(f.TYPE_DOUBLE)),
        "named": ("map", "Point"),
        "loose": ("optional", "Struct"),
        "anything": ("optional", "Value"),  # JSON: nothing to type it with
        "either": ("optional", "Value"),  # JSON: a union protobuf cannot tell apart
        "grid": ("optional", "Value"),  # JSON: repeated fields cannot nest
        "pair": ("optional", "Value"),  # JSON: a fixed-length tuple
        "when": ("optional", "Value"),  # JSON: pydantic's ISO date
    }
    color = action.DESCRIPTOR.fields_by_name["color"].enum_type
    assert [v.name for v in color.values] == ["COLOR_UNSPECIFIED", "COLOR_RED", "COLOR_DARK_BLUE"]
    options = message_types(adapter).reset_options
    assert fields(options) == {
        "level": ("optional", str(f.TYPE_INT64)),
        "kwargs": ("optional", "Struct"),
    }
    # The observation keeps its own fields; reward, done and metadata go in the result.
    assert list(fields(message_types(adapter).observation)) == ["echo"]


def test_values_round_trip_through_the_messages() -> None:
    adapter = openenv_environment(AllEnv)
    types = message_types(adapter)
    env = adapter()
    options = types.reset_options(level=4)
    options.kwargs.update({"mode": "hard"})
    first = env.reset(seed=7, episode_id="e", options=options)
    assert first.reward == 0.0  # None
    assert first.info == {"seen": {"seed": 7, "episode_id": "e", "level": 4, "mode": "hard"}}
    action = types.action(text="hi", raw=b"\x00\xff", kind="b", color=3 - 1)
    action.point.x = 1.5
    action.points.add(x=2)
    action.tags.extend(["t"])
    action.scores["s"] = 0.5
    action.named["n"].x = 3
    action.loose.update({"k": [1, "two"]})
    action.anything.string_value = "free"
    action.either.number_value = 5
    action.grid.list_value.values.add().list_value.values.add(number_value=1)
    action.when.string_value = "2026-12-01"
    result = env.step(action)
    assert (result.reward, result.terminated) == (1.0, True)  # reward True, done True
    echo = result.observation.echo
    assert (echo.text, echo.raw, echo.kind, echo.color) == ("hi", b"\x00\xff", "b", 2)
    assert echo.point.x == 1.5 and echo.points[0].x == 2 and list(echo.tags) == ["t"]
    assert dict(echo.scores) == {"s": 0.5} and echo.named["n"].x == 3
    assert echo.either.number_value == 5 and echo.when.string_value == "2026-12-01"
    assert echo.grid.list_value.values[0].list_value.values[0].number_value == 1
    assert not echo.HasField("flag")  # None stays unset
    assert env.state().step_count == 3


def test_refusals_are_invalid_action() -> None:
    adapter = openenv_environment(AllEnv)
    types = message_types(adapter)
    env = adapter()
    env.reset(seed=None, episode_id="e", options=None)
    with pytest.raises(InvalidAction, match="text: Field required"):
        env.step(types.action())
    with pytest.raises(InvalidAction, match="kind: Input should be 'a' or 'b'"):
        env.step(types.action(text="x", kind="c"))


class Bare(Environment):
    def reset(self, seed=None, episode_id=None, **kwargs):  # type: ignore[no-untyped-def]
        return "not an observation"

    def step(self, action):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    @property
    def state(self):  # type: ignore[no-untyped-def]
        return State()


def test_missing_types_and_wrong_returns_are_reported() -> None:
    with pytest.raises(TypeError, match="cannot find its action and observation model"):
        openenv_environment(Bare)
    with pytest.raises(TypeError, match="is not a subclass of openenv's Environment"):
        openenv_environment(AllAction)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="is not a pydantic model"):
        openenv_environment(Bare, action=AllAction, observation=int)  # type: ignore[arg-type]
    adapter = openenv_environment(Bare, action=AllAction, observation=AllObservation)
    with pytest.raises(TypeError, match="returned str, not an Observation"):
        adapter().reset(seed=None, episode_id="e", options=None)  # INTERNAL on the wire


def test_a_union_action_with_nothing_chosen_is_invalid() -> None:
    adapter = openenv_environment(Bare, action=(AllAction, Action), observation=AllObservation)
    with pytest.raises(InvalidAction, match="must set one of: all_action, action"):
        adapter().step(message_types(adapter).action())


class Threaded(AllEnv):
    REQUIRES_SINGLE_THREAD_EXECUTOR = True
    threads: ClassVar[set[int]] = set()

    def step(self, action: AllAction) -> AllObservation:  # type: ignore[override]
        self.threads.add(threading.get_ident())
        return super().step(action)


class AsyncReset(AllEnv):
    async def reset_async(self, seed=None, episode_id=None, depth: int = 0, **kwargs):  # type: ignore[no-untyped-def]
        return AllObservation(metadata={"depth": depth, "loop": True})


def test_execution_follows_openenvs_rules() -> None:
    assert EnvSpec.from_factory(openenv_environment(AllEnv)).mode is ExecutionMode.POOL
    single = openenv_environment(Threaded)
    assert EnvSpec.from_factory(single).mode is ExecutionMode.ASYNC
    types = message_types(single)

    async def steps() -> None:
        for _ in range(2):
            env = single()
            await env.reset(seed=None, episode_id="e", options=None)
            await env.step(types.action(text="x"))
            await env.close()

    asyncio.run(steps())
    assert len(Threaded.threads) == 1  # every instance's calls on one thread
    reset_async = openenv_environment(AsyncReset)
    options_fields = message_types(reset_async).reset_options.DESCRIPTOR.fields_by_name
    assert "depth" in options_fields  # reset_async's own parameters
    env = reset_async()
    options = message_types(reset_async).reset_options(depth=2)
    result = asyncio.run(env.reset(seed=None, episode_id="e", options=options))
    assert result.info == {"depth": 2, "loop": True}


def test_adapters_pickle_as_their_recipe() -> None:
    adapter = openenv_environment(AllEnv)
    assert openenv_environment(AllEnv) is adapter  # one class per recipe
    assert pickle.loads(pickle.dumps(adapter)) is adapter
    named = openenv_environment(AllEnv, name="all")
    assert named is not adapter and named.name == "all"
    assert pickle.loads(pickle.dumps(named)) is named
