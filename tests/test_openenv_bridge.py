"""OpenEnv environments served unchanged: ``openenv-grpc serve --openenv MODULE:CLASS``.

The envs (tests/support/openenv_envs/) are written as OpenEnv 0.10 teaches and import
nothing of openenv-grpc. Each is served by a real ``openenv-grpc serve`` process and
driven by our Python client, typed from the server's Info alone; the same env served by
OpenEnv's own ``create_app`` (uvicorn) answers the same actions with the same
observations."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from openenv_grpc import CapacityError, EnvError
from openenv_grpc.cli import main
from openenv_grpc.client.info import message_classes
from openenv_grpc.integrations.openenv import described_session
from openenv_grpc.integrations.openenv.parity import differences, grpc_episode, openenv_episode
from openenv_grpc.integrations.openenv.serving import adapter_for
from openenv_grpc.integrations.openenv_web_ui import VARIABLE
from openenv_grpc.testing import ServerProcess

TESTS = Path(__file__).resolve().parent
ECHO = "support.openenv_envs.echo:EchoEnvironment"
WAREHOUSE = "support.openenv_envs.warehouse:WarehouseEnvironment"
MCP_ECHO = "support.openenv_envs.mcp_echo:EchoMCPEnvironment"


def bridged(ref: str, *args: str) -> ServerProcess:
    return ServerProcess(f"--openenv={ref}", list(args), pythonpath=[TESTS])


#: The module's bridged servers, one per (ref, args), shared by its tests.
_SERVERS: dict[tuple[str, ...], ServerProcess] = {}


@pytest.fixture(scope="module", autouse=True)
def _stop_the_modules_servers() -> Iterator[None]:
    yield
    while _SERVERS:
        _SERVERS.popitem()[1].stop()


@contextlib.contextmanager
def serving(ref: str, *args: str) -> Iterator[ServerProcess]:
    """The module's one server for ``ref`` and ``args``, started on first use (a bridged
    start imports OpenEnv: seconds). A test gets it with no session open; one that fails,
    or leaves a session open, has it stopped, and the next test starts another."""
    key = (ref, *args)
    server = _SERVERS.get(key)
    if server is None or server.proc.poll() is not None:
        server = _SERVERS[key] = bridged(ref, *args)
    try:
        yield server
    except BaseException:
        _SERVERS.pop(key).stop()
        raise
    try:
        server.wait_until(lambda: server.active() == 0, what="the test's sessions closed")
    except Exception:  # sessions left open, or an Info this test cannot read: a new one
        _SERVERS.pop(key).stop()


@contextlib.contextmanager
def openenv_server(app: str) -> Iterator[str]:
    """OpenEnv's own server (create_app under uvicorn) on a free loopback port."""
    environ = {**os.environ, "PYTHONPATH": str(TESTS)}
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", f"support.openenv_envs.apps:{app}",
         "--host", "127.0.0.1", "--port", "0", "--log-level", "info"],
        stderr=subprocess.PIPE, text=True, env=environ,
    )  # fmt: skip
    try:
        assert process.stderr is not None
        for line in process.stderr:
            match = re.search(r"running on http://127\.0\.0\.1:(\d+)", line)
            if match:
                yield f"http://127.0.0.1:{match.group(1)}"
                break
        else:
            pytest.fail("uvicorn did not start")
    finally:
        process.terminate()
        process.wait(10)


def message_fields(message: Any) -> Any:
    """Every set field of ``message`` as plain data (enums by name, nested as dicts)."""
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def test_template_env_through_info_alone() -> None:
    with serving(ECHO) as server:
        info = server.info()
        assert info.env_name == "EchoEnvironment"
        assert info.action_type.endswith(".EchoAction")
        assert info.observation_type.endswith(".EchoObservation")
        assert info.state_type.endswith(".State")
        assert info.capacity.max_sessions == 1024  # SUPPORTS_CONCURRENT_SESSIONS = True
        # The observation message holds the env's fields and its metadata (JSON text, as
        # OpenEnv's JSON has it); reward and done go in the result's own fields, and the
        # metadata in info too.
        observation = message_classes(info)["observation"].DESCRIPTOR
        names = [f.name for f in observation.fields]
        assert names == ["metadata", "echoed_message", "message_length"]
        EchoEnv = described_session(info)
        with EchoEnv(server.target) as env:
            first = env.reset(seed=5, episode_id="ep-1")
            assert first.observation.echoed_message == "Echo environment ready!"
            assert (first.reward, first.terminated, first.truncated) == (0.0, False, False)
            result = env.step(EchoEnv.Action(message="hello"))
            assert result.observation.echoed_message == "hello"
            assert result.observation.message_length == 5
            assert result.reward == pytest.approx(0.5)
            assert result.info == {"original_message": "hello", "step": 1.0}  # a Struct
            metadata = json.loads(result.observation.metadata.json)
            assert metadata == {"original_message": "hello", "step": 1}
            assert type(metadata["step"]) is int  # the observation's copy keeps the int
            state = env.state()
            assert (state.episode_id, state.step_count) == ("ep-1", 1)  # our episode id
            # A required field left unset is pydantic's "Field required", in-band.
            with pytest.raises(EnvError) as refused:
                env.step(EchoEnv.Action())
            assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.message == "invalid EchoAction: message: Field required"
            assert env.step(EchoEnv.Action(message="on")).observation.message_length == 2
        server.wait_until(lambda: server.active() == 0, what="the session to close")


