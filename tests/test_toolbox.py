"""Toolbox schemas and argument checks (pure functions: no server needed)."""

from __future__ import annotations

from typing import Optional

import pytest
from google.protobuf import json_format

from openenv_grpc import InvalidAction
from openenv_grpc.tools import Toolbox, ToolCall, tool


class Calculator:
    @tool
    def add(self, a: float, b: float = 0.0) -> float:
        """Add two numbers."""
        return a + b

    @tool(name="sum-all", description="Sum a list of integers.")
    def total(self, values: list[int], label: Optional[str] = None) -> dict[str, object]:  # noqa: UP045
        return {"label": label, "sum": sum(values)}

    def not_a_tool(self) -> None:
        """Never listed."""


def invoke(box: Toolbox, name: str, **arguments: object) -> object:
    call = ToolCall(name=name)
    call.arguments.update(arguments)
    result = box.call(call)
    assert not result.is_error, result.error
    return json_format.MessageToDict(result.content)


def test_schema_follows_type_hints() -> None:
    tools = {
        t.name: json_format.MessageToDict(t.input_schema)
        for t in Toolbox(Calculator()).list().tools
    }
    assert sorted(tools) == ["add", "sum-all"]
    assert tools["add"]["properties"] == {"a": {"type": "number"}, "b": {"type": "number"}}
    assert tools["add"]["required"] == ["a"]
    assert tools["sum-all"]["properties"] == {
        "values": {"type": "array", "items": {"type": "integer"}},
        "label": {"type": "string"},
    }


def test_calls_coerce_json_numbers() -> None:
    box = Toolbox(Calculator())
    assert invoke(box, "add", a=1, b=2.5) == 3.5
    assert invoke(box, "sum-all", values=[1, 2, 3]) == {"label": None, "sum": 6.0}


def test_integer_items_must_be_whole() -> None:
    with pytest.raises(InvalidAction, match=r"argument 'values\[\]' must be integer, got float"):
        invoke(Toolbox(Calculator()), "sum-all", values=[1, 2.5])


def test_booleans_are_not_numbers() -> None:
    with pytest.raises(InvalidAction, match="argument 'a' must be number, got bool"):
        invoke(Toolbox(Calculator()), "add", a=True)


def test_untyped_parameters_are_refused_at_definition() -> None:
    class Bad:
        @tool
        def f(self, x):  # type: ignore[no-untyped-def]
            return x

    with pytest.raises(TypeError, match="parameter 'x' needs a type"):
        Toolbox(Bad())
