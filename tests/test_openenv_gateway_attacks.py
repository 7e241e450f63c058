"""The OpenEnv door (``serve ... --openenv-port PORT``) under attack (issue 37): each attack
replayed against a real serve process from outside, over its wire (HTTP/1.1, WebSocket
frames, TCP), with the bound it must hold. The tests say nothing about how the door is
built, so they guard any rebuild of it. Numbers go to docs/reliability.md ("The OpenEnv
door under attack")."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import fcntl
import json
import os
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import websockets
from openenv.core.generic_client import GenericEnvClient

from bench.hostile import rss_mib
from openenv_grpc.client.info import fetch_info
from openenv_grpc.server.process.heap import TRIM_INTERVAL
from openenv_grpc.testing import ServerProcess

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
from test_openenv_bridge import openenv_server  # noqa: E402
from test_openenv_gateway import (  # noqa: E402
    _stop_the_modules_servers,  # noqa: F401  (stops the servers serving() starts here too)
    gateway_url,
    serving,
    wait_for,
)

TOKEN = "door-secret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LIMIT = 64 * 1024  # --max-request-bytes of the servers that test message sizes

# -- wire helpers -----------------------------------------------------------------------


def _hostport(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("http://").rpartition(":")
    return host, int(port)


def _ws(url: str) -> str:
    return url.replace("http://", "ws://") + "/ws"


def rpc(url: str, method: str, params: dict[str, Any] | None = None, **headers: str) -> Any:
    """One JSON-RPC call to ``/mcp``: the answer, or the HTTPError's status code."""
    body = json.dumps({"jsonrpc": "2.0", "method": method, "params": params or {}, "id": 1})
    request = urllib.request.Request(
        f"{url}/mcp", body.encode(), {"Content-Type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.load(answer)
    except urllib.error.HTTPError as exc:
        return exc.code


def status_of(url: str, path: str, **headers: str) -> int:
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url + path, headers=headers), timeout=30
        ) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def readable(sock: socket.socket, wait: float) -> bool:
    """Whether ``sock`` has something to read (or was closed) within ``wait`` seconds."""
    poller = select.poll()  # not select(): fd numbers past 1024 in the tests that hold many
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(wait * 1000))


def _read_status(sock: socket.socket, wait: float) -> int | None:
    """The HTTP status the server answered on ``sock`` within ``wait`` seconds, if any."""
    if not readable(sock, wait):
        return None
    try:
        head = sock.recv(4096)
    except OSError:
        return None
    return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else None