def test_nested_list_enum_fields_and_typed_reset_options() -> None:
    with serving(WAREHOUSE) as server:
        assert server.info().capacity.max_sessions == 1  # not concurrency-safe: capacity 1
        assert "does not declare SUPPORTS_CONCURRENT_SESSIONS = True: capacity 1" in (
            server.stderr()
        )
        Warehouse = described_session(server.target)
        options = Warehouse.ResetOptions.DESCRIPTOR
        assert [f.name for f in options.fields] == ["difficulty", "skus"]  # reset's own
        with Warehouse(server.target) as env:
            first = env.reset(seed=3, options=Warehouse.ResetOptions(difficulty=2))
            assert list(first.observation.missing) == ["apple", "bolt", "cable"]
            assert first.info == {"step": 0.0, "difficulty": 2.0}
            action = Warehouse.Action(note="fragile", mode="add")
            action.hints["speed"] = 0.5
            line = action.lines.add(quantity=2)
            line.item.sku = "bolt"
            line.item.size = (
                Warehouse.Action.DESCRIPTOR.file.enum_types_by_name["Size"]
                .values_by_name["SIZE_LARGE"]
                .number
            )
            line.item.tags.extend(["steel", "m4"])
            result = env.step(action)
            observation = message_fields(result.observation)
            assert observation["basket"] == [
                {"item": {"sku": "bolt", "size": "SIZE_LARGE", "tags": ["steel", "m4"]},
                 "quantity": "2"}
            ]  # fmt: skip
            assert observation["counts"] == {"bolt": "2"}
            assert observation["last_note"] == "fragile" and observation["weights"] == [1.0]
            extra = json.loads(result.observation.extra.json)
            assert extra == {"order_size": 7, "skus": ["apple", "bolt", "cable"]}
            assert type(extra["order_size"]) is int
            assert result.reward == pytest.approx(-0.1) and not result.terminated
            state = env.state()
            assert dict(state.order) == {"apple": 2, "bolt": 2, "cable": 3}
            assert state.difficulty == 2
            with pytest.raises(EnvError, match="mode: Input should be 'add' or 'remove'"):
                env.step(Warehouse.Action(mode="steal"))
            # Finish the order: done -> terminated, then a reset on the same session.
            finish = Warehouse.Action()
            for sku, quantity in (("apple", 2), ("cable", 3)):
                finish.lines.add(quantity=quantity).item.sku = sku
            done = env.step(finish)
            assert done.terminated and done.reward == 1.0
            with pytest.raises(EnvError) as after:
                env.step(finish)
            assert after.value.code is grpc.StatusCode.FAILED_PRECONDITION
            assert env.reset(seed=3).observation.missing == ["bolt", "cable"]
            # Capacity 1: a second session is refused before any env exists.
            with pytest.raises(CapacityError):
                Warehouse(server.target).open()


