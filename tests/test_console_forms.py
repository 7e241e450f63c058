"""The console's generic parts, on every catalogue type: form schemas from descriptors
(no env needs UI code) and observation views (images, tensors, text, odd numbers)."""

from __future__ import annotations

import base64
import io
import json
import math
import re
from typing import Any

import numpy as np
import pytest
from google.protobuf import any_pb2, json_format, struct_pb2
from PIL import Image

from openenv_grpc.console.schema import schemas
from openenv_grpc.console.tensors import (
    MAX_TENSOR_VALUES,
    TensorInputError,
    decode,
    encode,
    expand,
)
from openenv_grpc.console.views import image_png, json_safe, to_view
from openenv_grpc_envs.coding.v1 import coding_pb2
from openenv_grpc_envs.echo.v1 import echo_pb2
from openenv_grpc_envs.gymnasium.v1 import gymnasium_pb2 as gym
from openenv_grpc_envs.openspiel.v1 import openspiel_pb2
from openenv_grpc_envs.wordle.v1 import wordle_pb2

ROOTS = {
    "echo": (echo_pb2.EchoAction, echo_pb2.EchoResetOptions),
    "coding": (coding_pb2.CodingAction, coding_pb2.CodingResetOptions),
    "openspiel": (openspiel_pb2.OpenSpielAction, openspiel_pb2.OpenSpielResetOptions),
    "wordle": (wordle_pb2.WordleAction, wordle_pb2.WordleResetOptions),
    "gymnasium": (gym.GymnasiumAction, gym.GymnasiumResetOptions),
}


def fields(found: dict[str, Any], message: Any) -> dict[str, dict[str, Any]]:
    return {f["name"]: f for f in found[message.DESCRIPTOR.full_name]["fields"]}


@pytest.mark.parametrize("env", ROOTS)
def test_every_referenced_type_is_described_once(env: str) -> None:
    found = schemas(*(m.DESCRIPTOR for m in ROOTS[env]))
    for message in ROOTS[env]:
        assert message.DESCRIPTOR.full_name in found
    for schema in found.values():
        for field in schema["fields"]:
            specs = [field["key"], field["value"]] if field["kind"] == "map" else [field]
            for spec in specs:
                if spec["kind"] == "message":
                    assert spec["message"] in found, (schema["name"], field["name"])
        json.dumps(schema)  # plain JSON, as /api/info sends it


def test_oneofs_optional_fields_and_well_known_types() -> None:
    found = schemas(echo_pb2.EchoAction.DESCRIPTOR, gym.GymnasiumResetOptions.DESCRIPTOR)
    echo = found["openenv_grpc_envs.echo.v1.EchoAction"]
    assert echo["oneofs"] == [{"name": "kind", "fields": ["message", "list_tools", "tool_call"]}]
    assert {f["name"]: f["oneof"] for f in echo["fields"]} == {
        "message": "kind", "list_tools": "kind", "tool_call": "kind",
    }  # fmt: skip
    options = fields(found, gym.GymnasiumResetOptions)
    # `optional` is presence, not a oneof the page should offer as a choice.
    assert found[gym.GymnasiumResetOptions.DESCRIPTOR.full_name]["oneofs"] == []
    assert (
        options["max_episode_steps"]["optional"] and options["max_episode_steps"]["oneof"] is None
    )
    assert options["max_episode_steps"]["kind"] == "uint"
    assert options["kwargs"]["kind"] == "json"  # a Struct is edited as JSON
    assert options["env_id"] == {
        "name": "env_id", "json_name": "envId", "repeated": False, "optional": False,
        "oneof": None, "kind": "string",
    }  # fmt: skip


