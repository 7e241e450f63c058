"""The OpenEnv door's sessions are Session streams of the core (``streams.py``): what a
``/ws`` socket's own wire (``SocketWire``) promises beyond OpenEnv's frames, on real
serve processes with a raw WebSocket client: one answer in flight per socket (frames
sent back to back are answered in order), a frame needing several requests of the core,
a close frame's close, the core ending a stream while the client waits (an error frame)
and while it does not (a close frame only, nothing it could take for an answer)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from openenv_grpc.testing import ServerProcess

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
from test_openenv_gateway import gateway_url  # noqa: E402

from support.procs import env_processes  # noqa: E402


@contextlib.contextmanager
def door(*args: str) -> Iterator[tuple[ServerProcess, str]]:
    server = ServerProcess("echo", ["--openenv-port", "0", *args], pythonpath=[TESTS])
    try:
        yield server, gateway_url(server).replace("http://", "ws://") + "/ws"
    finally:
        server.stop()


def _step(message: str) -> str:
    return json.dumps({"type": "step", "data": {"message": message}})


@pytest.mark.fresh_server  # a server of its own: make test
def test_frames_sent_back_to_back_are_answered_each_in_turn() -> None:
    """Twenty steps written at once, the first before any reset (two requests of the
    core: a reset, then the step): twenty observations, in order, steps 1 to 20."""

    async def run(url: str) -> list[dict[str, Any]]:
        async with websockets.connect(url) as ws:
            for k in range(20):
                await ws.send(_step(f"m{k}"))
            answers = [json.loads(await ws.recv()) for _ in range(20)]
            await ws.send(json.dumps({"type": "state"}))
            answers.append(json.loads(await ws.recv()))
            return answers

    with door() as (_server, url):
        answers = asyncio.run(run(url))
    echoed = [a["data"]["observation"]["echoed_message"] for a in answers[:20]]
    assert echoed == [f"m{k}" for k in range(20)]
    state = answers[20]
    assert state["type"] == "state"
    assert state["data"]["step_count"] == 20
    assert state["data"]["history"] == [f"m{k}" for k in range(20)]
    assert state["data"]["episode_id"]  # the reset the first step made


@pytest.mark.fresh_server  # a server of its own: make test
def test_a_close_frame_closes_the_env_then_the_socket_with_1000() -> None:
    async def run(url: str) -> int | None:
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"type": "reset", "data": {}}))
            await ws.recv()
            await ws.send(json.dumps({"type": "close"}))
            with pytest.raises(websockets.ConnectionClosedOK):
                await ws.recv()  # no answer to a close: the close frame
            return ws.close_code

    with door() as (server, url):
        opened = server.info().activity.sessions_opened
        assert asyncio.run(run(url)) == 1000
        server.wait_until(lambda: server.active() == 0, what="the env closed")
        assert server.info().activity.sessions_opened == opened + 1


@pytest.mark.fresh_server  # a server of its own: make test
def test_a_drain_closes_an_idle_socket_with_no_frame_before_the_close() -> None:
    """The drain ends the stream of a socket that waits for nothing: the client gets the
    close frame (1012) and no error frame it would read as its next answer."""

    async def run(url: str, server: ServerProcess) -> tuple[list[str], int | None]:
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"type": "reset", "data": {}}))
            await ws.recv()
            server.proc.send_signal(signal.SIGTERM)
            frames: list[str] = []
            with contextlib.suppress(websockets.ConnectionClosed):
                while True:
                    frames.append(str(await ws.recv()))
            return frames, ws.close_code

    with door("--grace", "1") as (server, url):
        frames, code = asyncio.run(run(url, server))
        assert server.proc.wait(30) == 0
    assert frames == []
    assert code == 1012


@pytest.mark.fresh_server  # a server of its own: make test
def test_a_session_lost_under_a_frame_answers_that_frame_then_closes() -> None:
    """``--isolated``: the env process of a socket's session is killed; the socket's next
    frame is answered with the core's own words (UNAVAILABLE, session lost) and the
    socket closes; the slot is free again."""

    async def run(url: str, server: ServerProcess) -> tuple[dict[str, Any], int | None]:
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"type": "reset", "data": {}}))
            await ws.recv()
            for pid in env_processes(server.proc.pid):
                os.kill(pid, signal.SIGKILL)
            await ws.send(_step("x"))
            answer = json.loads(await ws.recv())
            with contextlib.suppress(websockets.ConnectionClosed):
                await ws.recv()
            return answer, ws.close_code

    with door("--isolated", "1") as (server, url):
        server.wait_until(lambda: bool(env_processes(server.proc.pid)), what="env process")
        answer, code = asyncio.run(run(url, server))
        server.wait_until(lambda: server.active() == 0, what="the slot freed")
    assert answer["type"] == "error"
    assert answer["data"]["code"] == "SESSION_ERROR"
    assert answer["data"]["message"].startswith("UNAVAILABLE: session lost")
    assert code == 1000


@pytest.mark.fresh_server  # a server of its own: make test
def test_an_http_step_whose_client_goes_mid_call_frees_its_session(tmp_path: Path) -> None:
    """``POST /step`` is a stream of its own (``ProgramStream``): its client hangs up while
    the env is inside the step; the step ends, the stream closes, the slot is free, and
    the next call is answered."""
    import socket
    import urllib.request

    gate = tmp_path / "gate"
    server = ServerProcess("support.envs:FaultyEnv", ["--openenv-port", "0"], pythonpath=[TESTS])
    try:
        url = gateway_url(server)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        body = json.dumps({"action": {"message": f"gate:{gate}"}}).encode()
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(
                b"POST /step HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            server.wait_until(
                lambda: gate.with_name("gate.entered").exists(), 30, "the step is inside"
            )
            assert server.active() == 1
        gate.touch()  # the client has gone; the step may end now
        server.wait_until(lambda: server.active() == 0, 30, "the slot freed")
        request = urllib.request.Request(
            f"{url}/step", json.dumps({"action": {"message": "hi"}}).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=60) as answer:
            assert json.load(answer)["observation"]["echoed_message"] == "hi"
    finally:
        server.stop()


@pytest.mark.fresh_server  # a server of its own: make test
def test_an_http_step_whose_env_process_dies_is_a_500_naming_the_lost_session() -> None:
    """``--isolated``: the env process dies inside ``POST /step`` (``exit``). The core ends
    the call's stream; the answer is 500 with the core's own words, the slot is free,
    and the next call is answered by a fresh env process."""
    import urllib.error
    import urllib.request

    server = ServerProcess(
        "support.envs:FaultyEnv", ["--openenv-port", "0", "--isolated", "1"], pythonpath=[TESTS]
    )

    def step(message: str) -> tuple[int, dict[str, Any]]:
        request = urllib.request.Request(
            f"{url}/step", json.dumps({"action": {"message": message}}).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                return answer.status, json.load(answer)
        except urllib.error.HTTPError as failed:
            return failed.code, json.load(failed)

    try:
        url = gateway_url(server)
        status, body = step("exit")
        assert status == 500
        assert body["detail"].startswith("UNAVAILABLE: session lost")
        server.wait_until(lambda: server.active() == 0, 30, "the slot freed")
        server.wait_until(lambda: step("hi")[0] == 200, 60, "a fresh env process answers")
        assert step("hi")[1]["observation"]["echoed_message"] == "hi"
    finally:
        server.stop()


@pytest.mark.fresh_server  # a server of its own: make test
def test_frames_the_wire_answers_itself_count_as_the_clients_activity() -> None:
    """``--idle-timeout 1``: a client sending only frames no env call answers (an unknown
    type: an error frame) for 3 s keeps its socket, each answered; once it stops, the
    idle timeout closes the socket (1001), a timeout after its last answer."""

    async def run(url: str) -> tuple[list[str], int | None, float]:
        async with websockets.connect(url) as ws:
            codes = []
            loop = asyncio.get_running_loop()
            until = loop.time() + 3.0
            while loop.time() < until:
                await ws.send(json.dumps({"type": "nonsense"}))
                codes.append(json.loads(await asyncio.wait_for(ws.recv(), 30))["data"]["code"])
                quiet = loop.time()  # the last answer: the session waits from here
                await asyncio.sleep(0.25)
            with contextlib.suppress(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 30)
            return codes, ws.close_code, loop.time() - quiet

    with door("--idle-timeout", "1") as (server, url):
        codes, code, quiet = asyncio.run(run(url))
        server.wait_until(lambda: server.active() == 0, what="the env closed")
    assert len(codes) >= 8
    assert set(codes) == {"UNKNOWN_TYPE"}
    assert code == 1001
    assert quiet >= 0.95  # closed for the silence after the frames, not before


@pytest.mark.fresh_server  # a server of its own: make test
def test_closing_a_busy_held_session_answers_at_once_and_its_step_completes(
    tmp_path: Path,
) -> None:
    """``--idle-timeout 1``: a socket's mcp ``openenv/session/close`` of a held session
    busy in a step (gated, ~3 s) is answered at once, not after the step (the closer
    never waits on another session: two sockets closing each other's sessions
    deadlocked); the step still ends with its observation, then the session closes, and
    every slot is free. (Before the wire's own clock, the closer's 3 s wait ended its
    stream at the idle timeout.)"""
    import urllib.request

    gate = tmp_path / "gate"
    server = ServerProcess(
        "support.envs:FaultyEnv", ["--openenv-port", "0", "--idle-timeout", "1"],
        pythonpath=[TESTS],
    )  # fmt: skip

    def rpc(method: str, params: dict[str, Any]) -> Any:
        body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
        request = urllib.request.Request(
            f"{url}/mcp", body.encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.load(answer)

    async def run(ws_url: str, held: str) -> tuple[dict[str, Any], dict[str, Any]]:
        async with (
            websockets.connect(f"{ws_url}?session_id={held}") as busy,
            websockets.connect(ws_url) as closer,
        ):
            await busy.send(_step(f"gate:{gate}"))
            server.wait_until(lambda: gate.with_name("gate.entered").exists(), 30, "in step")
            close = {"jsonrpc": "2.0", "id": 7, "method": "openenv/session/close",
                     "params": {"session_id": held}}  # fmt: skip
            await closer.send(json.dumps({"type": "mcp", "data": close}))
            # The step goes on past twice the idle timeout.
            asyncio.get_running_loop().call_later(3.0, gate.touch)
            answer = json.loads(await asyncio.wait_for(closer.recv(), 30))
            stepped = json.loads(await asyncio.wait_for(busy.recv(), 30))
            return answer, stepped

    try:
        url = gateway_url(server)
        held = rpc("openenv/session/create", {})["result"]["session_id"]
        answer, stepped = asyncio.run(run(url.replace("http://", "ws://") + "/ws", held))
        server.wait_until(lambda: server.active() == 0, 30, "every env closed")
    finally:
        server.stop()
    closed = {"jsonrpc": "2.0", "id": 7, "result": {"session_id": held, "closed": True}}
    assert answer == {"type": "mcp", "data": closed}
    assert stepped["type"] == "observation"


@pytest.mark.fresh_server  # a server of its own: make test
def test_a_socket_attached_to_a_held_session_hears_how_its_session_was_lost() -> None:
    """``--isolated``: the env process of a held session dies under a step sent on a
    socket attached to it (``exit``): that socket, waiting for the answer, gets the
    core's words (``SESSION_ERROR`` UNAVAILABLE, session lost) before its close, as a
    socket of its own session does; the slot is free."""
    import urllib.request

    server = ServerProcess(
        "support.envs:FaultyEnv", ["--openenv-port", "0", "--isolated", "1"], pythonpath=[TESTS]
    )

    async def run(ws_url: str, held: str) -> tuple[dict[str, Any], int | None]:
        async with websockets.connect(f"{ws_url}?session_id={held}") as ws:
            await ws.send(_step("exit"))
            answer = json.loads(await asyncio.wait_for(ws.recv(), 60))
            with contextlib.suppress(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 30)
            return answer, ws.close_code

    try:
        url = gateway_url(server)
        body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "openenv/session/create"})
        request = urllib.request.Request(
            f"{url}/mcp", body.encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as made:
            held = json.load(made)["result"]["session_id"]
        answer, code = asyncio.run(run(url.replace("http://", "ws://") + "/ws", held))
        server.wait_until(lambda: server.active() == 0, 30, "the slot freed")
    finally:
        server.stop()
    assert answer["type"] == "error"
    assert answer["data"]["code"] == "SESSION_ERROR"
    assert answer["data"]["message"].startswith("UNAVAILABLE: session lost")
    assert code == 1000


def _held_session(url: str) -> str:
    import urllib.request

    request = urllib.request.Request(
        f"{url}/mcp",
        json.dumps({"jsonrpc": "2.0", "id": 1, "method": "openenv/session/create"}).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        return str(json.load(answer)["result"]["session_id"])


@pytest.mark.fresh_server  # a server of its own: make test
def test_a_drain_tells_a_caller_inside_an_http_step_at_the_grace_not_after_the_step(
    tmp_path: Path,
) -> None:
    """``POST /step`` is inside a gated step when the server drains (``--grace 1``); the
    gate opens only 4 s later. The caller is answered at the grace's end with the core's
    words (500, UNAVAILABLE, draining), before the step has ended. (A drain's notice
    written to the call's stream once took the call's place: its caller waited for the
    step, then got a bare 500.)"""
    import signal
    import threading
    import urllib.error
    import urllib.request

    gate = tmp_path / "gate"
    server = ServerProcess(
        "support.envs:FaultyEnv", ["--openenv-port", "0", "--grace", "1"], pythonpath=[TESTS]
    )
    answered: dict[str, Any] = {}
    try:
        url = gateway_url(server)

        def call() -> None:
            request = urllib.request.Request(
                f"{url}/step", json.dumps({"action": {"message": f"gate:{gate}"}}).encode(),
                {"Content-Type": "application/json"},
            )  # fmt: skip
            try:
                urllib.request.urlopen(request, timeout=60)
            except urllib.error.HTTPError as failed:
                answered["status"], answered["body"] = failed.code, json.load(failed)
            answered["gate open"] = gate.exists()

        caller = threading.Thread(target=call)
        caller.start()
        server.wait_until(lambda: gate.with_name("gate.entered").exists(), 30, "in the step")
        server.proc.send_signal(signal.SIGTERM)
        opener = threading.Timer(4.0, gate.touch)
        opener.start()
        caller.join(60)
        opener.join()
        server.proc.wait(60)
    finally:
        server.stop()
    assert answered["status"] == 500
    assert answered["body"]["detail"].startswith("UNAVAILABLE: server is draining")
    assert answered["gate open"] is False


@pytest.mark.fresh_server  # a server of its own: make test
def test_a_drain_tells_a_socket_attached_to_a_held_session_under_a_frame(
    tmp_path: Path,
) -> None:
    """A socket on a held ``/mcp`` session waits on a gated step when the server drains:
    it gets the SESSION_ERROR frame naming the drain, then the close 1012, before the
    step ends."""
    import signal

    gate = tmp_path / "gate"
    server = ServerProcess(
        "support.envs:FaultyEnv", ["--openenv-port", "0", "--grace", "1"], pythonpath=[TESTS]
    )

    async def run(url: str) -> tuple[list[dict[str, Any]], int | None, bool]:
        ws_url = url.replace("http://", "ws://") + f"/ws?session_id={_held_session(url)}"
        async with websockets.connect(ws_url) as ws:
            await ws.send(_step(f"gate:{gate}"))
            entered = gate.with_name("gate.entered")
            await asyncio.to_thread(server.wait_until, entered.exists, 30, "in the step")
            server.proc.send_signal(signal.SIGTERM)
            asyncio.get_running_loop().call_later(4.0, gate.touch)
            frames = []
            with contextlib.suppress(websockets.ConnectionClosed):
                while True:
                    frames.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
            return frames, ws.close_code, gate.exists()

    try:
        frames, code, gate_open = asyncio.run(run(gateway_url(server)))
        server.proc.wait(60)
    finally:
        server.stop()
    assert [f["data"]["code"] for f in frames] == ["SESSION_ERROR"]
    assert "draining" in frames[0]["data"]["message"]
    assert code == 1012 and gate_open is False


@pytest.mark.fresh_server  # a server of its own: make test
def test_an_answer_over_the_message_limit_is_refused_on_a_held_session_too() -> None:
    """``--max-message-bytes 100000``: a state of three 60,000-character steps is over the
    limit on a socket attached to a held session as on a socket of its own: an
    EXECUTION_ERROR naming the limit, and the session goes on."""
    server = ServerProcess(
        "echo", ["--openenv-port", "0", "--max-message-bytes", "100000"], pythonpath=[TESTS]
    )

    async def run(ws_url: str) -> list[dict[str, Any]]:
        async with websockets.connect(ws_url, max_size=None) as ws:
            answers = []
            for frame in [
                {"type": "reset", "data": {}},
                *[{"type": "step", "data": {"message": "y" * 60_000}}] * 3,
                {"type": "state"},
                {"type": "step", "data": {"message": "small"}},
            ]:
                await ws.send(json.dumps(frame))
                answers.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
            return answers

    try:
        url = gateway_url(server)
        base = url.replace("http://", "ws://") + "/ws"
        for ws_url in (base, f"{base}?session_id={_held_session(url)}"):
            answers = asyncio.run(run(ws_url))
            refusal = answers[4]
            assert refusal["type"] == "error" and refusal["data"]["code"] == "EXECUTION_ERROR"
            assert "over the server's message limit of 100000 bytes" in refusal["data"]["message"]
            assert answers[5]["type"] == "observation"
    finally:
        server.stop()


@pytest.mark.fresh_server  # a server of its own: make test
def test_a_close_frame_whose_env_close_raises_ends_the_socket_and_frees_the_slot() -> None:
    """The env's ``close`` raises on a socket's ``close`` frame: the socket still closes
    normally (1000), the slot is free (capacity 1: a second socket then steps)."""
    server = ServerProcess(
        "support.envs:RaisingCloseEnv",
        ["--openenv-port", "0", "--max-concurrent-envs", "1"],
        pythonpath=[TESTS],
    )

    async def run(url: str) -> tuple[int | None, dict[str, Any]]:
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"type": "reset", "data": {}}))
            await ws.recv()
            await ws.send(json.dumps({"type": "close"}))
            with contextlib.suppress(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 30)
        code = ws.close_code
        await asyncio.to_thread(server.wait_until, lambda: server.active() == 0, 30, "freed")
        async with websockets.connect(url) as again:
            await again.send(_step("after"))
            return code, json.loads(await asyncio.wait_for(again.recv(), 30))

    try:
        code, answer = asyncio.run(run(gateway_url(server).replace("http://", "ws://") + "/ws"))
    finally:
        server.stop()
    assert code == 1000
    assert answer["type"] == "observation"
    assert answer["data"]["observation"]["echoed_message"] == "after"


def test_the_doors_receive_still_copies_uvicorns() -> None:
    """The door's bounded WebSocket protocol does uvicorn's ``receive`` inline (its
    queue get, then resume reading once the queue is empty) rather than awaiting it: a
    uvicorn release that changes that method must be copied again, not diverge unseen."""
    import inspect
    import textwrap

    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

    theirs = textwrap.dedent(inspect.getsource(WebSocketsSansIOProtocol.receive)).split("\n")
    assert [line.strip() for line in theirs if line.strip()] == [
        "async def receive(self) -> ASGIReceiveEvent:",
        "message = await self.queue.get()",
        "if self.read_paused and self.queue.empty():",
        "self.read_paused = False",
        "self.transport.resume_reading()",
        "return message",
    ], "uvicorn's receive changed: update _BoundedWebSocket.receive in gateway_limits.py"
