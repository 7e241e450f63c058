"""The OpenEnv adapter in-process: how pydantic types become protobuf fields, what falls
back to JSON, and the error paths (missing types, wrong returns, empty unions). The
served behaviour is in test_openenv_bridge.py."""

from __future__ import annotations

import asyncio
import datetime
import enum
import json
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
from openenv_grpc.integrations.openenv.schema import JSON_TYPE
from openenv_grpc.server.model.spec import EnvSpec, ExecutionMode


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
        "metadata": ("optional", "Json"),
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
        "loose": ("optional", "Json"),  # JSON text: ints stay ints
        "anything": ("optional", "Json"),  # JSON: nothing to type it with
        "either": ("optional", "Json"),  # JSON: a union protobuf cannot tell apart
        "grid": ("optional", "Json"),  # JSON: repeated fields cannot nest
        "pair": ("optional", "Json"),  # JSON: a fixed-length tuple
        "when": ("optional", "Json"),  # JSON: pydantic's ISO date
    }
    json_field = action.DESCRIPTOR.fields_by_name["loose"].message_type
    assert json_field.full_name == JSON_TYPE == "openenv_grpc.openenv.v1.Json"
    assert [f.name for f in json_field.fields] == ["json"]
    color = action.DESCRIPTOR.fields_by_name["color"].enum_type
    assert [v.name for v in color.values] == ["COLOR_UNSPECIFIED", "COLOR_RED", "COLOR_DARK_BLUE"]
    options = message_types(adapter).reset_options
    assert fields(options) == {
        "level": ("optional", str(f.TYPE_INT64)),
        "kwargs": ("optional", "Json"),
    }
    # The observation keeps its own fields and metadata (as OpenEnv's JSON does); reward
    # and done go in the result.
    assert list(fields(message_types(adapter).observation)) == ["metadata", "echo"]


def test_values_round_trip_through_the_messages() -> None:
    adapter = openenv_environment(AllEnv)
    types = message_types(adapter)
    env = adapter()
    options = types.reset_options(level=4)
    options.kwargs.json = json.dumps({"mode": "hard", "i": 1, "big": 2**70})
    first = env.reset(seed=7, episode_id="e", options=options)
    assert first.reward is None  # no reward: the wire says no_reward
    seen = {"seed": 7, "episode_id": "e", "level": 4, "mode": "hard", "i": 1, "big": 2**70}
    assert env._env.seen == seen and type(env._env.seen["i"]) is int  # ints stay ints
    assert json.loads(first.observation.metadata.json) == {"seen": seen}
    action = types.action(text="hi", raw=b"\x00\xff", kind="b", color=3 - 1)
    action.point.x = 1.5
    action.points.add(x=2)
    action.tags.extend(["t"])
    action.scores["s"] = 0.5
    action.named["n"].x = 3
    action.loose.json = '{"k": [1, "two", 1.0, null, true, 9007199254740993]}'
    action.anything.json = '"free"'
    action.either.json = "5"
    action.grid.json = "[[1, 2], [3]]"
    action.when.json = '"2026-12-01"'
    result = env.step(action)
    assert (result.reward, result.terminated) == (1.0, True)  # reward True, done True
    echo = result.observation.echo
    assert (echo.text, echo.raw, echo.kind, echo.color) == ("hi", b"\x00\xff", "b", 2)
    assert echo.point.x == 1.5 and echo.points[0].x == 2 and list(echo.tags) == ["t"]
    assert dict(echo.scores) == {"s": 0.5} and echo.named["n"].x == 3
    assert echo.either.json == "5" and echo.when.json == '"2026-12-01"'
    assert json.loads(echo.grid.json) == [[1, 2], [3]]
    loose = json.loads(echo.loose.json)["k"]
    assert loose == [1, "two", 1.0, None, True, 9007199254740993]  # 2**53 + 1: exact
    assert [type(v) for v in loose[:3]] == [int, str, float]
    assert not echo.HasField("flag")  # None stays unset
    assert echo.metadata.json == "{}"  # an empty dict arrives as {}, not unset
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
    bad = types.action(text="x")
    bad.grid.json = "[[1, 2"
    with pytest.raises(InvalidAction, match=r"grid: not JSON text \(Expecting"):
        env.step(bad)
    options = types.reset_options()
    options.kwargs.json = "[1]"
    with pytest.raises(InvalidAction, match="kwargs: a JSON object of keyword arguments"):
        env.reset(seed=None, episode_id="e", options=options)


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
    with pytest.raises(TypeError, match="neither an OpenEnv Environment class nor a factory"):
        openenv_environment(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="returned a str, not an openenv Environment"):
        openenv_environment(lambda: "env")  # type: ignore[arg-type,return-value]
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
    # A sync env starts on the pool and is measured: cheap calls that never block move
    # onto the loop (placement.py); OpenEnv keeps them on a worker thread always.
    assert EnvSpec.from_factory(openenv_environment(AllEnv)).mode is ExecutionMode.MEASURED
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


