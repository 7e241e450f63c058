"""OpenEnv's own clients against ``openenv-grpc serve ... --openenv-port PORT`` (issue 21,
item 4): the ``openenv`` package's ``GenericEnvClient`` (sync and async) talks to a real
serve process, for a native env (echo) and bridged OpenEnv envs, on the same sessions,
capacity, auth and Info counters as gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets
from openenv.core.generic_client import GenericEnvClient
from openenv.core.mcp_client import MCPToolClient

from openenv_grpc import CapacityError
from openenv_grpc.client.info import fetch_info
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.echo import EchoEnv

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
from test_openenv_bridge import openenv_server  # noqa: E402  (OpenEnv's own uvicorn)

GATEWAY = re.compile(r"OpenEnv protocol on (http://\S+)")
BRIDGED_ECHO = "--openenv=support.openenv_envs.echo:EchoEnvironment"
WAREHOUSE = "--openenv=support.openenv_envs.warehouse:WarehouseEnvironment"
#: Seconds a test's sessions get to end on the server after the test; then it leaked them.
LEAK_AFTER = 30.0


def gateway_url(server: ServerProcess) -> str:
    """The OpenEnv URL the serve process printed once its gateway listened."""
    for _ in range(1200):  # bounded wait for the line, not a speed assertion
        for line in server.stdout_lines:
            match = GATEWAY.search(line)
            if match:
                return match.group(1)
        if server.proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"no gateway line; stderr:\n{server.stderr()}")


#: The module's servers, one per (env, args, extra environment), shared by its tests.
_SERVERS: dict[tuple[str, ...], tuple[ServerProcess, str]] = {}


@pytest.fixture(scope="module", autouse=True)
def _stop_the_modules_servers() -> Iterator[None]:
    yield
    while _SERVERS:
        _SERVERS.popitem()[1][0].stop()


@contextlib.contextmanager
def serving(
    env: str, *args: str, extra_env: dict[str, str] | None = None
) -> Iterator[tuple[ServerProcess, str]]:
    """The module's one server (and its gateway URL) for these settings, started on first
    use. A test gets it with no session open (counters are the server's since its start:
    tests compare them with what they read first). A test that leaves a session open
    fails, naming the leak; the server is stopped, so the next test starts another and
    does not inherit the leaked session (nor fail for it). A test that fails has its
    server stopped too."""
    key = (env, *args, *sorted(f"{k}={v}" for k, v in (extra_env or {}).items()))
    shared = _SERVERS.get(key)
    if shared is None or shared[0].proc.poll() is not None:
        server = ServerProcess(
            env, ["--openenv-port", "0", *args], extra_env=extra_env, pythonpath=[TESTS]
        )
        shared = _SERVERS[key] = (server, gateway_url(server))
    server = shared[0]
    try:
        yield shared
    except BaseException:
        _SERVERS.pop(key)[0].stop()
        raise
    token = (extra_env or {}).get("AUTH_TOKEN")
    try:
        # A session the client closed ends on the server a moment later: wait for that,
        # with a deadline only as a hang guard.
        deadline = time.monotonic() + LEAK_AFTER
        while (left := fetch_info(server.target, token=token).capacity.active_sessions) > 0:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"session leak: {left} session(s) still open on the shared server "
                    f"{' '.join(key)!r} {LEAK_AFTER:g}s after the test ended (a test "
                    "closes every session it opens, gRPC or OpenEnv's)"
                )
            time.sleep(0.05)
    except BaseException:
        _SERVERS.pop(key)[0].stop()
        raise


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    for _ in range(600):
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


def test_generic_client_sync_against_a_native_env() -> None:
    with serving("echo") as (server, url):
        before = server.info().activity
        with GenericEnvClient(base_url=url).sync() as env:
            first = env.reset(seed=1)
            assert first.observation["echoed_message"] == "ready" and first.done is False
            step = env.step({"message": "hello"})
            assert step.observation == {
                "echoed_message": "hello",
                "message_length": 5,
                "tool_result": None,
                "metadata": {},
            }
            assert isinstance(step.observation["message_length"], int)
            assert step.reward == pytest.approx(0.5)
            state = env.state()
            assert state["step_count"] == 1 and state["history"] == ["hello"]
            assert server.active() == 1  # one WebSocket = one gRPC session
            # A bad action is OpenEnv's VALIDATION_ERROR, and the session goes on.
            with pytest.raises(
                RuntimeError, match=r"action\.nope: no such field.*VALIDATION_ERROR"
            ):
                env.step({"nope": 1})
            with pytest.raises(RuntimeError, match=r"expected a string, got int.*VALIDATION_ERROR"):
                env.step({"message": 5})
            with pytest.raises(RuntimeError, match=r"seed must be an int from 0 to 2\*\*64-1"):
                env.reset(seed="abc")
            assert env.step({"message": "on"}).observation["echoed_message"] == "on"
            assert env.state()["step_count"] == 2
        wait_for(lambda: server.active() == 0, "the session closed with the client")
        activity = server.info().activity
        assert activity.sessions_opened - before.sessions_opened == 1  # counted as gRPC's
        assert activity.steps - before.steps == 2


def test_generic_client_async_many_sessions_at_once() -> None:
    async def play(url: str, i: int) -> tuple[str, int]:
        async with GenericEnvClient(base_url=url) as env:
            await env.reset(seed=i)
            for k in range(3):
                result = await env.step({"message": f"{i}-{k}"})
            state = await env.state()
            return result.observation["echoed_message"], state["step_count"]

    async def main(url: str) -> list[tuple[str, int]]:
        return await asyncio.gather(*(play(url, i) for i in range(4)))

    with serving("echo") as (server, url):
        opened = server.info().activity.sessions_opened
        assert asyncio.run(main(url)) == [(f"{i}-2", 3) for i in range(4)]
        wait_for(lambda: server.active() == 0, "every session closed")
        assert server.info().activity.sessions_opened - opened == 4


def _exchange(url: str, calls: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    with GenericEnvClient(base_url=url).sync() as env:
        out = []
        for kind, data in calls:
            result = env.reset(**data) if kind == "reset" else env.step(data)
            out.append(
                {"observation": result.observation, "reward": result.reward, "done": result.done}
            )
        out.append({"step_count": env.state()["step_count"]})
        return out


@pytest.mark.fresh_server  # OpenEnv's own uvicorn server and a bridged one: make test
def test_a_bridged_env_answers_exactly_what_openenv_answers() -> None:
    calls: list[tuple[str, Any]] = [
        ("reset", {"seed": 3}),
        ("step", {"message": "hello"}),
        ("step", {"message": "a much longer message"}),
        ("step", {"message": ""}),
    ]
    with openenv_server("echo_app") as theirs:
        expected = _exchange(theirs, calls)
    with serving(BRIDGED_ECHO) as (server, url):
        assert _exchange(url, calls) == expected
        wait_for(lambda: server.active() == 0, "the session closed")


@pytest.mark.fresh_server  # its own OpenEnv-bridged server (seconds of imports): make test
def test_a_bridged_env_with_reset_kwargs_nested_models_and_maps() -> None:
    with serving(WAREHOUSE) as (_server, url), GenericEnvClient(base_url=url).sync() as env:
        first = env.reset(seed=1, difficulty=2)
        missing = first.observation["missing"]
        assert len(missing) == 3 and first.observation["counts"] == {}
        step = env.step({"lines": [{"item": {"sku": missing[0]}, "quantity": 2}]})
        assert step.observation["counts"] == {missing[0]: 2}
        assert isinstance(step.observation["counts"][missing[0]], int)
        with pytest.raises(RuntimeError, match="VALIDATION_ERROR"):
            env.step({"lines": "apple"})
        with pytest.raises(RuntimeError, match=r"reset\.no_such: no such field"):
            env.reset(no_such=1)  # OpenEnv drops it silently; we say so
        assert env.state()["difficulty"] == 2  # the session survived both


def test_capacity_refusal_is_openenv_s_capacity_error_and_shared_with_grpc() -> None:
    with serving("echo", "--max-concurrent-envs", "1") as (server, url):
        holder = EchoEnv(server.target)
        holder.open()  # a gRPC session takes the only slot
        try:
            with pytest.raises(RuntimeError, match=r"Server at capacity: 1/1.*CAPACITY_REACHED"):
                GenericEnvClient(base_url=url).sync().reset()
        finally:
            holder.close()
        wait_for(lambda: server.active() == 0, "the gRPC slot freed")
        with GenericEnvClient(base_url=url).sync() as env:
            env.reset()
            with pytest.raises(CapacityError):  # and the reverse: gRPC finds it full
                EchoEnv(server.target).open()
            step = env.step({"message": "still mine"})
            assert step.observation["echoed_message"] == "still mine"


@pytest.mark.fresh_server  # a server of its own: make test
def test_the_auth_token_is_the_grpc_one() -> None:
    token = "gateway-secret-token"
    with serving("echo", extra_env={"AUTH_TOKEN": token}) as (_server, url):
        with pytest.raises(RuntimeError, match=r"UNAUTHENTICATED.*SESSION_ERROR"):
            GenericEnvClient(base_url=url).sync().reset()
        with pytest.raises(RuntimeError, match="UNAUTHENTICATED"):
            GenericEnvClient(base_url=url, headers={"Authorization": "Bearer wrong"}).sync().reset()
        headers = {"Authorization": f"Bearer {token}"}
        with GenericEnvClient(base_url=url, headers=headers).sync() as env:
            env.reset()
            assert env.step({"message": "in"}).observation["echoed_message"] == "in"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{url}/schema", timeout=30)
        assert refused.value.code == 401
        request = urllib.request.Request(f"{url}/schema", headers=headers)
        schema = json.load(urllib.request.urlopen(request, timeout=30))
        assert "message" in schema["action"]["properties"]
        assert json.load(urllib.request.urlopen(f"{url}/health", timeout=30)) == {
            "status": "healthy"
        }


def test_a_client_that_vanishes_frees_its_session() -> None:
    async def vanish(ws_url: str) -> None:
        socket_ = await websockets.connect(ws_url)
        await socket_.send(json.dumps({"type": "reset", "data": {}}))
        assert json.loads(await socket_.recv())["type"] == "observation"
        socket_.transport.abort()  # no close frame: the TCP connection just goes

    with serving("echo") as (server, url):
        opened = server.info().activity.sessions_opened
        asyncio.run(vanish(url.replace("http://", "ws://") + "/ws"))
        wait_for(lambda: server.active() == 0, "the vanished client's session closed")
        assert server.info().activity.sessions_opened - opened == 1


def test_frames_that_are_not_json_or_of_no_known_type_get_openenv_errors() -> None:
    async def talk(ws_url: str) -> list[dict[str, Any]]:
        async with websockets.connect(ws_url) as ws:
            answers = []
            for frame in ("not json", json.dumps({"type": "dance"}), json.dumps({"type": "reset"})):
                await ws.send(frame)
                answers.append(json.loads(await ws.recv()))
            await ws.send(json.dumps({"type": "step", "data": {"message": "x"}}))
            answers.append(json.loads(await ws.recv()))
            await ws.send(json.dumps({"type": "close"}))
            return answers

    with serving("echo") as (server, url):
        bad_json, unknown, reset, step = asyncio.run(talk(url.replace("http://", "ws://") + "/ws"))
        assert bad_json["type"] == "error" and bad_json["data"]["code"] == "INVALID_JSON"
        assert unknown["data"] == {"message": "Unknown message type: dance", "code": "UNKNOWN_TYPE"}
        assert (
            reset["type"] == "observation" and step["data"]["observation"]["echoed_message"] == "x"
        )
        wait_for(lambda: server.active() == 0, "closed by the close frame")


@pytest.mark.fresh_server  # a server of its own: make test
def test_isolated_envs_work_and_several_workers_are_refused() -> None:
    with (
        serving("echo", "--isolated", "1") as (_server, url),
        GenericEnvClient(base_url=url).sync() as env,
    ):
        env.reset()
        assert env.step({"message": "iso"}).observation["echoed_message"] == "iso"
    done = subprocess.run(
        [sys.executable, "-m", "openenv_grpc", "serve", "echo", "--port", "0",
         "--workers", "2", "--openenv-port", "0"],
        capture_output=True, text=True, timeout=120, env={**os.environ},
    )  # fmt: skip
    assert done.returncode == 1
    assert "--openenv-port serves from one process: use --workers 1" in done.stderr


@pytest.mark.fresh_server  # a server of its own: make test
def test_a_taken_openenv_port_ends_the_server() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "openenv_grpc", "serve", "echo", "--port", "0",
             "--openenv-port", str(port)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port} (--openenv-port)" in done.stderr


MCP_ECHO = "--openenv=support.openenv_envs.mcp_echo:EchoMCPEnvironment"


async def _mcp_session(url: str) -> dict[str, Any]:
    """What OpenEnv's MCPToolClient (production mode: HTTP /mcp plus /ws?session_id=)
    sees of an echo-like MCP env."""
    async with MCPToolClient(base_url=url) as client:
        tools = sorted(tool.name for tool in await client.list_tools())
        reset = await client.reset()
        calls = {}
        if "echo_message" in tools:
            calls["echo_message"] = await client.call_tool("echo_message", message="hi")
            calls["echo_with_length"] = await client.call_tool("echo_with_length", message="hey")
        else:
            calls["reverse"] = await client.call_tool("reverse", message="hello")
        return {"tools": tools, "reset_done": reset.done, "calls": calls}


@pytest.mark.fresh_server  # OpenEnv's own uvicorn server and a bridged one: make test
def test_mcp_tool_client_against_a_bridged_mcp_env_answers_as_openenv() -> None:
    with openenv_server("mcp_echo_app") as theirs:
        expected = asyncio.run(_mcp_session(theirs))
    with serving(MCP_ECHO) as (server, url):
        opened = server.info().activity.sessions_opened
        assert asyncio.run(_mcp_session(url)) == expected
        assert expected["calls"]["echo_message"] == "hi"
        wait_for(lambda: server.active() == 0, "session/close freed the slot")
        # HTTP /mcp and /ws: one session
        assert server.info().activity.sessions_opened - opened == 1


def test_mcp_tool_client_against_a_native_tools_env() -> None:
    with serving("echo") as (server, url):
        seen = asyncio.run(_mcp_session(url))
        assert seen == {
            "tools": ["count", "history", "reverse"],
            "reset_done": False,
            "calls": {"reverse": "olleh"},
        }
        wait_for(lambda: server.active() == 0, "session/close freed the slot")


def test_mcp_sessions_share_the_capacity_and_refuse_in_openenv_s_words() -> None:
    with serving("echo", "--max-concurrent-envs", "1") as (server, url):
        holder = EchoEnv(server.target)
        holder.open()
        try:
            with pytest.raises(
                RuntimeError, match="Failed to create MCP session: Server at capacity"
            ):
                asyncio.run(_mcp_session(url))
        finally:
            holder.close()
        wait_for(lambda: server.active() == 0, "nothing left open by the refusal")
        assert asyncio.run(_mcp_session(url))["calls"] == {"reverse": "olleh"}
