"""The conversions on their own: every supported space, Dict and Tuple included.

No registered env without extra dependencies has a Dict space, so these exercise Dict
(and nested) spaces directly on gymnasium.spaces objects.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from gymnasium import spaces

from openenv_grpc_envs.gymnasium import Tensor, Value
from openenv_grpc_envs.gymnasium.convert import (
    ConversionError,
    build_space,
    decode,
    describe_space,
    encode,
    nbytes,
    to_numpy,
    to_tensor,
)
from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import DictValue, IntList, TupleValue

NESTED = spaces.Dict(
    [
        ("position", spaces.Box(-1.0, 1.0, (2, 3), np.float32)),
        ("buttons", spaces.MultiBinary(4)),
        (
            "dials",
            spaces.MultiDiscrete(np.array([[3, 5], [2, 7]]), start=np.array([[0, 1], [-1, 0]])),
        ),
        ("mode", spaces.Discrete(3, start=-1)),
        (
            "inner",
            spaces.Tuple(
                [spaces.Discrete(2), spaces.Box(0, 255, (4, 4), np.uint8), spaces.Dict({})]
            ),
        ),
    ],
    sort_keys=False,
)


def test_tensors_round_trip_every_dtype_and_layout() -> None:
    for dtype in ["bool", "int8", "uint16", "int64", "uint64", "float16", "float64"]:
        array = (np.arange(24).reshape(2, 3, 4) % 2).astype(dtype)
        for view in (array, array.T, array[:, ::2], array[0, 0, 0]):  # non-contiguous too
            back = to_numpy(to_tensor(view))
            assert back.dtype == view.dtype and back.shape == view.shape
            assert np.array_equal(back, view)
            assert (
                not back.flags.writeable
                and to_numpy(to_tensor(view), writable=True).flags.writeable
            )
    big_endian = np.arange(3, dtype=">i4")
    assert to_tensor(big_endian).data == np.arange(3, dtype="<i4").tobytes()
    with pytest.raises(ConversionError, match="dtype complex128 cannot travel as a Tensor"):
        to_tensor(np.zeros(2, dtype=complex))
    with pytest.raises(ConversionError, match=r"negative dimension in shape \[-1\]"):
        to_numpy(Tensor(shape=[-1], dtype="uint8"))


def test_spaces_round_trip_including_dict_and_tuple() -> None:
    described = describe_space(NESTED)
    assert [e.key for e in described.dict.entries] == list(NESTED.spaces)  # order kept
    rebuilt = build_space(described)
    assert isinstance(rebuilt, spaces.Dict) and rebuilt == NESTED
    assert list(rebuilt.spaces) == list(NESTED.spaces)


def test_uniform_box_bounds_travel_as_scalars() -> None:
    frame = describe_space(spaces.Box(0, 255, (210, 160, 3), np.uint8))
    assert list(frame.box.low.shape) == [] and frame.box.high.data == b"\xff"
    assert frame.ByteSize() < 64
    mixed = spaces.Box(np.array([-np.inf, 0.0]), np.array([np.inf, 1.0]), dtype=np.float64)
    assert list(describe_space(mixed).box.low.shape) == [2]
    assert build_space(describe_space(mixed)) == mixed


def test_unsupported_spaces_are_named() -> None:
    with pytest.raises(ConversionError, match=r"space Text\(.*\) is not supported"):
        describe_space(spaces.Text(5))
    with pytest.raises(ConversionError, match="empty Space message"):
        build_space(describe_space(spaces.Discrete(2)).__class__())


def test_values_round_trip_through_their_space() -> None:
    NESTED.seed(0)
    for _ in range(5):
        sample = NESTED.sample()
        value = Value.FromString(encode(sample, NESTED).SerializeToString())
        back = decode(value, NESTED, "action")
        assert NESTED.contains(back)
        _assert_same(back, sample)
        untyped = decode(value)  # without the space: plain Python and numpy
        assert untyped["mode"] == int(sample["mode"])
        assert np.array_equal(untyped["inner"][1], sample["inner"][1])


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert np.array_equal(a, b) and np.asarray(a).dtype == np.asarray(b).dtype


def test_int_lists_fill_multi_discrete_and_multi_binary() -> None:
    dials = decode(Value(ints=IntList(values=[2, 5, 0, 6])), NESTED["dials"], "a")
    assert dials.dtype == np.int64 and dials.tolist() == [[2, 5], [0, 6]]
    buttons = decode(Value(ints=IntList(values=[1, 0, 1, 1])), NESTED["buttons"], "a")
    assert buttons.dtype == np.int8 and buttons.tolist() == [1, 0, 1, 1]


def _dict_value(**items: Value) -> Value:
    return Value(dict=DictValue(items=items))


@pytest.mark.parametrize(
    ("space", "value", "message"),
    [
        (
            NESTED,
            Value(discrete=1),
            r"a: Dict with keys \['position', 'buttons', 'dials', 'mode', 'inner'\] takes "
            "`dict`, got `discrete`",
        ),
        (
            NESTED,
            _dict_value(mode=Value(discrete=0), extra=Value(discrete=0)),
            r"a: missing keys \['position', 'buttons', 'dials', 'inner'\] and unknown keys "
            r"\['extra'\] for Dict with keys",
        ),
        (
            NESTED["inner"],
            Value(tuple=TupleValue(items=[Value(discrete=0)])),
            "a: 1 items for a Tuple of 3 spaces",
        ),
        (
            NESTED["inner"],
            Value(tuple=TupleValue(items=[Value(discrete=2), Value(), Value()])),
            r"a\[0\]: 2 is out of range for Discrete\(2\) \(valid: 0..1\)",
        ),
        (
            NESTED["mode"],
            Value(discrete=2),
            r"a: 2 is out of range for Discrete\(3, start=-1\) \(valid: -1..1\)",
        ),
        (
            NESTED["dials"],
            Value(ints=IntList(values=[2, 5, 0, 7])),
            r"a: element \[1, 1\] 7 is outside \[0, 6\] of "
            r"MultiDiscrete\(\[\[3 5\] \[2 7\]\], start=\[\[ 0 1\] \[-1 0\]\]\)$",
        ),
        (
            NESTED["dials"],
            Value(ints=IntList(values=[1, 2])),
            r"a: 2 ints for MultiDiscrete\(.*\) \(expected 4\)",
        ),
        (
            NESTED["buttons"],
            Value(ints=IntList(values=[0, 2, 0, 0])),
            r"a: element \[1\] 2 is outside \[0, 1\] of MultiBinary\(4\)",
        ),
        (
            NESTED["buttons"],
            Value(ints=IntList(values=[0, 300, 0, 0])),
            "a: values do not fit in int8",
        ),
        (
            NESTED["buttons"],
            Value(tensor=to_tensor(np.zeros(4, np.float32))),
            "a: dtype float32 cannot be cast to int8",
        ),
        (
            NESTED["position"],
            Value(ints=IntList(values=[0] * 6)),
            r"a: Box\(-1.0, 1.0, \(2, 3\), float32\) takes `tensor`, got `ints`",
        ),
    ],
)
def test_values_that_do_not_fit_are_refused(
    space: spaces.Space[Any], value: Value, message: str
) -> None:
    with pytest.raises(ConversionError, match=message):
        decode(value, space, "a")


def test_nbytes_counts_array_data() -> None:
    assert nbytes(np.zeros((210, 160, 3), np.uint8)) == 100_800
    assert nbytes((3, np.zeros(4, np.float32), {"a": np.int64(1)})) == 8 + 16 + 8
