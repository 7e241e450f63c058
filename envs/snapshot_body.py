"""The catalogue's snapshot bodies: plain JSON objects, tagged with their layout, read back
through checked accessors.

Every env of the catalogue snapshots into one JSON object (UTF-8, compact) whose
``"format"`` names its layout (e.g. ``"wordle/1"``). JSON holds only data: nothing in it
is executed when read, and bytes travel as base64 strings. The server signs the body and
refuses foreign or tampered bytes before an env sees them; the accessors here are the
second line: a body that still does not fit (an older layout, a hand-made one signed with
a leaked key) is refused with :class:`~openenv_grpc.InvalidAction` naming the field,
never half applied.
"""

from __future__ import annotations

import base64
import binascii
import json
import random
import struct
from collections.abc import Mapping
from typing import Any

from openenv_grpc import InvalidAction

__all__ = ["MAX_SEED", "Body", "b64", "dump", "load", "random_from", "random_state"]

#: Seeds are the protocol's ``uint64``.
MAX_SEED = (1 << 64) - 1

#: ``random.Random.getstate()``'s layout: version 3, 624 Mersenne Twister words and the
#: index into them, then the cached Gaussian (or None).
_MT_VERSION = 3
_MT_WORDS = 625
_MT_PACK = struct.Struct(f"<{_MT_WORDS}I")


def dump(layout: str, body: Mapping[str, Any]) -> bytes:
    """``body`` as the snapshot bytes of layout ``layout``.

    Raises:
        TypeError, ValueError: ``body`` holds something JSON cannot (a bug of the env).
    """
    return json.dumps({"format": layout, **body}, separators=(",", ":")).encode()


def load(layout: str, data: bytes) -> Body:
    """The body in ``data``, which must be of layout ``layout``.

    Raises:
        InvalidAction: not a JSON object, or of another layout.
    """
    try:
        parsed = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidAction(f"the snapshot is not a {layout} body: {exc}") from None
    if not isinstance(parsed, dict):
        raise InvalidAction(f"the snapshot is not a {layout} body: a JSON object was expected")
    found = parsed.get("format")
    if found != layout:
        raise InvalidAction(f"the snapshot's layout is {found!r}; this env reads {layout!r}")
    return Body(parsed, "")


class Body:
    """A JSON object of a snapshot, read field by field with the type each must have.

    Every accessor raises :class:`InvalidAction` naming the field (its dotted path) when
    it is missing or of another type.
    """

    __slots__ = ("_path", "_values")

    def __init__(self, values: dict[str, Any], path: str) -> None:
        self._values = values
        self._path = path

    def _get(self, key: str) -> Any:
        if key not in self._values:
            raise InvalidAction(f"the snapshot lacks the field {self._path}{key}")
        return self._values[key]

    def _wrong(self, key: str, wanted: str) -> InvalidAction:
        return self.invalid(key, f"must be {wanted}, got {type(self._values[key]).__name__}")

    def invalid(self, key: str, why: str) -> InvalidAction:
        """The error for field ``key``: "snapshot field <path> <why>"."""
        return InvalidAction(f"snapshot field {self._path}{key} {why}")

    def has(self, key: str) -> bool:
        """Whether the field is present and not null."""
        return self._values.get(key) is not None

    def raw(self, key: str) -> Any:
        """A field of any type, unchecked."""
        return self._get(key)

    def integer(self, key: str, *, low: int | None = None, high: int | None = None) -> int:
        """An integer field (not a boolean), within ``low..high`` when given."""
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._wrong(key, "an integer")
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"{low if low is not None else '-inf'}..{high if high is not None else 'inf'}"
            raise self.invalid(key, f"is {value}, outside {bounds}")
        return value

    def number(self, key: str) -> float:
        """A number field, as a float."""
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._wrong(key, "a number")
        return float(value)

    def boolean(self, key: str) -> bool:
        """A boolean field."""
        value = self._get(key)
        if not isinstance(value, bool):
            raise self._wrong(key, "a boolean")
        return value

    def string(self, key: str, *, max_chars: int | None = None) -> str:
        """A string field, at most ``max_chars`` long when given."""
        value = self._get(key)
        if not isinstance(value, str):
            raise self._wrong(key, "a string")
        if max_chars is not None and len(value) > max_chars:
            raise self.invalid(key, f"has {len(value)} characters; the limit is {max_chars}")
        return value

    def blob(self, key: str) -> bytes:
        """A base64 string field, decoded."""
        text = self.string(key)
        try:
            return base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise self.invalid(key, "is not base64") from None

    def array(self, key: str, *, max_items: int | None = None) -> list[Any]:
        """A list field (its items unchecked), at most ``max_items`` long when given."""
        value = self._get(key)
        if not isinstance(value, list):
            raise self._wrong(key, "a list")
        if max_items is not None and len(value) > max_items:
            raise self.invalid(key, f"has {len(value)} items; the limit is {max_items}")
        return value

    def strings(self, key: str, *, max_items: int | None = None) -> list[str]:
        """A list-of-strings field."""
        items = self.array(key, max_items=max_items)
        if not all(isinstance(item, str) for item in items):
            raise self.invalid(key, "must hold strings only")
        return items

    def mapping(self, key: str) -> dict[str, Any]:
        """An object field, as a plain dict (its values unchecked)."""
        value = self._get(key)
        if not isinstance(value, dict):
            raise self._wrong(key, "an object")
        return value

    def child(self, key: str) -> Body:
        """An object field, read with the same checks."""
        return Body(self.mapping(key), f"{self._path}{key}.")

    def children(self, key: str, *, max_items: int | None = None) -> list[Body]:
        """A list-of-objects field, each read with the same checks."""
        items = self.array(key, max_items=max_items)
        if not all(isinstance(item, dict) for item in items):
            raise self.invalid(key, "must hold objects only")
        return [Body(item, f"{self._path}{key}[{i}].") for i, item in enumerate(items)]


def b64(data: bytes) -> str:
    """``data`` as the base64 text a body holds (read back with :meth:`Body.blob`)."""
    return base64.b64encode(data).decode("ascii")


def random_state(rng: random.Random) -> dict[str, Any]:
    """The whole state of ``rng`` as plain data (3.4 KB), for :func:`random_from`."""
    version, words, gauss = rng.getstate()
    return {"version": version, "words": b64(_MT_PACK.pack(*words)), "gauss": gauss}


def random_from(body: Body) -> random.Random:
    """A generator in the state :func:`random_state` recorded.

    Raises:
        InvalidAction: the state is malformed.
    """
    version = body.integer("version")
    words = body.blob("words")
    gauss = body.number("gauss") if body.has("gauss") else None
    if version != _MT_VERSION or len(words) != _MT_PACK.size:
        raise body.invalid(
            "words", f"is not a Mersenne Twister state (version {version}, {len(words)} bytes)"
        )
    rng = random.Random()
    try:
        rng.setstate((version, _MT_PACK.unpack(words), gauss))
    except (TypeError, ValueError) as exc:
        raise body.invalid("words", f"is not usable: {exc}") from None
    return rng