def test_mcp_env_tools_through_the_bridge() -> None:
    with serving(MCP_ECHO) as server:
        Mcp = described_session(server.target)
        kinds = [f.name for f in Mcp.Action.DESCRIPTOR.oneofs_by_name["kind"].fields]
        assert kinds == ["list_tools_action", "call_tool_action"]
        with Mcp(server.target) as env:
            ready = env.reset()
            assert ready.info == {"status": "ready", "message": "Echo environment ready!"}
            listing = Mcp.Action()
            listing.list_tools_action.SetInParent()
            tools = env.step(listing).observation.list_tools_observation.tools
            names = sorted(tool.name for tool in tools)
            assert names == ["echo_message", "echo_with_length", "repeat", "type_of"]
            call = Mcp.Action()
            call.call_tool_action.tool_name = "echo_with_length"
            call.call_tool_action.arguments.json = json.dumps({"message": "hi"})
            answer = env.step(call).observation.call_tool_observation
            assert answer.tool_name == "echo_with_length"
            result = json.loads(answer.result.json)
            assert result["data"] == {"message": "hi", "length": 2}
            assert not result["is_error"] and "meta" in result and "_meta" not in result
            # An int argument reaches the tool as an int (it was 5.0 as a protobuf Value).
            call.call_tool_action.tool_name = "repeat"
            call.call_tool_action.arguments.json = json.dumps({"message": "ab", "times": 3})
            answer = env.step(call).observation.call_tool_observation
            data = json.loads(answer.result.json)["data"]
            assert data == {"text": "ababab", "input_type": "int"}
            call.call_tool_action.tool_name = "type_of"  # untyped: pydantic coerces nothing
            for value, kind in ((5, "int"), (5.0, "float"), (2**70, "int"), ([1], "list")):
                call.call_tool_action.arguments.json = json.dumps({"value": value})
                answer = env.step(call).observation.call_tool_observation
                assert json.loads(answer.result.json)["data"] == kind
            assert env.state().step_count == 7


@pytest.mark.fresh_server  # OpenEnv's own uvicorn server per case: make test
@pytest.mark.parametrize(
    ("ref", "app", "reset", "actions"),
    [
        (ECHO, "echo_app", {}, [{"message": "hello"}, {"message": "a longer message"}]),
        (
            WAREHOUSE,
            "warehouse_app",
            {"seed": 3, "difficulty": 2},
            [
                {"lines": [{"item": {"sku": "bolt", "size": "large", "tags": ["x"]},
                            "quantity": 2}],
                 "note": "hi", "hints": {"a": 1.5}},
                {"lines": [{"item": {"sku": "bolt"}, "quantity": 1}], "mode": "remove"},
                {"lines": [{"item": {"sku": "nail"}}], "mode": "steal"},  # refused
                {"lines": [{"item": {"sku": "apple"}, "quantity": 2},
                           {"item": {"sku": "bolt"}, "quantity": 1},
                           {"item": {"sku": "cable"}, "quantity": 3}]},
            ],
        ),
        (
            # The env's own app (create_app names the types its step does not), served
            # with the same one command uvicorn takes.
            "support.openenv_envs.apps:board_app",
            "board_app",
            {"seed": 1, "preset": 2, "note": {"i": 1, "f": 1.0}},
            [
                {"column": 1}, {"column": 1},
                {"column": 1},  # illegal (full): an error on both servers, the game goes on
                {"column": 9},  # illegal (off the board)
                {"column": 0}, {"column": 2}, {"column": 3}, {"column": 0}, {"column": 2},
                {"column": 3}, {"column": 0}, {"column": 2}, {"column": 3},
            ],
        ),
        (
            MCP_ECHO,
            "mcp_echo_app",
            {},
            [
                {"type": "list_tools"},
                {"type": "call_tool", "tool_name": "repeat",
                 "arguments": {"message": "ab", "times": 2}},
                {"type": "call_tool", "tool_name": "echo_with_length",
                 "arguments": {"message": "hi"}},
                {"type": "call_tool", "tool_name": "type_of", "arguments": {"value": 5}},
                {"type": "call_tool", "tool_name": "no_such_tool", "arguments": {}},
            ],
        ),
    ],
)  # fmt: skip
def test_same_answers_as_openenvs_own_server(
    ref: str, app: str, reset: dict[str, Any], actions: list[dict[str, Any]]
) -> None:
    """Seed for seed, action for action, compared as JSON text (1 and 1.0 differ):
    observations (metadata included), rewards, done, and which steps were errors."""
    with openenv_server(app) as base_url:
        theirs = openenv_episode(base_url, reset, actions)
    sys.path.insert(0, str(TESTS))
    try:
        adapter = adapter_for(ref)
    finally:
        sys.path.remove(str(TESTS))
    with serving(ref) as server:
        ours = grpc_episode(adapter, server.target, reset, actions)
    assert len(ours) == len(actions) + 1
    assert differences(ours, theirs) == []
    if ref == WAREHOUSE:
        assert "error" in ours[3] and ours[-1]["done"]  # refused, then the order completed
    if ref.endswith("board_app"):
        assert [i for i, a in enumerate(ours) if "error" in a] == [3, 4]
        assert "illegal move: column 1 is full" in ours[3]["error"]
        assert ours[-1]["done"] and ours[-1]["reward"] == 0.5  # the game went on to the end
        first = ours[0]["observation"]
        assert first["seen_options"] == {"preset": 2, "note": {"i": 1, "f": 1.0}, "seed": 1}
        assert first["info"] == {} and first["stats"]["big"] == 2**60 + 1


