"""Shared fixtures for tests/ and envs/*/tests: real server processes on loopback ports,
and the ledgers in which test envs record their creation and close."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from openenv_grpc.testing import ServerProcess

TESTS = Path(__file__).resolve().parent / "tests"


class LedgerServer(ServerProcess):
    """A server whose test envs (tests/support/envs.py) record their life in ``ledger``."""

    def __init__(self, env: str, args: list[str], extra_env: dict[str, str], ledger: Path):
        self.ledger = ledger
        super().__init__(
            env, args, {"OPENENV_TEST_LEDGER": str(ledger), **extra_env}, pythonpath=[TESTS]
        )

    def created(self) -> int:
        return len(list(self.ledger.iterdir()))

    def open_envs(self) -> int:
        return len(list(self.ledger.glob("*.open")))

    def closed_envs(self) -> int:
        return len(list(self.ledger.glob("*.closed")))


StartServer = Callable[..., LedgerServer]


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[StartServer]:
    """Start servers: ``start_server("echo", "--max-concurrent-envs", "2")``."""
    servers: list[LedgerServer] = []

    def start(
        env: str = "support.envs:CountingEchoEnv",
        *args: str,
        extra_env: dict[str, str] | None = None,
    ) -> LedgerServer:
        ledger = tmp_path / f"ledger{len(servers)}"
        ledger.mkdir()
        server = LedgerServer(env, list(args), extra_env or {}, ledger)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def server(start_server: StartServer) -> LedgerServer:
    """A counting echo server with default settings."""
    return start_server()
