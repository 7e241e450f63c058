"""The web console's server side against real processes: an env server, the console
(``openenv-grpc console``) and an HTTP/WebSocket client speaking to it as the page does.

Every error path answers with a precise code and says what is left of the session; no
env or slot leaks when sockets end, the console stops or the server refuses.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from openenv_grpc.console.session_socket import SessionSocket
from openenv_grpc.testing import ConsoleProcess
from openenv_grpc_envs.echo import EchoAction, EchoEnv

TOKEN = "console token"


@pytest.fixture
def start_console() -> Iterator[Any]:
    consoles: list[ConsoleProcess] = []

    def start(target: str, *args: str, **kwargs: Any) -> ConsoleProcess:
        console = ConsoleProcess(target, args, **kwargs)
        consoles.append(console)
        return console

    yield start
    for console in consoles:
        console.stop()


class Page:
    """What the page does: one session socket, one JSON command and answer at a time."""

    def __init__(self, http: aiohttp.ClientSession, ws: aiohttp.ClientWebSocketResponse):
        self.http = http
        self.ws = ws

    async def send(self, command: dict[str, Any] | str) -> dict[str, Any]:
        await self.ws.send_str(command if isinstance(command, str) else json.dumps(command))
        message = await self.ws.receive(timeout=60)
        assert message.type is aiohttp.WSMsgType.TEXT, message
        answer: dict[str, Any] = json.loads(message.data)
        return answer


async def page(console: ConsoleProcess) -> Page:
    http = aiohttp.ClientSession()
    ws = await http.ws_connect(console.ws_base + "api/session")
    return Page(http, ws)


async def leave(p: Page) -> None:
    await p.ws.close()
    await p.http.close()


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def test_info_describes_the_env_its_types_and_forms(server, start_console) -> None:
    console = start_console(server.target)

    async def go() -> tuple[dict[str, Any], Any]:
        async with aiohttp.ClientSession() as http, http.get(console.url + "api/info") as r:
            return await r.json(), r.headers

    info, headers = run(go())
    assert info["env"]["name"] == "echo"
    assert info["target"] == server.target
    action = info["types"]["action"]
    assert action == "openenv_grpc_envs.echo.v1.EchoAction"
    kind = info["schemas"][action]["oneofs"]
    assert kind == [{"name": "kind", "fields": ["message", "list_tools", "tool_call"]}]
    assert info["types"]["reset_options"] in info["schemas"]
    assert info["capacity"]["active_sessions"] == 0
    # Nothing but the console itself may serve the page's parts.
    assert "default-src 'self'" in headers["Content-Security-Policy"]


def test_a_session_runs_reset_step_state_and_close(server, start_console) -> None:
    console = start_console(server.target)

    async def go() -> list[dict[str, Any]]:
        p = await page(console)
        answers = [
            await p.send({"op": "open"}),
            await p.send({"op": "reset", "seed": 3, "options": {"greeting": "hi there"}}),
            await p.send({"op": "step", "action": {"message": "hello"}}),
            await p.send({"op": "state"}),
        ]
        assert server.active() == 1
        answers.append(await p.send({"op": "close"}))
        await leave(p)
        return answers

    opened, reset, step, state, closed = run(go())
    assert opened["type"] == "opened" and opened["session_id"]
    assert reset["observation"]["echoed_message"] == "hi there"
    assert step["observation"] == {"echoed_message": "hello", "message_length": 5}
    assert step["reward"] == pytest.approx(0.5)
    assert (step["step_count"], step["terminated"], step["truncated"]) == (1, False, False)
    assert state["state"]["seed"] == 3 and state["state"]["total_length"] == 5
    assert closed == {"type": "closed", "op": "close", "session": "none"}
    server.wait_until(lambda: server.active() == 0, what="session closed")
    assert server.closed_envs() == server.created() == 1


def test_bad_input_is_refused_precisely_and_the_session_survives(start_server, start_console):
    server = start_server("support.envs:FaultyEnv")
    console = start_console(server.target)

    async def go() -> dict[str, dict[str, Any]]:
        p = await page(console)
        got = {"no session": await p.send({"op": "step", "action": {"message": "x"}})}
        assert (await p.send({"op": "open"}))["type"] == "opened"
        got["open twice"] = await p.send({"op": "open"})
        got["not json"] = await p.send("{nope")
        got["no op"] = await p.send({"action": {}})
        got["unknown op"] = await p.send({"op": "fly"})
        got["before reset"] = await p.send({"op": "step", "action": {"message": "x"}})
        assert (await p.send({"op": "reset"}))["type"] == "result"
        got["wrong field type"] = await p.send({"op": "step", "action": {"message": 5}})
        got["unknown field"] = await p.send({"op": "step", "action": {"mesage": "x"}})
        got["not an object"] = await p.send({"op": "step", "action": ["x"]})
        got["bad seed"] = await p.send({"op": "reset", "seed": -1})
        got["env refuses"] = await p.send({"op": "step", "action": {"message": "invalid"}})
        got["still works"] = await p.send({"op": "step", "action": {"message": "fine"}})
        got["env raises"] = await p.send({"op": "step", "action": {"message": "raise"}})
        got["after raise"] = await p.send({"op": "reset"})
        await leave(p)
        return got

    got = run(go())

    def check(name: str, code: str, source: str, session: str, words: str) -> None:
        answer = got[name]
        assert answer["type"] == "error", (name, answer)
        assert (answer["code"], answer["source"], answer["session"]) == (code, source, session)
        assert words in answer["message"], (name, answer["message"])

    check("no session", "FAILED_PRECONDITION", "console", "none", "no session is open")
    check("open twice", "FAILED_PRECONDITION", "console", "open", "already open")
    check("not json", "INVALID_ARGUMENT", "console", "open", "not JSON")
    check("no op", "INVALID_ARGUMENT", "console", "open", '"op"')
    check("unknown op", "INVALID_ARGUMENT", "console", "open", "unknown op 'fly'")
    check("before reset", "FAILED_PRECONDITION", "server", "open", "reset")
    check("wrong field type", "INVALID_ARGUMENT", "console", "open", "EchoAction")
    check("unknown field", "INVALID_ARGUMENT", "console", "open", "mesage")
    check("not an object", "INVALID_ARGUMENT", "console", "open", "JSON object")
    check("bad seed", "INVALID_ARGUMENT", "console", "open", "seed")
    check("env refuses", "INVALID_ARGUMENT", "server", "open", "not allowed")
    assert got["still works"]["observation"]["echoed_message"] == "fine"
    check("env raises", "INTERNAL", "server", "open", "boom in step")
    assert got["env raises"]["exception_type"] == "builtins.RuntimeError"
    assert got["after raise"]["type"] == "result"
    # The socket closed without a close command: the stream ended, the env is closed.
    server.wait_until(lambda: server.active() == 0, what="session released")
    server.wait_until(lambda: server.open_envs() == 0, what="env closed")


def test_a_full_server_says_so_and_a_closed_page_frees_its_slot(start_server, start_console):
    server = start_server("support.envs:CountingEchoEnv", "--max-concurrent-envs", "1")
    console = start_console(server.target)

    async def go() -> tuple[dict[str, Any], dict[str, Any]]:
        first, second = await page(console), await page(console)
        assert (await first.send({"op": "open"}))["type"] == "opened"
        refused = await second.send({"op": "open"})
        await leave(first)  # the page closed: its session's stream ends
        server.wait_until(lambda: server.active() == 0, what="slot freed")
        admitted = await second.send({"op": "open"})
        await leave(second)
        return refused, admitted

    refused, admitted = run(go())
    assert refused["code"] == "RESOURCE_EXHAUSTED" and refused["session"] == "none"
    assert "capacity 1/1" in refused["message"]
    assert refused["retry_after"] is not None
    assert admitted["type"] == "opened"
    server.wait_until(lambda: server.active() == 0, what="second slot freed")
    assert server.closed_envs() == server.created() == 2


def test_a_session_the_server_ends_is_reported_lost_and_can_be_reopened(
    start_server, start_console
) -> None:
    server = start_server("support.envs:CountingEchoEnv", "--idle-timeout", "1")
    console = start_console(server.target)

    async def go() -> tuple[dict[str, Any], dict[str, Any]]:
        p = await page(console)
        await p.send({"op": "open"})
        await p.send({"op": "reset"})
        # The server's idle reaper ends the session: wait until its env is closed.
        await asyncio.to_thread(
            server.wait_until, lambda: server.closed_envs() == 1, what="the idle session reaped"
        )
        lost = await p.send({"op": "step", "action": {"message": "late"}})
        reopened = await p.send({"op": "open"})
        await leave(p)
        return lost, reopened

    lost, reopened = run(go())
    # The server's own status passes through: idle sessions end with DEADLINE_EXCEEDED.
    assert (lost["code"], lost["session"], lost["source"]) == (
        "DEADLINE_EXCEEDED",
        "lost",
        "server",
    )
    assert "idle" in lost["message"]
    assert reopened["type"] == "opened"


def test_websockets_from_other_origins_are_refused(server, start_console) -> None:
    console = start_console(server.target)

    async def go(origin: str) -> int:
        async with aiohttp.ClientSession() as http:
            try:
                ws = await http.ws_connect(
                    console.ws_base + "api/session", headers={"Origin": origin}
                )
            except aiohttp.WSServerHandshakeError as exc:
                return exc.status
            await ws.close()
            return 101

    assert run(go("http://evil.example")) == 403
    assert run(go(console.url.rstrip("/"))) == 101
    assert server.active() == 0


def test_live_figures_show_sessions_and_steps_per_second(server, start_console) -> None:
    console = start_console(server.target)

    def steps(stop: threading.Event) -> None:
        with EchoEnv(server.target) as env:
            env.reset()
            while not stop.is_set():
                env.step(EchoAction(message="tick"))

    async def go() -> list[dict[str, Any]]:
        readings: list[dict[str, Any]] = []
        stop = threading.Event()
        stepping = asyncio.create_task(asyncio.to_thread(steps, stop))
        url = console.ws_base + "api/live"
        try:
            async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    readings.append(json.loads((await ws.receive(timeout=10)).data))
                    if (readings[-1].get("steps_per_second") or 0) > 0:
                        break
        finally:
            stop.set()
            await stepping
        return readings

    readings = run(go())
    last = readings[-1]
    assert last["ok"] and last["active_sessions"] == 1
    assert last["steps_per_second"] > 0
    assert last["steps"] >= 20 and last["sessions_opened"] == 1


def test_tls_and_token_auth_servers_are_reached(start_server, start_console, pki: Path) -> None:
    server = start_server(
        "support.envs:CountingEchoEnv",
        "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
        extra_env={"AUTH_TOKEN": TOKEN},
    )  # fmt: skip
    console = start_console(
        server.target, "--ca", str(pki / "ca.pem"), extra_env={"AUTH_TOKEN": TOKEN}
    )

    async def go() -> dict[str, Any]:
        p = await page(console)
        await p.send({"op": "open"})
        await p.send({"op": "reset"})
        step = await p.send({"op": "step", "action": {"message": "secure"}})
        await leave(p)
        return step

    assert run(go())["observation"]["echoed_message"] == "secure"
    without_token = subprocess.run(
        [sys.executable, "-m", "openenv_grpc.cli", "console", server.target, "--port", "0",
         "--ca", str(pki / "ca.pem"), "--token-env", "NO_SUCH_VARIABLE"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert without_token.returncode == 1
    assert "UNAUTHENTICATED" in without_token.stderr


def test_an_unreachable_server_fails_the_start_clearly(start_console) -> None:
    with pytest.raises(RuntimeError, match=r"exited \(1\).*UNAVAILABLE|DEADLINE_EXCEEDED"):
        start_console("127.0.0.1:1", "--connect-timeout", "1")


def test_stopping_the_console_ends_its_sessions(server, start_console) -> None:
    console = start_console(server.target)

    async def go() -> None:
        p = await page(console)
        await p.send({"op": "open"})
        await p.send({"op": "reset"})
        assert server.active() == 1
        assert console.stop() == 0
        await p.http.close()

    run(go())
    server.wait_until(lambda: server.active() == 0, what="session ended with the console")
    assert server.closed_envs() == server.created() == 1


def test_bad_console_settings_exit_2_with_the_reason(tmp_path: Path) -> None:
    console = [sys.executable, "-m", "openenv_grpc.cli", "console", "127.0.0.1:1", "--port", "0"]
    missing_ca = subprocess.run(
        [*console, "--ca", str(tmp_path / "nope.pem")], capture_output=True, text=True, timeout=60
    )
    assert missing_ca.returncode == 2 and "nope.pem" in missing_ca.stderr
    bad_level = subprocess.run(
        console, capture_output=True, text=True, timeout=60, env={**os.environ, "LOG_LEVEL": "LOUD"}
    )
    assert bad_level.returncode == 2 and "LOUD" in bad_level.stderr


def test_live_figures_show_a_draining_server_and_then_its_absence(
    start_server, start_console
) -> None:
    server = start_server("support.envs:CountingEchoEnv", "--grace", "30")
    console = start_console(server.target)

    async def go() -> tuple[dict[str, Any], dict[str, Any]]:
        async with aiohttp.ClientSession() as http:
            p = Page(http, await http.ws_connect(console.ws_base + "api/session"))
            await p.send({"op": "open"})  # a session keeps the drain going
            async with http.ws_connect(console.ws_base + "api/live") as live:
                server.proc.send_signal(signal.SIGTERM)

                async def until(check: Any) -> dict[str, Any]:
                    while True:
                        reading: dict[str, Any] = json.loads((await live.receive(30)).data)
                        if check(reading):
                            return reading

                draining = await until(lambda r: r.get("draining"))
                refused = await Page(
                    http, await http.ws_connect(console.ws_base + "api/session")
                ).send({"op": "open"})
                await p.send({"op": "close"})  # the last session ends: the server exits
                gone = await until(lambda r: not r["ok"])
                return draining | {"refused": refused}, gone

    draining, gone = run(go())
    assert draining["ok"] and draining["active_sessions"] == 1
    assert draining["refused"]["code"] == "UNAVAILABLE"
    assert "draining" in draining["refused"]["message"]
    assert gone["code"] == "UNAVAILABLE"
    assert server.proc.wait(30) == 0


def test_a_slow_answer_times_out_and_the_session_goes_on(start_server, start_console) -> None:
    server = start_server("support.envs:FaultyEnv")
    console = start_console(server.target, "--call-timeout", "0.3")

    async def go() -> tuple[dict[str, Any], dict[str, Any]]:
        p = await page(console)
        await p.send({"op": "open"})
        await p.send({"op": "reset"})
        slow = await p.send({"op": "step", "action": {"message": "sleep:1"}})
        await asyncio.sleep(1.0)  # the slow step finishes on the server meanwhile
        # Its late answer is dropped; this step gets its own.
        after = await p.send({"op": "step", "action": {"message": "after"}})
        await leave(p)
        return slow, after

    slow, after = run(go())
    assert (slow["code"], slow["session"]) == ("DEADLINE_EXCEEDED", "open")
    assert "no answer within 0.3s" in slow["message"]
    assert after.get("type") == "result", after
    assert after["observation"]["echoed_message"] == "after"
    assert after["step_count"] == 2


def test_a_console_fault_is_reported_as_internal_and_the_socket_goes_on() -> None:
    """A bug below the console (here a stub that raises) answers INTERNAL, not a crash."""

    class BrokenStub:
        def Session(self, **kwargs: Any) -> Any:
            raise RuntimeError("wires crossed")

    class Target:
        stub = BrokenStub()
        token = None
        call_timeout = None

    socket = SessionSocket(Target())  # type: ignore[arg-type]
    answer = run(socket.answer(json.dumps({"op": "open"})))
    assert (answer["code"], answer["source"], answer["session"]) == ("INTERNAL", "console", "none")
    assert "wires crossed" in answer["message"]
    again = run(socket.answer(json.dumps({"op": "state"})))
    assert again["code"] == "FAILED_PRECONDITION"  # still answering


def test_without_the_console_extra_the_command_says_how_to_get_it(tmp_path: Path) -> None:
    blocker = tmp_path / "aiohttp"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('aiohttp is not installed')\n")
    done = subprocess.run(
        [sys.executable, "-m", "openenv_grpc.cli", "console", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 2
    assert "pip install 'openenv-grpc[console]'" in done.stderr


def test_a_step_without_reward_shows_none_not_0(start_server, start_console) -> None:
    """An OpenEnv env's reward None (``no_reward``) reaches the page as null; a real 0
    stays 0."""
    server = start_server("--openenv=support.openenv_envs.scored:ScoreEnvironment")
    console = start_console(server.target)

    async def go() -> list[dict[str, Any]]:
        p = await page(console)
        await p.send({"op": "open"})
        answers = [
            await p.send({"op": "reset"}),
            await p.send({"op": "step", "action": {}}),
            await p.send({"op": "step", "action": {"score": 0.0}}),
        ]
        await p.send({"op": "close"})
        await leave(p)
        return answers

    reset, none, zero = run(go())
    assert (reset["reward"], none["reward"], zero["reward"]) == (None, None, 0.0)
