"""The tensor convention, both ways: a message with ``data`` (bytes), ``shape`` (repeated
integers) and ``dtype`` (a numpy dtype name) holds an array, little-endian, C order.

The page shows such a message as its values (or an image) and lets a person type values
instead of base64 bytes: ``{"$tensor": {"dtype", "shape", "values"}}`` in the page's JSON
becomes the message's ``data``/``shape``/``dtype`` before the JSON is parsed.
"""

from __future__ import annotations

import array
import base64
import math
import sys
from collections.abc import Sequence
from typing import Any

from google.protobuf.descriptor import FieldDescriptor

__all__ = [
    "DTYPES",
    "MAX_DIMENSION",
    "MAX_RANK",
    "MAX_TENSOR_VALUES",
    "TensorInputError",
    "decode",
    "encode",
    "expand",
    "fits",
    "is_tensor",
]

#: Tensors with more elements than this show their shape and dtype only.
MAX_TENSOR_VALUES = 4096
#: Most dimensions a tensor may have (numpy's limit is 64; servers refuse more than 32).
MAX_RANK = 32
#: Largest size one dimension typed on the page may have.
MAX_DIMENSION = 2**31 - 1
#: numpy dtype names -> array typecodes (bool is one byte, 0 or 1).
DTYPES = {
    "float32": "f", "float64": "d", "int8": "b", "uint8": "B", "int16": "h", "uint16": "H",
    "int32": "i", "uint32": "I", "int64": "q", "uint64": "Q", "bool": "B",
}  # fmt: skip
_INTEGER_KINDS = (FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_INT32)


class TensorInputError(ValueError):
    """Values, shape and dtype typed on the page that do not make a tensor."""


def is_tensor(descriptor: Any) -> bool:
    """The message type follows the convention (``data`` bytes, ``shape`` repeated
    integers, ``dtype`` string)."""
    fields = descriptor.fields_by_name
    data, shape, dtype = fields.get("data"), fields.get("shape"), fields.get("dtype")
    return (
        data is not None
        and shape is not None
        and dtype is not None
        and data.type == FieldDescriptor.TYPE_BYTES
        and shape.is_repeated
        and shape.cpp_type in _INTEGER_KINDS
        and dtype.type == FieldDescriptor.TYPE_STRING
    )


def fits(raw: bytes, shape: Sequence[int], dtype: str) -> bool:
    """``shape`` (at most :data:`MAX_RANK` dimensions, none negative) holds exactly the
    elements ``raw`` has of ``dtype``: checked before the bytes are read as values."""
    typecode = DTYPES.get(dtype)
    if typecode is None or len(shape) > MAX_RANK:  # the rank first: a shape may be huge
        return False
    dims = list(shape)
    if any(d < 0 for d in dims):
        return False
    return math.prod(dims) * array.array(typecode).itemsize == len(raw)


def decode(raw: bytes, dtype: str, shape: Sequence[int] | None = None) -> list[Any] | None:
    """The elements of ``raw``, flat (non-finite floats as strings); None for an unknown
    dtype, a size that does not divide, a ``shape`` (when given) that does not hold the
    bytes (see :func:`fits`), or more than :data:`MAX_TENSOR_VALUES` elements."""
    typecode = DTYPES.get(dtype)
    if typecode is None or (shape is not None and not fits(raw, shape, dtype)):
        return None
    items = array.array(typecode)
    if len(raw) % items.itemsize or len(raw) // items.itemsize > MAX_TENSOR_VALUES:
        return None
    items.frombytes(raw)
    if sys.byteorder != "little":
        items.byteswap()
    if dtype == "bool":
        return [bool(item) for item in items]
    if dtype == "float32":  # the digits a float32 holds, not those of its float64 widening
        return [float(f"{item:.8g}") if math.isfinite(item) else str(item) for item in items]
    return [item if math.isfinite(item) else str(item) for item in items]


def encode(spec: object) -> dict[str, Any]:
    """The page's ``{"dtype", "shape", "values"}`` as the message's JSON fields
    (``data`` in base64). ``shape`` defaults to ``[len(values)]``; ``[]`` is a scalar.

    Raises:
        TensorInputError: an unknown dtype, a shape that does not match the number of
            values, or a value the dtype cannot hold.
    """
    if not isinstance(spec, dict):
        raise TensorInputError("a tensor is an object with dtype, shape and values")
    dtype = spec.get("dtype", "float32")
    typecode = DTYPES.get(dtype) if isinstance(dtype, str) else None
    if typecode is None:
        raise TensorInputError(f"unknown dtype {dtype!r}; one of {', '.join(DTYPES)}")
    values = spec.get("values", [])
    if not isinstance(values, list):
        raise TensorInputError("tensor values must be a list of numbers")
    shape = spec.get("shape")
    if shape is None:
        shape = [len(values)]
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIMENSION for d in shape
    ):
        raise TensorInputError(
            f"shape must be a list of sizes from 0 to {MAX_DIMENSION}, got {repr(shape)[:200]}"
        )
    if len(shape) > MAX_RANK:
        raise TensorInputError(f"shape has {len(shape)} dimensions; at most {MAX_RANK}")
    count = math.prod(shape)
    if count != len(values):
        raise TensorInputError(f"shape {shape} holds {count} values, got {len(values)}")
    try:
        if typecode in "fd":
            items = array.array(typecode, [float(v) for v in values])
        else:
            items = array.array(typecode, [_integer(v, dtype) for v in values])
    except (TypeError, ValueError, OverflowError) as exc:
        raise TensorInputError(f"values do not fit {dtype}: {exc}") from None
    if sys.byteorder != "little":
        items.byteswap()
    return {
        "data": base64.b64encode(items.tobytes()).decode(),
        "shape": shape,
        "dtype": dtype,
    }


def _integer(value: object, dtype: str) -> int:
    if dtype == "bool" and isinstance(value, bool):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{value!r} is not an integer")
    number = float(value) if not isinstance(value, int) else value
    if isinstance(number, float):
        if not number.is_integer():
            raise ValueError(f"{value!r} is not an integer")
        number = int(number)
    if dtype == "bool" and number not in (0, 1):
        raise ValueError(f"{value!r} is not 0 or 1")
    return number


def expand(data: Any) -> Any:
    """``data`` (the page's JSON) with every ``{"$tensor": {...}}`` replaced by the
    message fields :func:`encode` makes of it.

    Raises:
        TensorInputError: a tensor that does not encode.
    """
    if isinstance(data, dict):
        if set(data) == {"$tensor"}:
            return encode(data["$tensor"])
        return {key: expand(value) for key, value in data.items()}
    if isinstance(data, list):
        return [expand(item) for item in data]
    return data