MODULES = "support.openenv_envs.modules:LoadedModulesEnvironment"


def loaded(server: ServerProcess, *modules: str) -> list[str]:
    """Whether each module is loaded in the process of a session's env."""
    Env = described_session(server.target)
    with Env(server.target) as env:
        env.reset()
        return [env.step(Env.Action(message=name)).observation.echoed_message for name in modules]


@pytest.mark.fresh_server  # its own OpenEnv-bridged servers (seconds of imports): make test
@pytest.mark.parametrize("args", [(), ("--isolated", "1")], ids=["in-process", "isolated"])
def test_a_bridged_server_imports_openenvs_web_ui_only_when_used(args: tuple[str, ...]) -> None:
    """OpenEnv's Gradio web UI (seconds of imports) is not loaded where the env runs, in
    the server or in its env process, until something uses it: ENABLE_WEB_INTERFACE
    (OpenEnv's switch), or an app module that builds the UI itself."""
    with serving(MODULES, *args) as server:
        assert loaded(server, "gradio", "openenv.core.env_server.http_server") == [
            "absent", "loaded",
        ]  # fmt: skip
    wanted = ServerProcess(
        f"--openenv={MODULES}", list(args), {"ENABLE_WEB_INTERFACE": "1"}, pythonpath=[TESTS]
    )
    try:
        assert loaded(wanted, "gradio") == ["loaded"]
    finally:
        wanted.stop()
    with serving("support.openenv_envs.web_app:app", *args) as server:
        assert server.info().env_name == "modules"  # the app's own env and models
        # In the server the app built its UI; an env process rebuilds the env from its
        # class and never imports the app.
        expected = ["absent", "absent"] if args else ["loaded", "loaded"]
        assert loaded(server, "gradio", "support.openenv_envs.web_app") == expected


def test_a_trainer_importing_the_integration_keeps_openenvs_web_ui() -> None:
    """Only ``serve --openenv`` leaves the UI out: another process that imports the
    integration (a trainer using its client) gets OpenEnv as it is."""
    probe = (
        "import openenv_grpc.integrations.openenv, openenv.core.env_server as server; "
        "print(server.create_web_interface_app is not None)"
    )
    environ = {k: v for k, v in os.environ.items() if k != VARIABLE}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=environ, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.strip() == "True", done.stderr[-2000:]


@pytest.mark.fresh_server  # its own OpenEnv-bridged server (seconds of imports): make test
def test_isolated_workers_rebuild_the_types() -> None:
    with serving(ECHO, "--isolated", "1") as server:
        EchoEnv = described_session(server.target)
        with EchoEnv(server.target) as env:
            env.reset()
            assert env.step(EchoEnv.Action(message="abc")).observation.message_length == 3


@pytest.mark.fresh_server  # its own OpenEnv-bridged server (seconds of imports): make test
def test_isolated_workers_serve_the_envs_app_and_keep_the_episode_after_an_error() -> None:
    with serving("support.openenv_envs.apps:board_app", "--isolated", "1") as server:
        Board = described_session(server.target)
        with Board(server.target) as env:
            env.reset(seed=1)
            assert json.loads(env.step(Board.Action(column=1)).observation.last_move.json) == [2, 1]
            with pytest.raises(EnvError, match="illegal move: column 9"):
                env.step(Board.Action(column=9))
            assert json.loads(env.step(Board.Action(column=1)).observation.last_move.json) == [1, 1]


def test_reflection_serves_the_built_types() -> None:
    with serving(WAREHOUSE) as server, grpc.insecure_channel(server.target) as channel:
        info = server.info()
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        action = message_factory.GetMessageClass(pool.FindMessageTypeByName(info.action_type))
        assert "lines" in action.DESCRIPTOR.fields_by_name


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--openenv=support.openenv_envs.echo"], "takes package.module:EnvClass"),
        (["--openenv=support.openenv_envs.echo:Nope"], "has no attribute 'Nope'"),
        (["--openenv=no_such_module:Env"], "cannot import 'no_such_module'"),
        (["--openenv=support.openenv_envs.echo:EchoAction"], "is not a subclass of openenv"),
        (["echo", f"--openenv={ECHO}"], "serve takes ENV or --openenv"),
        ([f"--openenv={WAREHOUSE}", "--workers", "2"], "serve it with one worker"),
    ],
)
def test_bad_openenv_references_exit_2(
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    assert main(["serve", *args, "--port", "0"]) == 2
    assert message in capsys.readouterr().err