class BaseAnnotated(Environment):
    """As OpenEnv's coding_env writes it: step annotated with the base classes."""

    def reset(self, seed=None, episode_id=None, **kwargs) -> Observation:  # type: ignore[no-untyped-def]
        return AllObservation()

    def step(self, action: Action) -> Observation:  # type: ignore[override]
        return AllObservation(echo=action)  # type: ignore[arg-type]

    @property
    def state(self) -> State:
        return State()


def test_bare_base_classes_are_refused_naming_the_fix() -> None:
    with pytest.raises(TypeError) as refused:
        openenv_environment(BaseAnnotated)
    message = str(refused.value)
    assert "its action is openenv's base Action (no fields of its own) and its " in message
    assert "observation is openenv's base Observation" in message
    assert "--openenv pkg.server.app:app" in message and "--action MODULE:ACTION" in message
    adapter = openenv_environment(BaseAnnotated, action=AllAction, observation=AllObservation)
    assert "text" in message_types(adapter).action.DESCRIPTOR.fields_by_name


def make_all_env() -> AllEnv:
    return AllEnv()


def make_unannotated():  # type: ignore[no-untyped-def]
    return AllEnv()


def test_a_factory_serves_like_its_class() -> None:
    for factory in (make_all_env, make_unannotated):  # its return annotation, or a probe
        adapter = openenv_environment(factory)
        assert adapter.openenv_class is AllEnv and adapter.max_sessions is None
        env = adapter()
        env.reset(seed=None, episode_id="e", options=None)
        assert env.step(message_types(adapter).action(text="x")).terminated
        assert pickle.loads(pickle.dumps(adapter)) is adapter


class Clashing(Action):
    """Fields named like protobuf message methods and attributes."""

    SerializeToString: str = "s"  # the attack: a method's name
    DESCRIPTOR: int = 1
    Clear_: int = 2  # already the renamed form of the next one
    Clear: int = 3
    plain: str = ""


class ClashingEnv(Environment):
    def reset(self, seed=None, episode_id=None, **kwargs) -> AllObservation:  # type: ignore[no-untyped-def]
        return AllObservation()

    def step(self, action: Clashing) -> AllObservation:  # type: ignore[override]
        self.seen = action.model_dump(exclude={"metadata"})
        return AllObservation(metadata={"seen": self.seen})

    @property
    def state(self) -> State:
        return State()


def test_fields_named_like_message_methods_are_renamed_and_mapped_back() -> None:
    adapter = openenv_environment(ClashingEnv)
    action_class = message_types(adapter).action
    names = [f.name for f in action_class.DESCRIPTOR.fields]
    assert names == ["metadata", "SerializeToString_", "DESCRIPTOR_", "Clear_", "Clear__", "plain"]
    action = action_class(SerializeToString_="x", DESCRIPTOR_=7, Clear_=8, Clear__=9)
    raw = action.SerializeToString()  # the class's own method still works
    env = adapter()
    env.reset(seed=None, episode_id="e", options=None)
    result = env.step(action_class.FromString(raw))
    seen = {"SerializeToString": "x", "DESCRIPTOR": 7, "Clear_": 8, "Clear": 9, "plain": ""}
    assert env._env.seen == seen
    assert json.loads(result.observation.metadata.json) == {"seen": seen}


def make_with_settings(level: int = 2) -> Any:  # no annotation; names one env class
    raise RuntimeError("needs what only a session has")  # never called at build time
    return AllEnv()  # pragma: no cover


def test_factories_without_annotations_are_read_without_making_an_env() -> None:
    import functools

    assert openenv_environment(make_with_settings).openenv_class is AllEnv
    partial_adapter = openenv_environment(functools.partial(AllEnv))
    assert partial_adapter.openenv_class is AllEnv


def test_any_env_name_makes_valid_message_names() -> None:
    """An app's env_name need not be an identifier ("tbench2_env (local mode)")."""
    adapter = openenv_environment(AllEnv, name="2nd env (local mode)")
    assert adapter.name == "2nd env (local mode)"  # Info shows it as given
    options = message_types(adapter).reset_options.DESCRIPTOR
    assert options.name == "Env2ndEnvLocalModeResetOptions"
