"""The requests' ``command`` oneof, and dispatch tables checked to answer each command
exactly once as their module is imported (``tests/test_command_tables.py`` names them)."""

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
    pass


def command_fields(request_class: type[Message]) -> tuple[str, ...]:
    return tuple(field.name for field in request_class.DESCRIPTOR.oneofs_by_name[ONEOF].fields)


def empty_request(request_class: type[Message]) -> str:
    return "empty request: set one of " + ", ".join(command_fields(request_class))


def complete_table(what: str, keys: Iterable[_K], handlers: Mapping[_K, _V]) -> dict[_K, _V]:
    """``handlers`` as a dict, checked to have an entry for each of ``keys`` and no other."""
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
    """``handlers`` by command field, checked, and ``empty`` (if given) under ``None``
    (no command set). ``elsewhere``: commands that come another way (fields all the same).
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
