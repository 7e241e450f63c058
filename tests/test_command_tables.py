"""Every command of the proto has exactly one handler in each table that answers it, and
every table's key is a real command (issue #38: one table per dispatcher, derived from the
request's ``command`` oneof, instead of if-chains).

The tables are checked as their modules are imported (``model/commands.py``); these tests
name each table, and show that the check refuses a table with a command missing or one
too many.
"""

from __future__ import annotations

import pytest

from openenv_grpc.server.isolated import env_process
from openenv_grpc.server.model.commands import (
    IncompleteTable,
    command_fields,
    command_table,
    complete_table,
    empty_request,
)
from openenv_grpc.server.stream import session_view, vector_view
from openenv_grpc.server.stream.backend import Outcome
from openenv_grpc.v1 import session_pb2 as pb

SESSION = set(command_fields(pb.SessionRequest))
VECTOR = set(command_fields(pb.VectorSessionRequest))


def test_the_fields_are_the_proto_oneofs() -> None:
    for request in (pb.SessionRequest, pb.VectorSessionRequest):
        oneof = request.DESCRIPTOR.oneofs_by_name["command"]
        assert command_fields(request) == tuple(field.name for field in oneof.fields)
    assert {"step", "reset", "state", "snapshot", "restore", "render", "close"} <= SESSION
    assert SESSION == VECTOR


@pytest.mark.parametrize(
    ("table", "fields"),
    [(session_view._COMMANDS, SESSION), (vector_view._COMMANDS, VECTOR)],
    ids=["session", "vector"],
)
def test_each_view_answers_every_command_once_and_the_empty_request(
    table: dict[str | None, object], fields: set[str]
) -> None:
    assert set(table) == fields | {None}
    handlers = [entry.run for entry in table.values()]  # type: ignore[attr-defined]
    assert len(set(handlers)) == len(handlers), "one handler per command"


@pytest.mark.parametrize("view", [session_view, vector_view], ids=["session", "vector"])
def test_what_a_commands_answer_is_lies_in_its_entry(view: object) -> None:
    table = view._COMMANDS  # type: ignore[attr-defined]
    outcomes = {name: entry.outcome for name, entry in table.items()}
    ends = {name for name, entry in table.items() if entry.ends}
    assert outcomes.pop("step") is Outcome.STEPPED
    assert outcomes.pop("close") is Outcome.CLOSED
    assert set(outcomes.values()) == {Outcome.ANSWERED}
    assert ends == {"close"}


def test_a_vector_command_holds_the_envs_it_names_except_close() -> None:
    holds = {name for name, entry in vector_view._COMMANDS.items() if entry.holds}
    assert holds == VECTOR - {"close"}


def test_the_env_process_answers_every_op_and_dispatches_commands_by_name() -> None:
    assert not hasattr(env_process, "_BLOCK_COMMANDS")  # no table of commands: by name
    assert set(env_process._OPS) == set(env_process.Op)
    assert all(env_process._OPS[op] is not None for op in (1, 2, 3, 4))  # ints as read


def test_the_empty_request_message_is_unchanged() -> None:
    expected = "empty request: set one of reset, step, state, close, snapshot, restore, render"
    assert empty_request(pb.SessionRequest) == expected
    assert empty_request(pb.VectorSessionRequest) == expected
    assert session_view._EMPTY == vector_view._EMPTY == expected


def test_a_table_missing_a_command_is_refused() -> None:
    handlers = dict.fromkeys(SESSION - {"render"}, "h")
    with pytest.raises(IncompleteTable, match="render"):
        command_table(pb.SessionRequest, handlers)


def test_a_table_naming_no_command_is_refused() -> None:
    handlers = dict.fromkeys(SESSION | {"teleport"}, "h")
    with pytest.raises(IncompleteTable, match="teleport"):
        command_table(pb.SessionRequest, handlers)


def test_a_command_answered_elsewhere_must_be_a_command_and_not_in_the_table() -> None:
    with pytest.raises(IncompleteTable, match="teleport"):
        command_table(pb.SessionRequest, dict.fromkeys(SESSION, "h"), elsewhere=("teleport",))
    with pytest.raises(IncompleteTable, match="close"):
        command_table(pb.SessionRequest, dict.fromkeys(SESSION, "h"), elsewhere=("close",))
    table = command_table(
        pb.SessionRequest, dict.fromkeys(SESSION - {"close"}, "h"), elsewhere=("close",)
    )
    assert set(table) == SESSION - {"close"}


def test_an_op_table_is_complete() -> None:
    with pytest.raises(IncompleteTable, match="QUERY"):
        complete_table("ops", env_process.Op, {op: "h" for op in env_process.Op if op.value != 4})
