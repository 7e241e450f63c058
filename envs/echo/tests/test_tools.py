"""Echo's tools over a real server: listing, calling, and every bad call."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import json_format

from openenv_grpc import EnvError
from openenv_grpc.tools import ListToolsCall, ToolCall
from openenv_grpc_envs.echo import EchoAction, EchoEnv

pytestmark = pytest.mark.shared_server


def call(name: str, call_id: str = "c1", **arguments: object) -> EchoAction:
    action = EchoAction(tool_call=ToolCall(call_id=call_id, name=name))
    action.tool_call.arguments.update(arguments)
    return action


@pytest.fixture
def env(server):  # type: ignore[no-untyped-def]
    with EchoEnv(server.target) as session:
        session.reset()
        yield session


def test_reset_lists_the_tools_with_schemas(server) -> None:
    with EchoEnv(server.target) as env:
        tools = {t.name: t for t in env.reset().observation.tools.tools}
    assert sorted(tools) == ["count", "history", "reverse"]
    assert tools["reverse"].description == "Return the message reversed."
    assert json_format.MessageToDict(tools["count"].input_schema) == {
        "type": "object",
        "properties": {"message": {"type": "string"}, "letter": {"type": "string"}},
        "required": ["message", "letter"],
        "additionalProperties": False,
    }
    history = json_format.MessageToDict(tools["history"].input_schema)
    assert history["properties"] == {"last": {"type": "integer"}} and history["required"] == []


def test_list_tools_action_answers_with_the_list(env) -> None:
    result = env.step(EchoAction(list_tools=ListToolsCall()))
    assert [t.name for t in result.observation.tools.tools] == ["count", "history", "reverse"]
    assert result.step_count == 1 and result.reward == 0.0


def test_tool_calls_return_typed_results(env) -> None:
    reversed_ = env.step(call("reverse", call_id="r1", message="hello")).observation.tool_result
    assert (reversed_.call_id, reversed_.name, reversed_.is_error) == ("r1", "reverse", False)
    assert reversed_.content.string_value == "olleh"
    counted = env.step(call("count", message="banana", letter="a")).observation.tool_result
    assert counted.content.number_value == 3
    env.step(EchoAction(message="one"))
    env.step(EchoAction(message="two"))
    recent = env.step(call("history", last=1)).observation.tool_result
    assert json_format.MessageToDict(recent.content) == ["two"]
    everything = env.step(call("history")).observation.tool_result  # default argument
    assert json_format.MessageToDict(everything.content) == ["one", "two"]


@pytest.mark.parametrize(
    ("action", "message"),
    [
        (call("shout", message="x"), "no tool named 'shout' (tools: count, history, reverse)"),
        (call("reverse"), "tool 'reverse' is missing argument 'message'"),
        (call("reverse", message="x", loud=True), "tool 'reverse' has no argument 'loud'"),
        (
            call("reverse", message=3),
            "tool 'reverse': argument 'message' must be string, got float",
        ),
        (call("history", last=1.5), "tool 'history': argument 'last' must be integer, got float"),
    ],
)
def test_bad_calls_are_invalid_argument_and_change_nothing(env, action, message) -> None:
    with pytest.raises(EnvError) as failed:
        env.step(action)
    assert failed.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert failed.value.message == message
    assert env.step(EchoAction(message="still here")).step_count == 1


def test_a_failing_tool_is_an_error_result_and_the_episode_goes_on(env) -> None:
    result = env.step(call("count", message="abc", letter="ab")).observation.tool_result
    assert result.is_error
    assert result.error == "ValueError: letter must be one character, got 2"
    assert not result.HasField("content")
    assert env.step(EchoAction(message="next")).step_count == 2
