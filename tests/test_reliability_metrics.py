"""The Prometheus endpoint under hostile clients: bounded threads, timeouts, auth, loopback.

Every test runs a real ``openenv-grpc serve --metrics-port 0`` process and talks plain
HTTP/1.1 to it over loopback (``urllib`` for scrapes, raw sockets for the slow clients).
"""

from __future__ import annotations

import os
import re
import socket
import time
import urllib.error
import urllib.request

import pytest

from bench.h2_attacks import closed_by_peer, half_open_http
from openenv_grpc.server.metrics_endpoint import MAX_CONNECTIONS, REQUEST_TIMEOUT

_METRICS_LINE = re.compile(r"metrics on http://(\S+):(\d+)/metrics")
HALF_OPEN = 200


def _endpoint(server) -> tuple[str, int]:  # type: ignore[no-untyped-def]
    for line in server.stdout_lines:
        match = _METRICS_LINE.search(line)
        if match:
            return match.group(1), int(match.group(2))
    raise AssertionError(f"no metrics line in {server.stdout_lines}")


def _get(host: str, port: int, path: str = "/metrics", **headers: str) -> tuple[int, str]:
    """GET ``path``; returns (status, body) whatever the status."""
    request = urllib.request.Request(f"http://{host}:{port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _raw(host: str, port: int, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection; returns everything the server answered."""
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


@pytest.fixture
def metrics_server(start_server):  # type: ignore[no-untyped-def]
    return start_server("support.envs:CountingEchoEnv", "--metrics-port", "0")


def test_half_open_connections_cost_no_threads_and_are_closed_after_the_timeout(
    metrics_server,
) -> None:
    host, port = _endpoint(metrics_server)
    assert _get(host, port)[0] == 200
    threads_before = _threads(metrics_server.proc.pid)
    sockets = half_open_http(host, port, HALF_OPEN)
    try:
        opened = time.monotonic()
        time.sleep(0.5)
        # prometheus_client's server held one thread per connection, for ever.
        assert _threads(metrics_server.proc.pid) <= threads_before + 2
        # At most MAX_CONNECTIONS are kept; the server closes the rest at once, and the
        # kept ones when their request has not come within the timeout.
        deadline = opened + REQUEST_TIMEOUT + 5
        while time.monotonic() < deadline and not all(closed_by_peer(s) for s in sockets):
            time.sleep(0.2)
        still_open = sum(not closed_by_peer(s) for s in sockets)
        assert still_open == 0, f"{still_open} of {HALF_OPEN} half-open connections kept"
        assert time.monotonic() - opened <= REQUEST_TIMEOUT + 5
    finally:
        for sock in sockets:
            sock.close()
    assert _threads(metrics_server.proc.pid) <= threads_before + 2
    assert _get(host, port)[0] == 200


def test_a_scrape_is_answered_while_slow_clients_hold_every_connection(metrics_server) -> None:
    host, port = _endpoint(metrics_server)
    sockets = half_open_http(host, port, MAX_CONNECTIONS * 4)
    try:
        began = time.monotonic()
        status, body = _get(host, port)
        assert status == 200
        assert "openenv_sessions_active" in body
        # The scrape evicted a slow client instead of waiting for the timeout.
        assert time.monotonic() - began < REQUEST_TIMEOUT
    finally:
        for sock in sockets:
            sock.close()


def test_wrong_path_method_and_malformed_requests_get_precise_statuses(metrics_server) -> None:
    host, port = _endpoint(metrics_server)
    assert _get(host, port, "/")[0] == 404
    assert _get(host, port, "/metrics/../secrets")[0] == 404
    assert _get(host, port, "/metrics?name[]=openenv_sessions_active")[0] == 200
    post = _raw(host, port, b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert post.startswith(b"HTTP/1.1 405 ")
    assert b"Allow: GET" in post
    assert _raw(host, port, b"NONSENSE\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    huge = b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n"
    assert _raw(host, port, huge).startswith(b"HTTP/1.1 400 ")
    ok = _raw(host, port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert ok.startswith(b"HTTP/1.1 200 ")
    assert b"Connection: close" in ok


def test_auth_token_guards_the_endpoint(start_server) -> None:
    server = start_server(
        "support.envs:CountingEchoEnv", "--metrics-port", "0", extra_env={"AUTH_TOKEN": "s3cret"}
    )
    host, port = _endpoint(server)
    status, body = _get(host, port)
    assert status == 401
    assert "bearer token" in body
    assert _get(host, port, Authorization="Bearer wrong")[0] == 401
    assert _get(host, port, Authorization="s3cret")[0] == 401
    status, body = _get(host, port, Authorization="Bearer s3cret")
    assert status == 200
    assert "openenv_sessions_active" in body


def test_metrics_token_replaces_the_auth_token_on_the_endpoint(start_server) -> None:
    server = start_server(
        "support.envs:CountingEchoEnv",
        "--metrics-port",
        "0",
        extra_env={"AUTH_TOKEN": "for-sessions", "METRICS_TOKEN": "for-scrapes"},
    )
    host, port = _endpoint(server)
    assert _get(host, port)[0] == 401
    assert _get(host, port, Authorization="Bearer for-sessions")[0] == 401
    assert _get(host, port, Authorization="Bearer for-scrapes")[0] == 200


def test_metrics_token_alone_guards_the_endpoint(start_server) -> None:
    server = start_server(
        "support.envs:CountingEchoEnv",
        "--metrics-port",
        "0",
        extra_env={"METRICS_TOKEN": "for-scrapes"},
    )
    host, port = _endpoint(server)
    assert _get(host, port)[0] == 401
    assert _get(host, port, Authorization="Bearer for-scrapes")[0] == 200
    # The gRPC side needs no token: METRICS_TOKEN is only the endpoint's.
    assert server.active() == 0


def test_metrics_listen_on_loopback_whatever_the_grpc_host(start_server) -> None:
    # gRPC on the IPv6 loopback: the metrics endpoint still takes 127.0.0.1, not HOST.
    server = start_server("support.envs:CountingEchoEnv", "--metrics-port", "0", "--host", "::1")
    host, port = _endpoint(server)
    assert host == "127.0.0.1"
    assert _get(host, port)[0] == 200
    moved = start_server(
        "support.envs:CountingEchoEnv", "--metrics-port", "0", "--metrics-host", "::1"
    )
    host, port = _endpoint(moved)
    assert host == "[::1]"
    assert _get(host, port)[0] == 200
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