def post_flood(url: str, headers: str, total: int, chunk: bytes, chunked: bool = False) -> Any:
    """POST /mcp with ``headers``, then send up to ``total`` body bytes; returns (the
    status the server answered, bytes sent before it did)."""
    sock = socket.create_connection(_hostport(url), timeout=30)
    with sock:
        sock.sendall(f"POST /mcp HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
        sent = 0
        piece = (b"%x\r\n" % len(chunk)) + chunk + b"\r\n" if chunked else chunk
        while sent < total:
            status = _read_status(sock, 0)
            if status is not None:
                return status, sent
            try:
                sock.sendall(piece)
            except OSError:  # the server answered and closed
                break
            sent += len(chunk)
        return _read_status(sock, 30), sent


def ws_handshake(url: str, extra: str = "", rcvbuf: int = 0) -> socket.socket:
    """A raw WebSocket on ``/ws``, past its handshake (with ``extra`` header lines; with
    ``rcvbuf``, a receive buffer that small from the start: a client slow to read)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect(_hostport(url))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        more = sock.recv(4096)
        if not more:
            sock.close()
            raise ConnectionError("the server closed the connection during the handshake")
        head += more
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def frame(opcode: int, payload: bytes, fin: bool = True, rsv1: bool = False) -> bytes:
    """A masked client frame."""
    first = (0x80 if fin else 0) | (0x40 if rsv1 else 0) | opcode
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", first, 0x80 | n)
    elif n < 65536:
        head = struct.pack("!BBH", first, 0x80 | 126, n)
    else:
        head = struct.pack("!BBQ", first, 0x80 | 127, n)
    return head + b"\0\0\0\0" + payload  # a zero mask: the payload as it is


def close_code(sock: socket.socket, wait: float = 30.0) -> int | None:
    """The code of the close frame the server sent on ``sock`` (None: it sent none)."""
    data = b""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if not readable(sock, 0.5):
            continue
        try:
            more = sock.recv(65536)
        except OSError:
            more = b""
        if not more:
            break
        data += more
    while len(data) >= 2:  # walk the server's (unmasked) frames
        opcode, n, at = data[0] & 0x0F, data[1] & 0x7F, 2
        if n == 126:
            n, at = struct.unpack("!H", data[2:4])[0], 4
        elif n == 127:
            n, at = struct.unpack("!Q", data[2:10])[0], 10
        payload, data = data[at : at + n], data[at + n :]
        if opcode == 0x8:
            return int(struct.unpack("!H", payload[:2])[0]) if len(payload) >= 2 else 1005
    return None


def send_until_answered(sock: socket.socket, piece: bytes, times: int) -> None:
    """Send ``piece`` up to ``times`` times, stopping once the server has said something
    (so its close frame is read before a reset could drop it)."""
    for _ in range(times):
        if readable(sock, 0):
            return
        try:
            sock.sendall(piece)
        except OSError:
            return
    readable(sock, 30)


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextlib.contextmanager
def own_server(
    *args: str, extra_env: dict[str, str] | None = None, env: str = "echo"
) -> Iterator[Any]:
    server = ServerProcess(env, ["--openenv-port", "0", *args], extra_env=extra_env,
                           pythonpath=[TESTS])  # fmt: skip
    try:
        yield server, gateway_url(server)
    finally:
        server.stop()


# -- 1. auth on every route and frame; ids are capabilities -------------------------------


@pytest.mark.fresh_server  # a server of its own: make test
def test_an_outsider_with_a_session_id_but_no_token_reaches_nothing() -> None:
    extra = {"AUTH_TOKEN": TOKEN, "LOG_LEVEL": "DEBUG"}
    with serving("echo", extra_env=extra) as (server, url):
        made = rpc(url, "openenv/session/create", **AUTH)
        session_id = made["result"]["session_id"]
        call = {"session_id": session_id, "name": "reverse", "arguments": {"message": "abc"}}
        assert rpc(url, "tools/call", call, **AUTH)["result"] == {"data": "cba"}

        async def owner_steps(message: str) -> dict[str, Any]:
            async with websockets.connect(
                f"{_ws(url)}?session_id={session_id}", additional_headers=AUTH
            ) as ws:
                await ws.send(json.dumps({"type": "step", "data": {"message": message}}))
                await ws.recv()
                await ws.send(json.dumps({"type": "state"}))
                return dict(json.loads(await ws.recv()))

        assert asyncio.run(owner_steps("abc"))["data"]["history"] == ["abc"]

        refused = []
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            for method in ("tools/list", "tools/call", "openenv/session/close"):
                refused.append(rpc(url, method, call, **headers))
            for path in ("/docs", "/redoc", "/openapi.json", "/schema", "/metadata"):
                refused.append(status_of(url, path, **headers))

            async def attach(headers: dict[str, str]) -> tuple[Any, int | None]:
                async with websockets.connect(
                    f"{_ws(url)}?session_id={session_id}", additional_headers=headers
                ) as ws:
                    first = json.loads(await ws.recv())
                    with contextlib.suppress(websockets.ConnectionClosed):
                        await ws.send(json.dumps({"type": "step", "data": {"message": "x"}}))
                        await ws.recv()
                    return first, ws.close_code

            first, code = asyncio.run(attach(headers))
            assert first["type"] == "error" and "UNAUTHENTICATED" in first["data"]["message"]
            assert code == 1008
        assert refused == [401, 401, 401, 404, 404, 404, 401, 401] * 3
        print(f"\noutsider: {len(refused) + 3} tries on a known id, all refused")

        # The token holder still sees no docs; the session is untouched and answers.
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert status_of(url, path, **AUTH) == 404
        history = rpc(url, "tools/call", {**call, "name": "history", "arguments": {}}, **AUTH)
        assert history["result"]["data"] == ["abc"]  # no step of the outsider's landed
        assert asyncio.run(owner_steps("def"))["data"]["history"] == ["abc", "def"]
        assert rpc(url, "openenv/session/close", {"session_id": session_id}, **AUTH)["result"]
        # The capability is never written whole to the server's logs (DEBUG included).
        logs = server.stderr() + "".join(server.stdout_lines)
        assert session_id not in logs and session_id[:12] not in logs


# -- 2. POST /mcp bodies: auth first, capped, with a deadline ---------------------------------


@pytest.mark.fresh_server  # a server of its own: make test
def test_mcp_bodies_are_checked_before_they_are_read_and_capped() -> None:
    args = ("--max-request-bytes", str(LIMIT), "--request-arrival-timeout", "1")
    with own_server(*args, extra_env={"AUTH_TOKEN": TOKEN}) as (server, url):
        pid = server.proc.pid
        baseline = rss_mib(pid)
        gib = 1 << 30
        chunk = b"x" * 65536
        # No token, 1 GiB declared: 401 before the body (the client is still sending).
        no_token = post_flood(url, f"Content-Length: {gib}\r\n", 64 << 20, chunk)
        # Token, 1 GiB declared: 413 by the Content-Length alone.
        declared = post_flood(url, f"Content-Length: {gib}\r\n{_auth_line()}", 64 << 20, chunk)
        # Token, chunked (no length): 413 once the limit is passed.
        streamed = post_flood(
            url, f"Transfer-Encoding: chunked\r\n{_auth_line()}", 64 << 20, chunk, chunked=True
        )
        # Four at once without a token, 64 MiB each offered.
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            floods = list(
                pool.map(
                    lambda _: post_flood(url, f"Content-Length: {gib}\r\n", 64 << 20, chunk),
                    range(4),
                )
            )
        growth = rss_mib(pid) - baseline
        # A body that never completes: 408 after the arrival timeout.
        with socket.create_connection(_hostport(url), timeout=30) as slow:
            slow.sendall(f"POST /mcp HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                         f"{_auth_line()}\r\n{{\"jsonrpc\"".encode())  # fmt: skip
            slow_status = _read_status(slow, 30)
        print(
            f"\n/mcp: no token {no_token}, declared 1 GiB {declared}, chunked {streamed}, "
            f"4 floods {floods}, slow {slow_status}; RSS +{growth:.1f} MiB"
        )
        assert no_token[0] == 401 and declared[0] == 413 and streamed[0] == 413
        # Answered long before the 64 MiB offered were sent (what was sent sat in buffers).
        assert max(no_token[1], declared[1], streamed[1]) < 16 << 20
        assert all(status == 401 for status, _sent in floods)
        assert slow_status == 408
        assert growth <= 16
        # The door still answers its owner.
        assert rpc(url, "openenv/session/create", **AUTH)["result"]["session_id"]


def _auth_line() -> str:
    return f"Authorization: Bearer {TOKEN}\r\n"


# -- 3. WebSocket messages: deflate off, size capped, fragments too ---------------------------


@pytest.mark.fresh_server  # a server of its own: make test
def test_websocket_messages_are_capped_and_never_inflated() -> None:
    with own_server("--max-request-bytes", str(LIMIT)) as (server, url):
        pid = server.proc.pid

        async def over_limit() -> tuple[str | None, int | None]:
            async with websockets.connect(_ws(url), compression="deflate", max_size=None) as ws:
                offered = ws.response.headers.get("Sec-WebSocket-Extensions")
                await ws.send("x" * (LIMIT + 1))
                with contextlib.suppress(websockets.ConnectionClosed):
                    await ws.recv()
                return offered, ws.close_code

        extensions, whole = asyncio.run(over_limit())

        # A deflate bomb sent anyway (RSV1 set): a protocol error, nothing inflated.
        bomb = zlib.compressobj(9, zlib.DEFLATED, -12)
        payload = bomb.compress(b"\0" * (16 << 20)) + bomb.flush(zlib.Z_SYNC_FLUSH)
        baseline = rss_mib(pid)
        bombs = []
        for _ in range(8):
            with ws_handshake(url, "Sec-WebSocket-Extensions: permessage-deflate\r\n") as sock:
                with contextlib.suppress(OSError):
                    sock.sendall(frame(0x1, payload, rsv1=True))
                bombs.append(close_code(sock))
        bomb_growth = rss_mib(pid) - baseline

        # A message in 1-byte fragments past the limit: 1009, whatever the fragment size.
        with ws_handshake(url) as sock:
            sock.sendall(frame(0x1, b"{", fin=False))
            send_until_answered(sock, frame(0x0, b" ", fin=False) * 4096, LIMIT // 4096 + 2)
            fragmented = close_code(sock)

        # Connections each holding a message just under the limit in 1-byte fragments.
        baseline, holders = rss_mib(pid), 40
        held = []
        for _ in range(holders):
            sock = ws_handshake(url)
            sock.sendall(frame(0x1, b"{", fin=False) + frame(0x0, b" ", fin=False) * (LIMIT - 64))
            held.append(sock)
        time.sleep(1.0)  # let the server read what was sent
        fragment_growth = rss_mib(pid) - baseline
        wire = holders * (LIMIT - 64) * 7 / (1 << 20)
        for sock in held:
            sock.close()
        print(
            f"\nws: {LIMIT + 1}-byte message -> {whole}; 8 deflate bombs "
            f"({len(payload)} B -> 16 MiB each) -> {bombs[0]}, RSS +{bomb_growth:.1f} MiB; "
            f"fragments past the limit -> {fragmented}; {holders} x {LIMIT - 64} 1-byte fragments "
            f"({wire:.0f} MiB on the wire) -> RSS +{fragment_growth:.1f} MiB"
        )
        assert extensions is None  # permessage-deflate is never negotiated
        assert whole == 1009
        assert bombs == [1002] * 8
        assert fragmented == 1009
        assert bomb_growth <= 16
        assert fragment_growth <= 2 * holders * LIMIT / (1 << 20) + 8

        async def still_fine() -> str:
            async with GenericEnvClient(base_url=url) as env:
                await env.reset()
                result = await env.step({"message": "ok"})
                return str(result.observation["echoed_message"])

        assert asyncio.run(still_fine()) == "ok"


# -- 4. connections that never speak ------------------------------------------------------------


@pytest.mark.fresh_server  # a server of its own, with a lowered fd limit: make test
def test_thousands_of_silent_connections_never_starve_the_grpc_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server_fds = 1024
    real_popen = subprocess.Popen

    def limited(*args: Any, **kwargs: Any) -> Any:
        # Soft and hard both, in the child only: the server raises its soft limit to the
        # hard one at start (app.raise_fd_limit).
        def lower_limit() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (server_fds, server_fds))

        return real_popen(*args, preexec_fn=lower_limit, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(subprocess, "Popen", limited)
        started = own_server("--request-arrival-timeout", "3")
        server, url = started.__enter__()
    try:
        pid = server.proc.pid
        silent: list[socket.socket] = []
        refused = 0
        for _ in range(3000):
            try:
                silent.append(socket.create_connection(_hostport(url), timeout=5))
            except OSError:
                refused += 1
        peak_fds = fd_count(pid)
        # A fresh gRPC client's health check. The door takes 3,000 connections on the
        # server's one loop, so on a loaded machine the first check may wait behind them:
        # asked again for up to 30 s (before the fix it never answered: no fd was left).
        health, asked_until = 0, time.monotonic() + 30
        while health != 1 and time.monotonic() < asked_until:
            with contextlib.suppress(grpc.RpcError):
                health = server.health()
        info = fetch_info(server.target, timeout=30)
        # Every silent connection is closed by the server within the arrival timeout.
        closed = 0
        deadline = time.monotonic() + 30
        poller = select.poll()
        by_fd = {sock.fileno(): sock for sock in silent}
        for sock in silent:
            poller.register(sock, select.POLLIN)
        while len(by_fd) > 0 and time.monotonic() < deadline:
            for fd, _event in poller.poll(500):
                with contextlib.suppress(OSError):
                    if by_fd[fd].recv(1):
                        continue
                closed += 1
                poller.unregister(fd)
                del by_fd[fd]
        for sock in silent:
            sock.close()
        print(
            f"\n3000 silent connections (server fd limit {server_fds}): peak {peak_fds} fds, "
            f"{refused} connects failed, health {health}, Info answered "
            f"({info.capacity.max_sessions} slots); {closed} closed by the server"
        )
        assert health == 1  # SERVING
        # The door closes connections past its cap once accepted, so a burst on a loaded
        # machine can touch the fd limit for a moment (peaks of 787 and 1,024 seen, printed
        # above): what must hold is that the gRPC port answers a fresh client and that
        # the burst is closed.
        assert closed == len(silent)
        with GenericEnvClient(base_url=url).sync() as env:
            env.reset()
            assert env.step({"message": "after"}).observation["echoed_message"] == "after"
    finally:
        started.__exit__(None, None, None)


# -- 5. held sessions ended by the idle timeout --------------------------------------------------


@pytest.mark.fresh_server  # a server of its own: make test
def test_held_sessions_left_idle_are_freed() -> None:
    with own_server("--idle-timeout", "1") as (server, url):
        pid = server.proc.pid

        def round_of(n: int) -> list[str]:
            ids = []
            for _ in range(n):  # a real episode on each, begun before it can idle 1 s
                session_id = rpc(url, "openenv/session/create")["result"]["session_id"]
                assert "result" in rpc(url, "tools/list", {"session_id": session_id})
                ids.append(session_id)
            return ids

        round_of(40)  # warm up
        wait_for(lambda: server.active() == 0, "the warm-up sessions reaped")
        baseline = rss_mib(pid)
        rounds, ids = 10, []
        for _ in range(rounds):
            ids = round_of(40)
            wait_for(lambda: server.active() == 0, "the idle sessions reaped")
        time.sleep(2.0)  # past the door's own idle clock
        unknown = [rpc(url, "tools/list", {"session_id": i})["error"]["code"] for i in ids]
        growth = rss_mib(pid) - baseline
        print(f"\n{rounds * 40} held sessions idle past 1 s: RSS +{growth:.2f} MiB; "
              f"their ids now {set(unknown)}")  # fmt: skip
        assert unknown == [-32602] * 40  # forgotten: "Unknown session_id"-like
        assert growth <= 4

        async def silent_socket() -> int | None:
            async with websockets.connect(_ws(url)) as ws:
                with contextlib.suppress(websockets.ConnectionClosed):
                    await asyncio.wait_for(ws.recv(), 60)
                return ws.close_code

        assert asyncio.run(silent_socket()) == 1001  # a silent WebSocket goes too
        wait_for(lambda: server.active() == 0, "its session closed")


def test_a_socket_attached_to_a_held_session_closes_with_it() -> None:
    """``openenv/session/close`` over ``/mcp`` ends the session for a WebSocket attached
    to it with ``?session_id=`` too: its next frame finds the socket closed, not an
    error for every frame from then on."""
    with serving("echo") as (_server, url):
        session_id = rpc(url, "openenv/session/create")["result"]["session_id"]

        async def attached() -> tuple[str, int | None]:
            async with websockets.connect(f"{_ws(url)}?session_id={session_id}") as ws:
                await ws.send(json.dumps({"type": "reset", "data": {}}))
                first = json.loads(await ws.recv())["type"]
                closed = rpc(url, "openenv/session/close", {"session_id": session_id})
                assert closed["result"]["closed"] is True
                with contextlib.suppress(websockets.ConnectionClosed):
                    await ws.send(json.dumps({"type": "step", "data": {"message": "x"}}))
                    await asyncio.wait_for(ws.recv(), 30)
                return first, ws.close_code

        first, code = asyncio.run(attached())
        assert first == "observation"
        assert code == 1000


# -- 6. concurrent calls on one held session ---------------------------------------------------


def test_concurrent_tool_calls_on_one_session_answer_each_its_own() -> None:
    with serving("echo") as (_server, url):
        session_id = rpc(url, "openenv/session/create")["result"]["session_id"]

        def call(i: int) -> Any:
            params = {"session_id": session_id, "name": "reverse",
                      "arguments": {"message": f"call-{i:02d}"}}  # fmt: skip
            return rpc(url, "tools/call", params)

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(call, range(16)))
        right = sum(
            a.get("result") == {"data": f"call-{i:02d}"[::-1]} for i, a in enumerate(answers)
        )
        print(f"\n16 concurrent tools/call on one session: {right} answered right")
        assert [a.get("result") for a in answers] == [
            {"data": f"call-{i:02d}"[::-1]} for i in range(16)
        ]
        # The session survived: it lists its tools and still calls them.
        listed = rpc(url, "tools/list", {"session_id": session_id})["result"]["tools"]
        assert sorted(tool["name"] for tool in listed) == ["count", "history", "reverse"]
        assert call(99)["result"] == {"data": "99-llac"}
        assert rpc(url, "openenv/session/close", {"session_id": session_id})["result"]


# -- 7. hostile frames ----------------------------------------------------------------------


HOSTILE: list[str | bytes] = [
    "[" * 100_000 + "]" * 100_000,  # nesting deeper than any parser recurses
    '{"type": "step", "data": ' + '{"a": ' * 50_000 + "1" + "}" * 50_001,
    "9" * 5000,  # 5,000 digits
    '{"type": "reset", "data": {"seed": ' + "9" * 5000 + "}}",
    '{"type": "step", "data": {"message": ' + "1" * 5000 + "}}",
    "[1, 2]",
    "5",
    "null",
    '"step"',
    "true",
    b"\x00\x01\x02",  # binary frames
    b'{"type": "step", "data": {"message": "bin"}}',
    '{"type": 5}',
    '{"type": ["step"]}',
    '{"type": "step", "data": "x"}',
    '{"type": "reset", "data": []}',
    '{"type": "step", "data": {"message": 1e999}}',
    "{",
]


def test_hostile_frames_get_error_frames_and_the_session_goes_on() -> None:
    async def talk(ws_url: str) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
        async with websockets.connect(ws_url, max_size=None) as ws:
            await ws.send(json.dumps({"type": "reset", "data": {}}))
            await ws.recv()
            answers = []
            for hostile in HOSTILE:
                await ws.send(hostile)
                answers.append(json.loads(await ws.recv()))
            await ws.send(json.dumps({"type": "step", "data": {"message": "still"}}))
            step = json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "state"}))
            state = json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "close"}))
            return answers, step, state

    with serving("echo") as (_server, url):
        answers, step, state = asyncio.run(talk(_ws(url)))
        codes = [answer["data"].get("code") for answer in answers]
        print(f"\n{len(HOSTILE)} hostile frames -> {codes}")
        assert [answer["type"] for answer in answers] == ["error"] * len(HOSTILE)
        assert step["data"]["observation"]["echoed_message"] == "still"
        assert state["data"]["step_count"] == 1  # none of the hostile frames stepped


@pytest.mark.fresh_server  # OpenEnv's own uvicorn server: make test
def test_openenvs_own_server_ends_sessions_on_hostile_frames_where_we_do_not() -> None:
    """The reference for docs/from-openenv.md's line: OpenEnv 0.10's server answers a
    frame it cannot read as an object by ending the session."""

    async def ends_session(ws_url: str, hostile: str | bytes) -> bool:
        async with websockets.connect(ws_url, max_size=None) as ws:
            await ws.send(json.dumps({"type": "reset", "data": {}}))
            await ws.recv()
            try:
                await ws.send(hostile)
                await ws.recv()
                await ws.send(json.dumps({"type": "state"}))
                return json.loads(await ws.recv())["type"] != "state"
            except websockets.ConnectionClosed:
                return True

    async def count(ws_url: str) -> int:
        return sum([await ends_session(ws_url, hostile) for hostile in HOSTILE])

    with openenv_server("echo_app") as theirs:
        ended = asyncio.run(count(_ws(theirs)))
    print(f"\nOpenEnv 0.10's own server: {ended} of {len(HOSTILE)} hostile frames end the session")
    assert ended > 0  # ours: none (the test above)


# -- 8. drain ------------------------------------------------------------------------------------


@pytest.mark.fresh_server  # a server it stops: make test
def test_a_drain_closes_websockets_with_a_close_frame() -> None:
    with own_server("--grace", "1") as (server, url):

        async def wait_for_close() -> tuple[int | None, float]:
            async with websockets.connect(_ws(url)) as idle, websockets.connect(_ws(url)) as busy:
                for ws in (idle, busy):
                    await ws.send(json.dumps({"type": "reset", "data": {}}))
                    await ws.recv()
                started = time.monotonic()
                server.proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(websockets.ConnectionClosed):
                    while True:  # the busy one steps through the grace
                        await busy.send(json.dumps({"type": "step", "data": {"message": "x"}}))
                        await busy.recv()
                with contextlib.suppress(websockets.ConnectionClosed):
                    await idle.recv()
                assert busy.close_code == idle.close_code
                return idle.close_code, time.monotonic() - started

        code, took = asyncio.run(wait_for_close())
        exit_code = server.proc.wait(30)
        print(f"\ndrain at --grace 1: close frame {code} after {took:.2f} s; exit {exit_code}")
        assert code in (1001, 1012)
        assert exit_code == 0


@pytest.mark.fresh_server  # a server it stops: make test
def test_a_drain_answers_bodies_still_arriving_with_503_and_no_traceback() -> None:
    """HTTP requests whose bodies trickle in when the server drains: each is answered 503
    (``Connection: close``) at the drain, not cancelled at uvicorn's shutdown timeout with
    an ERROR traceback per request (before)."""
    with own_server("--grace", "5") as (server, url):
        socks = []
        for path in ("/reset", "/step", "/mcp"):
            sock = socket.create_connection(_hostport(url))
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: door\r\nContent-Type: "
                         "application/json\r\nContent-Length: 1000\r\n\r\n{".encode())  # fmt: skip
            socks.append(sock)
        for sock in socks:  # every request is reading its body
            sock.sendall(b" ")
        # A round trip after them: the loop has parsed their heads and runs their routes.
        with urllib.request.urlopen(f"{url}/health", timeout=30) as health:
            assert health.status == 200
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        answers = []
        for sock in socks:
            sock.settimeout(30)
            answers.append(_read_all(sock))
            sock.close()
        took = time.monotonic() - started
        exit_code = server.proc.wait(30)
        errors = server.stderr()
    print(f"\n3 bodies arriving at a drain: answered {took:.2f} s after SIGTERM; exit {exit_code}")
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
        assert b"server draining" in answer
        assert b"connection: close" in answer.lower()
    assert exit_code == 0
    assert "Traceback" not in errors, errors[-3000:]


def _read_all(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


# -- 9. bytes across connections: the server's one byte budget -----------------------------------

BUDGET = 8 << 20  # --max-held-bytes of the servers below
BIG = 3 << 20  # a message well within the 4 MiB request limit
#: OpenEnv's template echo env: its answers are as large as the message asked for.
OPENENV_ECHO = "--openenv=support.openenv_envs.echo:EchoEnvironment"


@pytest.mark.fresh_server  # a server of its own, with a small byte budget: make test
def test_half_sent_messages_on_many_sockets_draw_from_the_byte_budget() -> None:
    """Each socket stays within the message limit; together they would hold gigabytes.
    What arrives is counted against --max-held-bytes before it is buffered: past it,
    sockets are closed 1013 (try again later), and an honest client goes on."""
    with own_server("--max-held-bytes", str(BUDGET)) as (server, url):
        pid = server.proc.pid
        baseline, attackers = rss_mib(pid), 48
        head = struct.pack("!BBQ", 0x81, 0x80 | 127, 4 << 20) + b"\0\0\0\0"  # 4 MiB announced
        sockets = []
        for _ in range(attackers):
            sock = ws_handshake(url)
            sock.settimeout(5)
            with contextlib.suppress(OSError):
                sock.sendall(head)
                for _ in range(BIG // (256 << 10)):
                    sock.sendall(b" " * (256 << 10))
            sockets.append(sock)
        time.sleep(1.0)  # let the server read what was sent
        growth = rss_mib(pid) - baseline

        async def honest() -> str:
            async with GenericEnvClient(base_url=url) as env:
                await env.reset()
                result = await env.step({"message": "ok"})
                return str(result.observation["echoed_message"])

        answer = asyncio.run(honest())  # while the attackers still hold what they hold
        codes = [close_code(sock, 0.2) for sock in sockets]
        for sock in sockets:
            sock.close()
        refused = codes.count(1013)
        wire = attackers * BIG / (1 << 20)
        print(
            f"\n{attackers} sockets x {BIG >> 20} MiB of a 4 MiB message ({wire:.0f} MiB on "
            f"the wire), budget {BUDGET >> 20} MiB: RSS +{growth:.1f} MiB, {refused} closed 1013"
        )
        assert answer == "ok"
        assert refused >= attackers // 2
        assert growth <= 48  # the budget, its reserve and the sockets themselves


@pytest.mark.fresh_server  # a server of its own, with a small byte budget: make test
def test_clients_that_never_read_their_answers_are_counted_and_closed() -> None:
    """Large answers to clients that do not read stay in the server's send buffers: they
    are counted against --max-held-bytes with what arrives, a socket takes its next
    message only once its last answer has left, and what does not fit is closed 1013.
    So the sessions left holding answers fit the budget whatever the clients ask."""
    with own_server("--max-held-bytes", str(BUDGET), env=OPENENV_ECHO) as (server, url):
        pid = server.proc.pid
        baseline, stallers = rss_mib(pid), 24
        step = frame(0x1, json.dumps({"type": "step", "data": {"message": "x" * BIG}}).encode())
        sockets, turned_away = [], 0
        for _ in range(stallers):
            try:
                sock = ws_handshake(url, rcvbuf=4096)
            except ConnectionError:  # the budget was spent as it connected
                turned_away += 1
                continue
            sock.settimeout(5)
            sock.sendall(frame(0x1, b'{"type": "reset", "data": {}}'))
            with contextlib.suppress(OSError):
                for _ in range(3):  # answers pile up unread
                    sock.sendall(step)
            sockets.append(sock)
        time.sleep(2.0)
        peak = rss_mib(pid) - baseline
        # What stays held, once the server's heap trimmer has given back what the answers'
        # transient copies (JSON, protobuf, bytes) took: the peak above is the allocator's.
        time.sleep(TRIM_INTERVAL + 1.0)
        settled = rss_mib(pid) - baseline
        held = fetch_info(server.target).capacity.active_sessions
        for sock in sockets:
            sock.close()
        wire = stallers * 3 * BIG / (1 << 20)
        print(f"\n{stallers} clients asking {3 * BIG >> 20} MiB of answers each ({wire:.0f} MiB) "
              f"and reading none, budget {BUDGET >> 20} MiB: RSS +{peak:.1f} MiB at 2 s, "
              f"+{settled:.1f} MiB held after a trim, {held} sessions still held, "
              f"{stallers - held} closed ({turned_away} at the handshake)")  # fmt: skip
        assert held * BIG <= BUDGET * 3 // 2  # what is left fits the budget and its reserve
        # Holding every answer asked for would keep the wire's 216 MiB at least (seen: 32-80).
        assert settled <= 128, (peak, settled)

        async def honest() -> str:
            async with GenericEnvClient(base_url=url) as env:
                await env.reset()
                return str((await env.step({"message": "ok"})).observation["echoed_message"])

        assert asyncio.run(honest()) == "ok"  # OpenEnv's echo env answers the message


# -- 10. what the attack on the rebuilt door found ------------------------------------------------


def _slow_reader(url: str) -> socket.socket:
    """A socket with a 4 KiB receive buffer from the start (a client that reads nothing)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect(_hostport(url))
    return sock


def _unread_bytes(sock: socket.socket) -> int:
    """Bytes waiting in ``sock``'s receive buffer (FIONREAD)."""
    count: int = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]
    return count


