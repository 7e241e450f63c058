"""What JSON the bridge carries, both ways, so that no step the env took is reported as
an error because its answer could not be written.

- **In** (actions, reset options): a JSON field's value nested deeper than
  :data:`MAX_JSON_DEPTH` levels, or holding a lone surrogate (``"\\ud800"``: valid JSON,
  not Unicode text, so no protobuf string can carry it back), is refused before the env
  sees it: :func:`check_in` raises, and the client gets INVALID_ARGUMENT naming the field.
- **Out** (observations, metadata, state): what cannot be written is replaced, never
  raised after the env moved: :func:`safe_jsonable` and :func:`safe_dumps` give NaN and
  infinities as ``null`` (as OpenEnv's ``model_dump(mode="json")`` writes them, silently),
  and a lone surrogate or a value pydantic cannot serialize (nested 255 levels or more)
  as ``null`` with a warning naming the field (:class:`Warnings`).

The checks cost a walk only where needed: a value that strict JSON encoding takes whole
(no NaN, no surrogate: ASCII or encodable text) is sent as is.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import pydantic_core
from pydantic import BaseModel

__all__ = [
    "MAX_JSON_DEPTH",
    "WARNINGS_KEY",
    "Warnings",
    "check_in",
    "fallback",
    "has_lone_surrogate",
    "safe_dumps",
    "safe_jsonable",
    "short_path",
]

log = logging.getLogger(__name__)

#: The deepest nesting of lists and objects a JSON field may hold, in both directions
#: (pydantic's serializer stops at 255 levels; a Struct carries at most ~48).
MAX_JSON_DEPTH = 64
#: The info key that carries a step's warnings (a list of strings) to the client.
WARNINGS_KEY = "bridge_warnings"

#: Compact, refusing NaN and infinities: a failure sends the value to the slow path.
_STRICT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


#: Seconds between two log lines of replaced values: what a client sends may come back
#: in every answer (an echo), so the log says it once a period, with a count.
LOG_PERIOD = 10.0
_logged = {"at": -LOG_PERIOD, "since": 0}


class Warnings(list[str]):
    """What one answer replaced, each naming the field (``observation.data[2]: ...``)."""

    def add(self, where: str, problem: str) -> None:
        message = f"{short_path(where)}: {problem}; sent as null"
        self.append(message)
        now = time.monotonic()
        if now - _logged["at"] < LOG_PERIOD:
            _logged["since"] += 1
            return
        more = _logged["since"]
        _logged["at"], _logged["since"] = now, 0
        log.warning("openenv bridge: %s%s", message, f" (and {more} more since)" if more else "")


def short_path(where: str) -> str:
    """A field's path for a message, its middle cut when long (``data[0][0]...[0]``)."""
    return where if len(where) <= 80 else f"{where[:40]}...{where[-36:]}"


def has_lone_surrogate(text: str) -> bool:
    """Whether ``text`` holds a surrogate code point outside a pair (not encodable as
    UTF-8, so no protobuf string can hold it)."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_in(value: Any, name: str) -> None:
    """Refuse a JSON value the bridge could not carry back.

    Raises:
        ValueError: ``value`` is nested deeper than :data:`MAX_JSON_DEPTH` levels, or a
            string or key in it holds a lone surrogate (the message names the field and
            where in it).
    """
    stack: list[tuple[Any, str, int]] = [(value, name, 0)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, str):
            if has_lone_surrogate(item):
                raise ValueError(f"{short_path(where)}: a lone surrogate is not Unicode text")
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise ValueError(f"{name}: JSON nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(item, dict):
            for key, child in item.items():
                if has_lone_surrogate(key):
                    raise ValueError(
                        f"{short_path(where)}: a key with a lone surrogate is not Unicode text"
                    )
                stack.append((child, f"{where}.{key}", depth + 1))
        else:
            stack.extend((child, f"{where}[{i}]", depth + 1) for i, child in enumerate(item))


def safe_dumps(value: Any, where: str, warnings: Warnings) -> str:
    """``value`` as compact JSON text, as pydantic serializes it by field name, with what
    JSON cannot write replaced by ``null`` (see the module's docstring)."""
    try:
        text = _STRICT.encode(_jsonable(value))
        if not has_lone_surrogate(text):
            return text
    except (ValueError, TypeError, RecursionError):
        pass  # NaN, infinity, too deep: the slow path finds which
    return _STRICT.encode(_scrub(value, where, warnings, 0))


def safe_jsonable(value: Any, where: str, warnings: Warnings) -> Any:
    """``value`` as JSON data (for an info map), with what JSON cannot write replaced by
    ``None`` (see the module's docstring)."""
    try:
        data = _jsonable(value)
        if not has_lone_surrogate(_STRICT.encode(data)):
            return data
    except (ValueError, TypeError, RecursionError):
        pass
    return _scrub(value, where, warnings, 0)


def _jsonable(value: Any) -> Any:
    """As :func:`.convert.jsonable` (pydantic's JSON mode by field name)."""
    return pydantic_core.to_jsonable_python(value, by_alias=False, fallback=fallback)


def fallback(value: Any) -> Any:
    """What pydantic cannot serialize, as JSON data: its ``tolist()`` (numpy arrays, torch
    tensors), else its ``repr``; an object whose own methods raise is named, never raised
    (the env has moved: its answer must not fail)."""
    try:
        tolist = getattr(value, "tolist", None)
        return tolist() if callable(tolist) else repr(value)
    except Exception as exc:
        return f"<unrepresentable {type(value).__qualname__}: {type(exc).__name__}>"


def _scrub(value: Any, where: str, warnings: Warnings, depth: int) -> Any:
    """A JSON-safe copy of ``value``; what is replaced is noted in ``warnings``."""
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None  # as OpenEnv writes them
    if isinstance(value, str):
        if has_lone_surrogate(value):
            warnings.add(where, "a lone surrogate is not Unicode text")
            return None
        return value
    if depth >= MAX_JSON_DEPTH:
        warnings.add(where, f"nested more than {MAX_JSON_DEPTH} levels deep")
        return None
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, child in value.items():
            name = str(key)
            if has_lone_surrogate(name):
                warnings.add(f"{where}.{name!r}", "a key with a lone surrogate is left out")
                continue
            out[name] = _scrub(child, f"{where}.{name}", warnings, depth + 1)
        return out
    if isinstance(value, (list, tuple, set, frozenset)):
        return [
            _scrub(child, f"{where}[{i}]", warnings, depth + 1) for i, child in enumerate(value)
        ]
    if isinstance(value, BaseModel):  # field by field, by name (as model_dump)
        fields = {name: getattr(value, name) for name in type(value).model_fields}
        return _scrub({**fields, **(value.model_extra or {})}, where, warnings, depth)
    # A dataclass, enum, date, array...: as pydantic writes it, then the same walk.
    try:
        data = _jsonable(value)
    except (ValueError, TypeError, RecursionError) as exc:
        warnings.add(where, f"not serializable ({type(exc).__name__}: {exc})")
        return None
    return _scrub(data, where, warnings, depth)
