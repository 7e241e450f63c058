"""The per-env queries (``state``, ``snapshot``, ``render``): the env method and command
field of that name, whose answer is checked and serialized here for every batch kind (a
wrong type is that env's INTERNAL error). A new query is an entry in :data:`QUERIES`."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from google.protobuf.message import Message

from openenv_grpc.environment import EnvironmentTypes
from openenv_grpc.server.errors import BadTransition, RowError
from openenv_grpc.v1.session_pb2 import Frame

__all__ = ["QUERIES", "AnswerTooLarge", "BatchStates", "ReadsWithin", "wrong_type"]


class AnswerTooLarge(Exception):
    """A query's answers passed their room: ``at_least`` bytes were read (none kept);
    ``errors``: the envs already known to have failed."""

    def __init__(self, at_least: int, errors: dict[int, RowError] | None = None) -> None:
        super().__init__(f"the answers are at least {at_least} bytes")
        self.at_least = at_least
        self.errors: dict[int, RowError] = errors if errors is not None else {}


@runtime_checkable
class ReadsWithin(Protocol):
    """Batch calls that bound a query's answers where the envs make them."""

    async def query_within(self, name: str, indices: Sequence[int], room: int) -> BatchStates:
        """Each env's answer to query ``name``, or its error, as ``query`` does.

        Raises:
            AnswerTooLarge: the answers passed ``room`` bytes (no env is read past that).
            BatchRefused: the whole call failed (e.g. the server's byte budget is short).
        """
        ...


def wrong_type(what: str, value: object, expected: type[Message]) -> str:
    return (
        f"environment returned a {type(value).__qualname__} {what}, "
        f"declared {expected.DESCRIPTOR.full_name}"
    )


def _state(value: Any, types: EnvironmentTypes) -> bytes:
    if not isinstance(value, types.state):
        raise BadTransition(wrong_type("state", value, types.state))
    return value.SerializeToString()


def _snapshot(value: Any, types: EnvironmentTypes) -> bytes:
    if not isinstance(value, bytes | bytearray):
        raise BadTransition(
            f"environment returned a {type(value).__qualname__} from snapshot(), not bytes; "
            "the episode goes on"
        )
    return bytes(value)


def _frame(value: Any, types: EnvironmentTypes) -> bytes:
    """``render()``'s text, uint8 image array or Frame, as a serialized ``Frame``."""
    if isinstance(value, str):
        return Frame(text=value).SerializeToString()
    frame = value if isinstance(value, Frame) else _from_array(value)
    content = frame.WhichOneof("content")
    if content is None:
        raise BadTransition("environment returned an empty Frame from render(): no frame")
    if content == "image":
        _check_image(frame.image)
    return frame.SerializeToString()


def _from_array(value: Any) -> Frame:
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None or not hasattr(value, "tobytes"):
        raise BadTransition(
            f"environment returned a {type(value).__qualname__} from render(), not text or "
            "an image array"
        )
    shape = tuple(shape)
    channels = shape[2] if len(shape) == 3 else 1
    if (
        str(dtype) != "uint8"
        or len(shape) not in (2, 3)
        or not all(_side(side) for side in shape)
        or channels not in (1, 3, 4)
    ):
        raise BadTransition(
            f"environment returned an image of shape {shape} and dtype {dtype} from "
            "render(); a frame is uint8, (height, width) or (height, width, 1 | 3 | 4)"
        )
    frame = Frame()
    image = frame.image
    image.height, image.width, image.channels = shape[0], shape[1], channels
    image.pixels = value.tobytes()  # C order whatever the array's layout
    return frame


def _check_image(image: Any) -> None:
    sides = (image.height, image.width, image.channels)
    if not (image.height and image.width and image.channels in (1, 3, 4)):
        raise BadTransition(
            f"environment rendered an image of {sides[0]} x {sides[1]} x {sides[2]}; an "
            "image has rows, pixels per row, and 1, 3 or 4 channels"
        )
    if len(image.pixels) != image.height * image.width * image.channels:
        raise BadTransition(
            f"environment rendered {len(image.pixels)} pixel bytes for an image of "
            f"{sides[0]} x {sides[1]} x {sides[2]}"
        )


#: Rows or pixels per row an image may have (Image's fields are uint32).
_MAX_SIDE = 1 << 31


def _side(side: object) -> bool:
    if not isinstance(side, numbers.Integral) or isinstance(side, bool):
        return False
    return 0 < int(side) < _MAX_SIDE


#: Query name -> the encoder of an env's answer (raises BadTransition).
QUERIES: dict[str, Callable[[Any, EnvironmentTypes], bytes]] = {
    "state": _state,
    "snapshot": _snapshot,
    "render": _frame,
}


@dataclass(slots=True)
class BatchStates:
    """What a query returned: each env's encoded answer for ``rows``, and the errors."""

    rows: list[int] = field(default_factory=list)
    states: list[bytes] = field(default_factory=list)
    errors: dict[int, RowError] = field(default_factory=dict)
