"""Shared fixtures for tests/ and envs/*/tests: real server processes on loopback ports,
and the ledgers in which test envs record their creation and close."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from openenv_grpc import fetch_info
from openenv_grpc.v1 import session_pb2 as pb

TESTS = Path(__file__).resolve().parent / "tests"
_SERVING = re.compile(r"openenv-grpc: serving (\S+) on (\S+):(\d+)")


class ServerProcess:
    """``openenv-grpc serve`` as a child process on a free loopback port."""

    def __init__(self, env: str, args: list[str], extra_env: dict[str, str], ledger: Path):
        self.ledger = ledger
        environ = {**os.environ, "OPENENV_TEST_LEDGER": str(ledger), **extra_env}
        environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), environ.get("PYTHONPATH", "")])
        self.stderr_path = ledger.parent / f"{ledger.name}.stderr"
        self._stderr = self.stderr_path.open("w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "openenv_grpc",
                "serve",
                env,
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=environ,
            text=True,
        )
        self.port = self._wait_for_port(timeout=30)
        self.target = f"127.0.0.1:{self.port}"
        self.stdout_lines: list[str] = []
        self._reader = threading.Thread(target=self._drain_stdout, daemon=True)
        self._reader.start()

    def _wait_for_port(self, timeout: float) -> int:
        assert self.proc.stdout is not None
        result: list[int] = []

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                match = _SERVING.search(line)
                if match:
                    result.append(int(match.group(3)))
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        if not result:
            self.proc.kill()
            raise RuntimeError(f"server did not start:\n{self.stderr()}")
        return result[0]

    def _drain_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout_lines.append(line)

    def stderr(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text()

    # -- observation ------------------------------------------------------------------

    def info(self) -> pb.InfoResponse:
        return fetch_info(self.target)

    def active(self) -> int:
        return self.info().capacity.active_sessions

    def created(self) -> int:
        return len(list(self.ledger.iterdir()))

    def open_envs(self) -> int:
        return len(list(self.ledger.glob("*.open")))

    def closed_envs(self) -> int:
        return len(list(self.ledger.glob("*.closed")))

    def health(self, service: str = "") -> int:
        with grpc.insecure_channel(self.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def wait_until(self, predicate, timeout: float = 10.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")

    # -- ending -----------------------------------------------------------------------

    def terminate(self, timeout: float = 30.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._stderr.close()


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator:  # type: ignore[type-arg]
    """Start servers: ``start_server("echo", "--max-concurrent-envs", "2")``."""
    servers: list[ServerProcess] = []

    def start(
        env: str = "support.envs:CountingEchoEnv",
        *args: str,
        extra_env: dict[str, str] | None = None,
    ) -> ServerProcess:
        ledger = tmp_path / f"ledger{len(servers)}"
        ledger.mkdir()
        server = ServerProcess(env, list(args), extra_env or {}, ledger)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def server(start_server) -> ServerProcess:  # type: ignore[no-untyped-def]
    """A counting echo server with default settings."""
    return start_server()
