"""A stream's commands: the proto's ``command`` oneof, and the tables that answer them.

Every place that answers a request by its command -- the Session view, the vector view,
the env process's block requests -- keeps one table from the oneof's field names to what
answers each, built by :func:`command_table`; the env process's frames are a table over
its ``Op`` enum, built by :func:`complete_table`. A table that misses a command of the
proto, or names one the proto does not have, fails as its module is imported: a command
added to ``session.proto`` is found unanswered before any stream is served (and
``tests/test_command_tables.py`` names every table).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

from google.protobuf.message import Message

__all__ = ["IncompleteTable", "command_fields", "command_table", "complete_table", "empty_request"]

_K = TypeVar("_K")
_V = TypeVar("_V")

#: The oneof of a stream's request that holds its command.
ONEOF = "command"


class IncompleteTable(TypeError):
    """A dispatch table does not have exactly one entry per key it must answer."""


def command_fields(request_class: type[Message]) -> tuple[str, ...]:
    """The field names of ``request_class``'s command oneof, in the proto's order."""
    return tuple(field.name for field in request_class.DESCRIPTOR.oneofs_by_name[ONEOF].fields)


def empty_request(request_class: type[Message]) -> str:
    """The message of a request with no command set (INVALID_ARGUMENT)."""
    return "empty request: set one of " + ", ".join(command_fields(request_class))


def complete_table(what: str, keys: Iterable[_K], handlers: Mapping[_K, _V]) -> dict[_K, _V]:
    """``handlers`` as a dict, checked to have an entry for each of ``keys`` and no other.

    Raises:
        IncompleteTable: a key has no entry, or an entry is not one of ``keys``.
    """
    expected = list(keys)
    missing = [key for key in expected if key not in handlers]
    unknown = [key for key in handlers if key not in expected]
    if missing or unknown:
        raise IncompleteTable(
            f"{what}: no entry for {missing or 'none missing'}; "
            f"entries for what is not one: {unknown or 'none'}"
        )
    return dict(handlers)


def command_table(
    request_class: type[Message],
    handlers: Mapping[str, _V],
    *,
    empty: _V | None = None,
    elsewhere: Iterable[str] = (),
) -> dict[str | None, _V]:
    """The table of ``request_class``'s commands: ``handlers`` by the command oneof's field
    name, checked to answer each field exactly once, and ``empty`` (when given) under
    ``None``, the key of a request with no command (what ``WhichOneof`` says then).
    ``elsewhere`` are commands this table never sees because they come another way (the
    env process's close is a frame of its own); each must be a field of the oneof.

    Raises:
        IncompleteTable: a command has no handler, or a handler names no command.
    """
    fields = command_fields(request_class)
    aside = set(elsewhere)
    what = f"the {request_class.DESCRIPTOR.full_name} command table"
    if not aside <= set(fields):
        raise IncompleteTable(f"{what}: {sorted(aside - set(fields))} are not commands")
    checked = complete_table(what, [name for name in fields if name not in aside], handlers)
    table: dict[str | None, _V] = {name: handler for name, handler in checked.items()}
    if empty is not None:
        table[None] = empty
    return table
