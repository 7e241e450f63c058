"""Conversions between numpy / gymnasium objects and this env's protobuf messages.

Both ends use them: the server to send observations and read actions, clients to read
observations and write actions.

* :func:`to_numpy` / :func:`fill_tensor` / :func:`to_tensor`: ndarray <-> ``Tensor``
  (raw little-endian bytes, a shape and a dtype name; never lists of numbers).
* :func:`describe_space` / :func:`build_space`: gymnasium space <-> ``Space``.
* :func:`fill_value` / :func:`encode`: a Python/numpy value -> ``Value``, guided by its
  space when one is given.
* :func:`decode`: ``Value`` -> Python/numpy value; given a space it also validates (kind,
  shape, dtype, range) and raises :class:`ConversionError` with a message that names
  the offending part (``action['arm'][1]: ...``).

Copies: an array becomes bytes with one ``ndarray.tobytes()`` (C order whatever the
layout) and protobuf copies those bytes once more into its own arena; upb accepts no
``memoryview`` or ``bytearray`` for a ``bytes`` field, so that second copy is unavoidable.
Reading ``Tensor.data`` copies once too; :func:`to_numpy` then views those bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from gymnasium import spaces

from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import (
    BoxSpace,
    Space,
    Tensor,
    Value,
)

__all__ = [
    "DTYPES",
    "MAX_RANK",
    "ConversionError",
    "build_space",
    "decode",
    "describe_space",
    "encode",
    "fill_tensor",
    "fill_value",
    "nbytes",
    "to_numpy",
    "to_tensor",
]

#: The dtype names a Tensor may carry.
DTYPES = frozenset(
    {
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    }
)

# dtype -> wire name, and wire name -> little-endian dtype: dtype.name is slow (µs).
_NAMES: dict[np.dtype[Any], str] = {np.dtype(name): name for name in DTYPES}
_LITTLE: dict[str, np.dtype[Any]] = {name: np.dtype(name).newbyteorder("<") for name in DTYPES}

#: The space types this module converts.
SUPPORTED_SPACES = "Box, Discrete, MultiDiscrete, MultiBinary, Dict and Tuple"

Array = npt.NDArray[Any]


class ConversionError(ValueError):
    """A value, tensor or space cannot be converted; the message says where and why."""


# -- tensors ------------------------------------------------------------------------------


def fill_tensor(target: Tensor, array: npt.ArrayLike) -> None:
    """Write ``array`` into ``target`` (one ``tobytes`` copy, whatever its layout).

    Raises:
        ConversionError: the array's dtype is not one of :data:`DTYPES`.
    """
    arr = np.asarray(array)
    name = _NAMES.get(arr.dtype)
    if name is None:  # not a native dtype: another byte order, or no Tensor dtype at all
        name = arr.dtype.name
        if name not in DTYPES:
            raise ConversionError(f"dtype {arr.dtype} cannot travel as a Tensor")
        if arr.dtype.byteorder == ">":  # the wire is little-endian
            arr = arr.astype(arr.dtype.newbyteorder("<"))
    target.data = arr.tobytes()  # C order even for a non-contiguous view: one copy
    target.shape[:] = arr.shape
    target.dtype = name


def to_tensor(array: npt.ArrayLike) -> Tensor:
    """A new ``Tensor`` holding ``array``; see :func:`fill_tensor`."""
    tensor = Tensor()
    fill_tensor(tensor, array)
    return tensor


#: Most dimensions a Tensor may have (numpy's own limit is 64 in numpy 2, 32 before).
MAX_RANK = 32
#: Most elements an empty Tensor's non-zero dimensions may describe: a zero-size array
#: of shape ``[0, 2**62]`` is 0 bytes on the wire but too big for numpy.
MAX_EMPTY_ELEMENTS = 2**31


def show_shape(shape: Sequence[int]) -> str:
    """A shape for a message, short however long the hostile one is."""
    if len(shape) <= 8:
        return str(list(shape))
    return f"[{', '.join(map(str, list(shape[:8])))}, ...] (rank {len(shape)})"


def check_tensor(
    shape: Sequence[int],
    dtype: np.dtype[Any],
    size: int,
    what: str,
    expected: tuple[int, ...] | None = None,
    accepts: str = "",
) -> tuple[int, ...]:
    """The shape of a Tensor whose ``size`` bytes hold ``dtype`` elements, checked before
    numpy sees it: its rank, each dimension, the byte count, and ``expected`` (the
    declared space's shape, whose ``accepts`` names it) when given.

    Raises:
        ConversionError: what is wrong, naming ``what`` and what it accepts.
    """
    rank = len(shape)  # before touching the dims: a shape may hold a million of them
    if expected is not None:
        dims = tuple(shape) if rank == len(expected) else None
        if dims != expected:
            raise ConversionError(
                f"{what}: shape {show_shape(shape)} does not match {accepts or 'the space'} "
                f"(shape {list(expected)})"
            )
    elif rank > MAX_RANK:
        raise ConversionError(
            f"{what}: rank {rank} is over the limit of {MAX_RANK} dimensions a tensor may have"
        )
    dims = tuple(shape)
    if any(dim < 0 for dim in dims):
        raise ConversionError(f"{what}: negative dimension in shape {show_shape(dims)}")
    count = math.prod(dims)
    if count == 0 and math.prod(d for d in dims if d) > MAX_EMPTY_ELEMENTS:
        raise ConversionError(
            f"{what}: shape {show_shape(dims)} describes an empty tensor with dimensions "
            f"too large (their product is over {MAX_EMPTY_ELEMENTS})"
        )
    if size != count * dtype.itemsize:
        raise ConversionError(
            f"{what}: {size} bytes of data for shape {show_shape(dims)} {dtype.name} "
            f"(expected {count * dtype.itemsize})"
        )
    return dims


def to_numpy(
    tensor: Tensor,
    *,
    writable: bool = False,
    what: str = "tensor",
    shape: tuple[int, ...] | None = None,
    accepts: str = "",
) -> Array:
    """The array a ``Tensor`` holds: a read-only view of its bytes unless ``writable``.

    With ``shape`` (the declared space's), any other shape is refused before numpy sees
    it (``accepts`` names what takes it); without, the rank and the dimensions are
    bounded (:data:`MAX_RANK`, :data:`MAX_EMPTY_ELEMENTS`) and must match the bytes.

    Raises:
        ConversionError: unknown dtype, a shape that is not the expected one, too many
            dimensions, a negative or huge dimension, or a byte count that does not match
            the shape (``what`` names the tensor in the message).
    """
    name = tensor.dtype
    if name not in DTYPES:
        raise ConversionError(
            f"{what}: unknown dtype {name[:64]!r}; expected one of {', '.join(sorted(DTYPES))}"
        )
    dtype = _LITTLE[name]
    data = tensor.data  # one copy out of the message; the array views it
    dims = check_tensor(tensor.shape, dtype, len(data), what, shape, accepts)
    array = np.frombuffer(data, dtype=dtype).reshape(dims)
    return array.copy() if writable else array


# -- spaces -------------------------------------------------------------------------------


def _bound(values: Array) -> Tensor:
    """A Box bound: a scalar when every element shares it (Atari: 0 and 255)."""
    if values.size and bool(np.all(values == values.flat[0])):
        return to_tensor(values.flat[0:1].reshape(()))
    return to_tensor(values)


def describe_space(space: spaces.Space[Any], target: Space | None = None) -> Space:
    """The ``Space`` message describing ``space`` (written into ``target`` if given).

    Raises:
        ConversionError: the space (or a sub-space) is not a supported type.
    """
    message = Space() if target is None else target
    if isinstance(space, spaces.Box):
        box: BoxSpace = message.box
        box.shape[:] = space.shape
        box.dtype = space.dtype.name
        box.low.CopyFrom(_bound(space.low))
        box.high.CopyFrom(_bound(space.high))
    elif isinstance(space, spaces.Discrete):
        message.discrete.n = int(space.n)
        message.discrete.start = int(space.start)
    elif isinstance(space, spaces.MultiDiscrete):
        fill_tensor(message.multi_discrete.nvec, space.nvec)
        fill_tensor(message.multi_discrete.start, space.start)
    elif isinstance(space, spaces.MultiBinary):
        message.multi_binary.shape[:] = space.shape
    elif isinstance(space, spaces.Dict):
        message.dict.SetInParent()  # an empty Dict is still a Dict
        for key, sub in space.spaces.items():
            if not isinstance(key, str):
                raise ConversionError(f"Dict space key {key!r} is not a string")
            entry = message.dict.entries.add(key=key)
            describe_space(sub, entry.space)
    elif isinstance(space, spaces.Tuple):
        message.tuple.SetInParent()
        for sub in space.spaces:
            describe_space(sub, message.tuple.spaces.add())
    else:
        raise _unsupported(space)
    return message


def build_space(message: Space) -> spaces.Space[Any]:
    """The gymnasium space a ``Space`` message describes (the inverse of describe_space).

    Raises:
        ConversionError: the message is empty or holds an invalid tensor.
    """
    kind = message.WhichOneof("kind")
    if kind == "box":
        box = message.box
        shape = tuple(box.shape)
        low, high = (
            to_numpy(t, what=f"Box {w}") for t, w in ((box.low, "low"), (box.high, "high"))
        )
        return spaces.Box(
            low=low if low.shape else low.item(),
            high=high if high.shape else high.item(),
            shape=shape,
            dtype=np.dtype(box.dtype),
        )
    if kind == "discrete":
        return spaces.Discrete(message.discrete.n, start=message.discrete.start)
    if kind == "multi_discrete":
        nvec = to_numpy(message.multi_discrete.nvec, writable=True, what="nvec")
        start = to_numpy(message.multi_discrete.start, writable=True, what="start")
        return spaces.MultiDiscrete(nvec, dtype=nvec.dtype, start=start)
    if kind == "multi_binary":
        dims = list(message.multi_binary.shape)
        return spaces.MultiBinary(dims[0] if len(dims) == 1 else dims)  # as gymnasium keeps n
    if kind == "dict":
        entries = [(e.key, build_space(e.space)) for e in message.dict.entries]
        return spaces.Dict(entries, sort_keys=False)
    if kind == "tuple":
        return spaces.Tuple([build_space(s) for s in message.tuple.spaces])
    raise ConversionError("empty Space message")


# -- values -------------------------------------------------------------------------------


def fill_value(target: Value, obj: Any, space: spaces.Space[Any] | None = None) -> None:
    """Write ``obj`` into ``target``; with ``space``, shaped and typed like that space.

    Without a space: ints become ``discrete``, arrays and floats ``tensor``, mappings
    ``dict`` and tuples/lists ``tuple``.

    Raises:
        ConversionError: ``obj`` cannot be written (unsupported space or dtype).
    """
    if space is None:
        _fill_untyped(target, obj)
    elif isinstance(space, spaces.Discrete):
        target.discrete = int(obj)
    elif isinstance(space, (spaces.Box, spaces.MultiDiscrete, spaces.MultiBinary)):
        fill_tensor(target.tensor, np.asarray(obj, dtype=space.dtype))
    elif isinstance(space, spaces.Dict):
        items = target.dict.items
        target.dict.SetInParent()
        for key, sub in space.spaces.items():
            fill_value(items[key], obj[key], sub)
    elif isinstance(space, spaces.Tuple):
        target.tuple.SetInParent()
        for item, sub in zip(obj, space.spaces, strict=True):
            fill_value(target.tuple.items.add(), item, sub)
    else:
        raise _unsupported(space)


def _fill_untyped(target: Value, obj: Any) -> None:
    if isinstance(obj, (bool, np.bool_)):
        fill_tensor(target.tensor, np.asarray(obj))
    elif isinstance(obj, (int, np.integer)):
        target.discrete = int(obj)
    elif isinstance(obj, Mapping):
        target.dict.SetInParent()
        for key, item in obj.items():
            fill_value(target.dict.items[str(key)], item)
    elif isinstance(obj, tuple):
        target.tuple.SetInParent()
        for item in obj:
            fill_value(target.tuple.items.add(), item)
    else:
        fill_tensor(target.tensor, np.asarray(obj))


def encode(obj: Any, space: spaces.Space[Any] | None = None) -> Value:
    """A new ``Value`` holding ``obj``; see :func:`fill_value`."""
    value = Value()
    fill_value(value, obj, space)
    return value


def decode(value: Value, space: spaces.Space[Any] | None = None, path: str = "value") -> Any:
    """The Python/numpy value a ``Value`` holds.

    Without a space: ``discrete`` -> int, ``tensor`` -> read-only ndarray, ``ints`` ->
    int64 ndarray, ``dict`` -> dict, ``tuple`` -> tuple. With a space, the result is an
    element of it (``space.contains`` holds): Discrete -> ``np.int64``, array spaces ->
    a writable ndarray of the space's dtype and shape, Dict -> dict in the space's key
    order, Tuple -> tuple.

    Raises:
        ConversionError: the value does not fit the space; ``path`` starts the message.
    """
    if space is None:
        return _decode_untyped(value, path)
    kind = value.WhichOneof("kind")
    if isinstance(space, spaces.Discrete):
        _expect(kind, ("discrete",), space, path)
        low = int(space.start)
        high = low + int(space.n) - 1
        if not low <= value.discrete <= high:
            raise ConversionError(
                f"{path}: {value.discrete} is out of range for {_label(space)} "
                f"(valid: {low}..{high})"
            )
        return np.int64(value.discrete)
    if isinstance(space, spaces.Box):
        _expect(kind, ("tensor",), space, path)
        array = _array(value, space, path)
        if not space.contains(array):
            outside = _outside(array, space.low, space.high)
            raise ConversionError(f"{path}: {outside} of {_label(space)}")
        return array
    if isinstance(space, spaces.MultiDiscrete):
        _expect(kind, ("tensor", "ints"), space, path)
        array = _array(value, space, path)
        if not space.contains(array):
            outside = _outside(array, space.start, space.start + space.nvec - 1)
            raise ConversionError(f"{path}: {outside} of {_label(space)}")
        return array
    if isinstance(space, spaces.MultiBinary):
        _expect(kind, ("tensor", "ints"), space, path)
        array = _array(value, space, path)
        if not space.contains(array):
            raise ConversionError(f"{path}: {_outside(array, 0, 1)} of {_label(space)}")
        return array
    if isinstance(space, spaces.Dict):
        _expect(kind, ("dict",), space, path)
        items = value.dict.items
        missing = [k for k in space.spaces if k not in items]
        unknown = sorted(k for k in items if k not in space.spaces)
        if missing or unknown:
            parts = []
            if missing:
                parts.append(f"missing keys {missing}")
            if unknown:
                parts.append(f"unknown keys {unknown}")
            raise ConversionError(f"{path}: {' and '.join(parts)} for {_label(space)}")
        return {
            key: decode(items[key], sub, f"{path}[{key!r}]") for key, sub in space.spaces.items()
        }
    if isinstance(space, spaces.Tuple):
        _expect(kind, ("tuple",), space, path)
        items_list = value.tuple.items
        if len(items_list) != len(space.spaces):
            raise ConversionError(
                f"{path}: {len(items_list)} items for a Tuple of {len(space.spaces)} spaces"
            )
        return tuple(
            decode(item, sub, f"{path}[{i}]")
            for i, (item, sub) in enumerate(zip(items_list, space.spaces, strict=True))
        )
    raise _unsupported(space)


def _decode_untyped(value: Value, path: str) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "discrete":
        return value.discrete
    if kind == "tensor":
        return to_numpy(value.tensor, what=path)
    if kind == "ints":
        return np.array(value.ints.values, dtype=np.int64)
    if kind == "dict":
        return {k: _decode_untyped(v, f"{path}[{k!r}]") for k, v in value.dict.items.items()}
    if kind == "tuple":
        return tuple(_decode_untyped(v, f"{path}[{i}]") for i, v in enumerate(value.tuple.items))
    raise ConversionError(f"{path}: empty Value")


def _expect(kind: str | None, allowed: Sequence[str], space: spaces.Space[Any], path: str) -> None:
    if kind not in allowed:
        wanted = " or ".join(f"`{k}`" for k in allowed)
        got = f"`{kind}`" if kind else "an empty Value"
        raise ConversionError(f"{path}: {_label(space)} takes {wanted}, got {got}")


def _array(value: Value, space: spaces.Space[Any], path: str) -> Array:
    """The value's array in the space's dtype and shape, or a ConversionError."""
    assert space.shape is not None and space.dtype is not None  # array spaces have both
    return array_of(value, tuple(space.shape), np.dtype(space.dtype), _label(space), path)


def array_of(
    value: Value, shape: tuple[int, ...], target: np.dtype[Any], label: str, path: str
) -> Array:
    """The array a ``tensor`` or ``ints`` value holds, as a writable array of ``shape``
    and dtype ``target`` (``label`` names what it is for in errors).

    Raises:
        ConversionError: a wrong size or shape, or a lossy cast (see :func:`_cast`).
    """
    if value.WhichOneof("kind") == "ints":
        ints = np.array(value.ints.values, dtype=np.int64)
        if ints.size != math.prod(shape):
            raise ConversionError(
                f"{path}: {ints.size} ints for {label} (expected {math.prod(shape)})"
            )
        return _cast(ints, target, path).reshape(shape)
    # The declared shape is checked before numpy sees the tensor (rank, dims, bytes).
    array = to_numpy(value.tensor, what=path, shape=shape, accepts=label)
    return _cast(array, target, path)


def _cast(array: Array, target: np.dtype[Any], path: str) -> Array:
    """A writable copy of ``array`` in dtype ``target``; refuses lossy integer casts.

    Safe casts always pass; float -> narrower float (rounding) and int -> float pass;
    int -> narrower int passes only when no value changes; anything else (float -> int,
    number -> bool) is refused.
    """
    source = array.dtype
    if source == target or np.can_cast(source, target, "safe"):
        return array.astype(target)  # astype copies: the env gets a writable array
    if np.can_cast(source, target, "same_kind"):
        cast = array.astype(target)
        if target.kind == "f" or np.array_equal(cast.astype(source), array):
            return cast
        raise ConversionError(f"{path}: values do not fit in {target.name}")
    raise ConversionError(f"{path}: dtype {source.name} cannot be cast to {target.name}")


def _outside(array: Array, low: Any, high: Any) -> str:
    """Describe the first element of ``array`` outside [low, high]."""
    low_b = np.broadcast_to(low, array.shape)
    high_b = np.broadcast_to(high, array.shape)
    with np.errstate(invalid="ignore"):
        bad = ~((array >= low_b) & (array <= high_b))
    if not bad.any():  # contains() failed for another reason (e.g. dtype)
        return "value is not an element"
    index = tuple(int(i) for i in np.argwhere(bad)[0])
    where = f"element {list(index)} " if array.ndim else ""
    value, lo, hi = (a[index].item() for a in (array, low_b, high_b))  # plain Python reprs
    return f"{where}{value!r} is outside [{lo!r}, {hi!r}]"


def _unsupported(space: spaces.Space[Any]) -> ConversionError:
    return ConversionError(
        f"space {_label(space)} is not supported (supported: {SUPPORTED_SPACES})"
    )


def _label(space: spaces.Space[Any]) -> str:
    """A one-line name of ``space`` for error messages (reprs of 2-d bounds span lines)."""
    if isinstance(space, spaces.Dict):
        return f"Dict with keys {list(space.spaces)}"
    if isinstance(space, spaces.Tuple):
        return f"Tuple of {len(space.spaces)} spaces"
    return " ".join(str(space).split())


def nbytes(obj: Any) -> int:
    """Bytes of array data in an observation (8 per Discrete integer)."""
    if isinstance(obj, Mapping):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, tuple):
        return sum(nbytes(v) for v in obj)
    return int(np.asarray(obj).nbytes)