@pytest.mark.fresh_server  # a server it stops: make test
def test_a_drain_ends_on_time_with_a_client_that_reads_nothing() -> None:
    """A close frame cannot pass answers a client never takes: the drain and the idle
    timeout drop such a connection instead of waiting behind them for ever."""
    with own_server("--grace", "2", env=OPENENV_ECHO) as (server, url):
        sock = ws_handshake(url, rcvbuf=4096)
        with contextlib.suppress(OSError):
            sock.sendall(frame(0x1, json.dumps({"type": "step", "data": {"message": "z" * BIG}})
                               .encode()))  # fmt: skip
        # The answer is made: its first bytes wait in our receive buffer, the rest behind it.
        deadline = time.monotonic() + 30
        while _unread_bytes(sock) == 0:
            assert time.monotonic() < deadline, "the step's answer never started to arrive"
            time.sleep(0.01)
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        # Waiting behind the answer the client never takes, the drain would never end; its
        # bound (the grace, the envs' close budget, the door's shutdown: 2 + 2 + 3 s) is
        # measured, not asserted. 30 s is a hang guard.
        try:
            exit_code = server.proc.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail("the drain waits behind an answer the client never takes (30 s on)")
        took = time.monotonic() - started
        sock.close()
        print(f"\ndrain at --grace 2 with a client reading nothing: exit {exit_code} after "
              f"{took:.2f} s")  # fmt: skip
        assert exit_code == 0