def test_recursive_messages_maps_enums_and_repeated_fields() -> None:
    found = schemas(gym.GymnasiumAction.DESCRIPTOR, coding_pb2.CodingAction.DESCRIPTOR)
    items = fields(found, gym.DictValue)["items"]
    assert items["kind"] == "map" and items["key"] == {"kind": "string"}
    assert items["value"] == {"kind": "message", "message": gym.Value.DESCRIPTOR.full_name}
    assert fields(found, gym.TupleValue)["items"]["repeated"]
    assert fields(found, gym.Tensor)["shape"] == {
        "name": "shape", "json_name": "shape", "repeated": True, "optional": False,
        "oneof": None, "kind": "int64",
    }  # fmt: skip
    action = fields(found, coding_pb2.CodingAction)
    assert action["tests"]["repeated"] and action["tests"]["kind"] == "message"
    assert action["files"]["kind"] == "map" and action["files"]["value"] == {"kind": "string"}
    spiel = schemas(openspiel_pb2.OpenSpielResetOptions.DESCRIPTOR)
    control = fields(spiel, openspiel_pb2.OpenSpielResetOptions)["control"]
    assert control["kind"] == "enum"
    assert control["enum"] == [
        "CONTROL_MODE_UNSPECIFIED", "CONTROL_MODE_AGENT_VS_RANDOM", "CONTROL_MODE_ALL_PLAYERS",
    ]  # fmt: skip


def test_a_picture_shaped_uint8_tensor_becomes_a_png_of_the_same_pixels() -> None:
    frame = np.random.default_rng(0).integers(0, 255, (210, 160, 3), dtype=np.uint8)
    observation = gym.GymnasiumObservation(
        value=gym.Value(tensor=gym.Tensor(data=frame.tobytes(), shape=frame.shape, dtype="uint8"))
    )
    image = to_view(observation)["value"]["tensor"]["$image"]
    assert image["shape"] == [210, 160, 3] and image["dtype"] == "uint8"
    decoded = Image.open(io.BytesIO(base64.b64decode(image["png"])))
    assert decoded.size == (160, 210) and decoded.mode == "RGB"
    assert np.array_equal(np.asarray(decoded), frame)
    gray = np.arange(84 * 84, dtype=np.uint8).reshape(84, 84)
    assert Image.open(io.BytesIO(image_png(gray.tobytes(), [84, 84], "uint8") or b"")).mode == "L"


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [([4], "uint8"), ([4, 4], "uint8"), ([210, 160, 2], "uint8"), ([8, 8], "float32")],
)
def test_other_tensors_are_not_images(shape: list[int], dtype: str) -> None:
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    assert image_png(b"\0" * size, shape, dtype) is None


def test_small_tensors_show_their_values_and_big_ones_their_shape() -> None:
    values = np.array([0.5, -1.0, np.nan, np.inf], dtype=np.float32)
    tensor = gym.Tensor(data=values.tobytes(), shape=[4], dtype="float32")
    view = to_view(gym.GymnasiumAction(value=gym.Value(tensor=tensor)))["value"]["tensor"]
    assert view == {
        "$tensor": {"shape": [4], "dtype": "float32", "size": 16,
                    "values": [0.5, -1.0, "nan", "inf"]},
    }  # fmt: skip
    big = np.zeros(MAX_TENSOR_VALUES + 1, dtype=np.float64)
    tensor = gym.Tensor(data=big.tobytes(), shape=[big.size], dtype="float64")
    assert "values" not in to_view(tensor)["$tensor"]
    odd = gym.Tensor(data=b"\1\2\3", shape=[3], dtype="complex64")  # unknown dtype
    assert to_view(odd) == {"$tensor": {"shape": [3], "dtype": "complex64", "size": 3}}