@pytest.mark.fresh_server  # a server of its own, with a small byte budget: make test
def test_http_answers_a_client_never_takes_are_counted_and_dropped() -> None:
    """``POST /step`` answers as large as the message (4.1 MB, within the default request
    limit), never read: the bodies are counted as they arrive, the answers while the
    transport holds them, and once the budget is spent a connection whose client took
    nothing for 5 s is dropped, its bytes with it."""
    with own_server("--max-held-bytes", str(BUDGET), env=OPENENV_ECHO) as (server, url):
        pid = server.proc.pid
        baseline, clients, fds = rss_mib(pid), 40, fd_count(pid)
        body = json.dumps({"action": {"message": "x" * 4_100_000}}).encode()
        request = (
            b"POST /step HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        ) + body
        sockets = []
        for _ in range(clients):
            sock = _slow_reader(url)
            sock.settimeout(5)
            with contextlib.suppress(OSError):
                sock.sendall(request)
            sockets.append(sock)
            time.sleep(0.1)
        peak = rss_mib(pid) - baseline
        started, open_now = time.monotonic(), fd_count(pid) - fds
        while open_now > 0 and time.monotonic() - started < 30:  # nothing read meanwhile
            time.sleep(0.25)
            open_now = fd_count(pid) - fds
        took = time.monotonic() - started
        after = rss_mib(pid) - baseline
        for sock in sockets:
            sock.close()
        print(f"\n{clients} POST /step of 4.1 MB answers never read, budget {BUDGET >> 20} "
              f"MiB: RSS +{peak:.1f} MiB once sent, {open_now} connections left after "
              f"{took:.1f} s, then +{after:.1f} MiB")  # fmt: skip
        assert open_now <= 0
        assert peak <= 200  # the budget, the answers' working copies, the sockets


@pytest.mark.fresh_server  # a server of its own, with a token and a small budget: make test
def test_refused_sockets_cannot_spend_the_budget_of_those_with_the_token() -> None:
    """Sockets without the token are refused (error frame, close 1008); what they send
    after that is not counted, and a peer that keeps sending past a few bytes, or does not
    answer the close within a second, is dropped. Clients with the token go on."""
    token_env = {"AUTH_TOKEN": TOKEN}
    with own_server("--max-held-bytes", str(BUDGET), env=OPENENV_ECHO, extra_env=token_env) as (
        _server,
        url,
    ):
        stop = time.monotonic() + 4.0
        chunk = b" " * (256 << 10)

        def outsider() -> int:
            connects = 0
            while time.monotonic() < stop:
                try:
                    sock = ws_handshake(url)
                except (OSError, AssertionError):
                    continue
                connects += 1
                sock.settimeout(1)
                with contextlib.suppress(OSError):
                    sock.sendall(struct.pack("!BBQ", 0x81, 0x80 | 127, 4 << 20) + b"\0" * 4)
                    while time.monotonic() < stop:
                        sock.sendall(chunk)
                sock.close()
            return connects

        async def honest() -> list[str]:
            answers = []
            async with GenericEnvClient(base_url=url, headers=AUTH) as env:
                await env.reset()
                while time.monotonic() < stop - 0.5:
                    result = await env.step({"message": "y" * 100_000})
                    answers.append(str(result.observation["echoed_message"])[:1])
                    await asyncio.sleep(0.1)
            return answers

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            floods = [pool.submit(outsider) for _ in range(16)]
            time.sleep(0.5)
            answers = asyncio.run(honest())
            body = json.dumps({"action": {"message": "hi"}}).encode()
            request = urllib.request.Request(
                f"{url}/step", body, {"Content-Type": "application/json", **AUTH}
            )
            with urllib.request.urlopen(request, timeout=30) as answer:
                http_status = answer.status
            connects = sum(flood.result() for flood in floods)
        print(f"\n16 outsiders without the token ({connects} refused sockets, each sending "
              f"until dropped): {len(answers)} honest 100 KB steps answered meanwhile, "
              f"HTTP /step {http_status}")  # fmt: skip
        assert answers and set(answers) == {"y"}
        assert http_status == 200


# -- 11. what the attack on the door's stream wires found -------------------------------------


@pytest.mark.fresh_server  # a server of its own: make test
def test_clients_that_go_right_after_a_frame_leave_no_traceback() -> None:
    """Frames answered without a request of the core's stream (an mcp frame closing
    another, held session; not JSON): their clients go at once, before the answer. Each
    stream ends quietly, as when a client goes between frames (before: an ERROR traceback
    per socket)."""
    with own_server() as (server, url):
        for k in range(30):
            held = rpc(url, "openenv/session/create")["result"]["session_id"]
            close_held = {"jsonrpc": "2.0", "method": "openenv/session/close",
                          "params": {"session_id": held}, "id": 1}  # fmt: skip
            sock = ws_handshake(url)
            sock.sendall(
                frame(0x1, json.dumps({"type": "mcp", "data": close_held}).encode())
                if k % 2 == 0
                else frame(0x1, b"{nope")
            )
            sock.close()
            if k % 2:
                rpc(url, "openenv/session/close", {"session_id": held})
        server.wait_until(lambda: server.active() == 0, 30, "every session ended")
        errors = server.stderr()
    print(f"\n30 clients gone right after a frame: {errors.count('Traceback')} tracebacks")
    assert "Traceback" not in errors
    assert "failed serving a WebSocket" not in errors


@pytest.mark.fresh_server  # a server of its own: make test
def test_a_reset_behind_thousands_of_queued_frames_answers_none_of_them() -> None:
    """Eight clients each send one read's worth of 7-byte frames (37,449 of them) and reset
    the connection: what they queued is dropped with them, not answered into the dead
    transport one warning at a time (before: 356,677 warnings from 20 such clients)."""
    blob = frame(0x1, b"{") * (262144 // 7)
    with own_server() as (server, url):
        for _ in range(8):
            sock = ws_handshake(url)
            sock.sendall(blob)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # a reset: unsent answers cannot leave
        server.wait_until(lambda: server.active() == 0, 60, "the sockets' sessions ended")
        with GenericEnvClient(base_url=url).sync() as env:  # the door goes on
            env.reset()
            assert env.step({"message": "after"}).observation["echoed_message"] == "after"
        warnings = server.stderr().count("socket.send() raised exception")
    print(f"\n8 resets behind 37,449 queued frames each: {warnings} failed-write warnings")
    assert warnings == 0


@pytest.mark.fresh_server  # a server of its own: make test
def test_a_read_of_thousands_of_tiny_frames_is_parsed_as_the_app_takes_them() -> None:
    """40 sockets each send one read's worth of 7-byte frames (37,449) and read nothing.
    The door parses a read only up to the first message its app has not taken; the rest
    waits as the bytes it is (before: every frame of the read became a queued message at
    once, ~13 bytes of memory per byte received: +130.5 MiB for these 10 MiB). An honest
    client steps meanwhile, and every session ends with its socket."""
    blob = frame(0x1, b"{") * (262144 // 7)
    with own_server() as (server, url):
        pid = server.proc.pid
        baseline = rss_mib(pid)
        sockets = []
        for _ in range(40):
            sock = ws_handshake(url, rcvbuf=4096)
            sock.sendall(blob)
            sockets.append(sock)
        # Each socket's frames are answered until its unread answers fill the transport.
        server.wait_until(lambda: server.active() == 40, 30, "every socket's session")
        time.sleep(1.0)  # the reads are taken and parsed as far as they will be
        growth = rss_mib(pid) - baseline
        with GenericEnvClient(base_url=url).sync() as env:
            env.reset()
            assert env.step({"message": "beside"}).observation["echoed_message"] == "beside"
        for sock in sockets:
            sock.close()
        server.wait_until(lambda: server.active() == 0, 60, "the sockets' sessions ended")
    print(f"\n40 sockets x 37,449 queued 7-byte frames (10 MiB on the wire): RSS +{growth:.1f} MiB")
    assert growth <= 20


@pytest.mark.fresh_server  # a server of its own: make test
def test_held_sessions_closing_each_other_answer_and_free_their_slots() -> None:
    """Two held sessions, a socket attached to each; each socket asks (an mcp frame) to
    close the other. Both are answered and, once the clients leave, every slot is free
    (before: the two locks deadlocked, and every later close of either hung too: 1,000
    such sockets held 1,002 of 1,024 slots for the life of the process)."""

    def close_of(session_id: str) -> str:
        call = {"jsonrpc": "2.0", "id": 1, "method": "openenv/session/close",
                "params": {"session_id": session_id}}  # fmt: skip
        return json.dumps({"type": "mcp", "data": call})

    async def pair(url: str) -> list[Any]:
        first, second = (rpc(url, "openenv/session/create")["result"]["session_id"] for _ in "ab")
        async with (
            websockets.connect(f"{_ws(url)}?session_id={first}") as a,
            websockets.connect(f"{_ws(url)}?session_id={second}") as b,
        ):
            await asyncio.gather(a.send(close_of(second)), b.send(close_of(first)))
            answers = await asyncio.gather(
                asyncio.wait_for(a.recv(), 10), asyncio.wait_for(b.recv(), 10),
                return_exceptions=True,
            )  # fmt: skip
        return [json.loads(x) if isinstance(x, str) else repr(x) for x in answers]

    # A session whose socket closed before its close of the other ran is left held, as any
    # held session is, until the idle timeout.
    with own_server("--max-concurrent-envs", "8", "--idle-timeout", "1") as (server, url):
        for _ in range(10):
            answers = asyncio.run(pair(url))
            # Each socket gets its close's result, or its socket closes as its own session
            # was closed first; neither waits.
            assert all(isinstance(a, dict) or a.startswith("ConnectionClosedOK") for a in answers)
            assert any(isinstance(a, dict) for a in answers), answers
            server.wait_until(lambda: server.active() == 0, 30, "both sessions closed")


@pytest.mark.fresh_server  # a server of its own, with a small byte budget: make test
def test_ping_frames_hold_no_budget_and_never_hog_the_loop() -> None:
    """Control frames make no message: their bytes are given back as soon as they are
    parsed, and a read of them is parsed a chunk per turn of the loop. Five sockets that
    sent ~6 MB of pings each (reading the pongs), then went quiet, leave a 3 MB step room
    in a 32 MiB budget (before: they held 31.4 MB of it until the idle timeout, and the
    step was refused); a neighbour keeps stepping while a socket floods pings."""
    ping = frame(0x9, b"p" * 125)

    def pinger(url: str, total: int) -> socket.socket:
        sock = ws_handshake(url)
        chunk = ping * 4000
        for _ in range(total // len(chunk)):
            sock.sendall(chunk)
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                while sock.recv(1 << 20):  # the pongs
                    pass
            sock.setblocking(True)
        return sock

    async def step(url: str, size: int) -> str:
        try:
            async with websockets.connect(_ws(url), max_size=None) as ws:
                await ws.send(json.dumps({"type": "step", "data": {"message": "x" * size}}))
                return str(await asyncio.wait_for(ws.recv(), 30))[:24]
        except websockets.ConnectionClosed as closed:
            return f"closed {closed.rcvd.code if closed.rcvd else None}"

    budget = ("--max-held-bytes", str(32 << 20))
    with own_server(*budget, env="support.envs:FaultyEnv") as (_server, url):
        quiet = [pinger(url, 6_300_000) for _ in range(5)]
        assert asyncio.run(step(url, 3_000_000)) == '{"type": "observation", '
        for sock in quiet:
            sock.close()

        # The flood runs in a process of its own: a thread of this one would take the
        # neighbour's GIL, not the server's loop.
        flood_script = (
            "import socket, sys, threading\n"
            f"sys.path.insert(0, {str(TESTS)!r})\n"
            "from test_openenv_gateway_attacks import frame, ws_handshake\n"
            f"sock = ws_handshake({url!r})\n"
            "def drain():\n"
            "    while sock.recv(1 << 20): pass\n"
            "threading.Thread(target=drain, daemon=True).start()\n"
            "chunk = frame(0x9, b'p' * 125) * 500\n"
            "while True: sock.sendall(chunk)\n"
        )

        async def steps(seconds: float) -> int:
            async with websockets.connect(_ws(url)) as ws:
                count, until = 0, time.monotonic() + seconds
                while time.monotonic() < until:
                    await ws.send(json.dumps({"type": "step", "data": {"message": "n"}}))
                    await asyncio.wait_for(ws.recv(), 30)
                    count += 1
                return count

        alone = asyncio.run(steps(2.0))
        flooder = subprocess.Popen([sys.executable, "-c", flood_script], cwd=TESTS)
        try:
            time.sleep(0.5)  # flooding
            beside = asyncio.run(steps(2.0))
            assert flooder.poll() is None  # still flooding, not refused
        finally:
            flooder.kill()
            flooder.wait()
    print(f"\nneighbour's steps in 2 s: {alone} alone, {beside} beside a ping flood")
    assert beside * 8 >= alone  # shared with the flood, not starved by it (before: 1/66)


@pytest.mark.fresh_server  # a server of its own: make test
def test_text_frames_that_are_not_utf8_close_1007_without_a_traceback() -> None:
    """50 sockets each send a text frame that is not UTF-8: each is closed 1007, with no
    traceback in the server's log (before: one ERROR traceback per socket, from uvicorn),
    and the door goes on."""
    bad = frame(0x1, b"\xff\xfe")
    with own_server() as (server, url):
        codes = []
        for _ in range(50):
            sock = ws_handshake(url)
            sock.sendall(bad)
            codes.append(close_code(sock))
            sock.close()
        with GenericEnvClient(base_url=url).sync() as env:
            env.reset()
            assert env.step({"message": "é"}).observation["echoed_message"] == "é"
        log = server.stderr()
    assert codes == [1007] * 50
    assert "Traceback" not in log and "Invalid UTF-8" not in log