def test_views_show_defaults_enums_maps_text_and_omit_unset_messages() -> None:
    observation = wordle_pb2.WordleObservation(
        board="CRANE\n🟩⬜🟨⬜⬜",
        guesses=[wordle_pb2.GuessResult(word="crane", scores=[1, 3, 2, 3, 3])],
    )
    view = to_view(observation)
    assert view["board"] == "CRANE\n🟩⬜🟨⬜⬜"
    assert view["won"] is False and view["turn"] == 0  # defaults are information
    assert view["guesses"][0]["scores"][:3] == [
        "LETTER_SCORE_GREEN", "LETTER_SCORE_GRAY", "LETTER_SCORE_YELLOW",
    ]  # fmt: skip
    options = openspiel_pb2.OpenSpielResetOptions(params={"players": "3"})
    assert to_view(options)["params"] == {"players": "3"}
    echo = to_view(echo_pb2.EchoObservation(echoed_message="hi"))
    assert "tools" not in echo and "tool_result" not in echo  # unset messages are left out


def test_numbers_json_cannot_hold_become_strings() -> None:
    state = gym.GymnasiumState(episode_return=math.nan, seed=2**63)
    view = to_view(state)
    assert view["episode_return"] == "nan" and view["seed"] == str(2**63)
    struct = struct_pb2.Struct()
    struct.update({"x": math.inf, "nested": {"y": [1, math.nan]}})
    assert to_view(gym.GymnasiumResetOptions(kwargs=struct))["kwargs"] == {
        "x": "inf", "nested": {"y": [1.0, "nan"]},
    }  # fmt: skip
    assert json_safe({"a": (1, 2**60), "b": object}) == {"a": [1, str(2**60)], "b": repr(object)}
    assert json.loads(json.dumps(view, allow_nan=False))  # strict JSON


def test_bytes_fields_show_their_size_and_a_prefix() -> None:
    action = coding_pb2.CodingAction(code="print(1)")
    assert to_view(action)["code"] == "print(1)"
    tensor = openspiel_pb2.Tensor(data=b"\x01" * 5000, shape=[5000], dtype="weird")
    assert to_view(tensor) == {"$tensor": {"shape": [5000], "dtype": "weird", "size": 5000}}
    shown = to_view(any_pb2.Any(type_url="x/y", value=b"\xff" * 5000))["value"]["$bytes"]
    assert shown["size"] == 5000 and len(base64.b64decode(shown["base64"])) == 1024


def test_typed_tensors_encode_to_the_message_fields_and_back() -> None:
    encoded = encode({"dtype": "float32", "shape": [2, 2], "values": [1, 2.5, -3, 0]})
    message = json_format.ParseDict(encoded, gym.Tensor())
    assert list(message.shape) == [2, 2] and message.dtype == "float32"
    assert np.frombuffer(message.data, np.float32).tolist() == [1, 2.5, -3, 0]
    assert decode(message.data, "float32") == [1, 2.5, -3, 0]
    assert encode({"dtype": "int64", "values": [3]})["shape"] == [1]  # flat by default
    assert encode({"dtype": "bool", "values": [True, 0]})["data"] == "AQA="
    nested = {"value": {"tensor": {"$tensor": {"dtype": "uint8", "values": [7]}}}}
    action = json_format.ParseDict(expand(nested), gym.GymnasiumAction())
    assert action.value.tensor.data == b"\x07"


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"dtype": "float32", "shape": [2], "values": [1]}, "shape [2] holds 2 values, got 1"),
        ({"dtype": "complex", "values": [1]}, "unknown dtype 'complex'"),
        ({"dtype": "float32", "values": ["abc"]}, "values do not fit float32"),
        ({"dtype": "uint8", "values": [300]}, "values do not fit uint8"),
        ({"dtype": "int32", "values": [1.5]}, "values do not fit int32"),
        ({"dtype": "bool", "values": [2]}, "values do not fit bool"),
        ({"dtype": "float32", "shape": [-1], "values": []}, "shape must be a list of sizes"),
        ({"dtype": "float32", "values": "1,2"}, "must be a list"),
        ("1,2", "an object with dtype"),
    ],
)
def test_typed_tensors_that_do_not_encode_say_why(spec: Any, words: str) -> None:
    with pytest.raises(TensorInputError, match=re.escape(words)):
        encode(spec)
