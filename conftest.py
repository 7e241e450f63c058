"""Shared fixtures for tests/ and envs/*/tests: real server processes on loopback ports,
and the ledgers in which test envs record their creation and close."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
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


class SharedServerView:
    """One test's view of a module's shared counting echo server: envs created and closed,
    and stderr, count from the test's start; everything else is the server's own."""

    def __init__(self, server: LedgerServer) -> None:
        self._server = server
        self._created = server.created()
        self._closed = server.closed_envs()
        self._stderr_at = len(server.stderr())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)

    def created(self) -> int:
        return self._server.created() - self._created

    def closed_envs(self) -> int:
        return self._server.closed_envs() - self._closed

    def stderr(self) -> str:
        return self._server.stderr()[self._stderr_at :]


class SharedServers:
    """The module's one default server, started on first use and started again only after
    a test left it unusable (killed, drained, or with a session still open)."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._server: LedgerServer | None = None
        self.starts = 0

    def get(self) -> LedgerServer:
        if self._server is None or self._server.proc.poll() is not None:
            self.discard()
            ledger = self._root / f"shared{self.starts}"
            ledger.mkdir()
            self._server = LedgerServer("support.envs:CountingEchoEnv", [], {}, ledger)
            self.starts += 1
        return self._server

    def settle(self) -> None:
        """After a test: keep the server only if it is alive and holds nothing."""
        server = self._server
        if server is None:
            return
        try:
            if server.proc.poll() is None:
                server.wait_until(
                    lambda: server.active() == 0 and server.open_envs() == 0, timeout=5
                )
                return
        except (AssertionError, grpc.RpcError):
            pass
        self.discard()

    def discard(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


@pytest.fixture(scope="module")
def _shared_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedServers]:
    shared = SharedServers(tmp_path_factory.mktemp("shared-server"))
    yield shared
    shared.discard()


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A counting echo server with default settings: the module's shared one in modules
    marked ``shared_server`` (counts relative to the test), else a fresh one."""
    if request.node.get_closest_marker("shared_server") is None:
        # Asked for here, not in the signature: a shared-server test must not need it.
        start: StartServer = request.getfixturevalue("start_server")
        yield start()
        return
    shared: SharedServers = request.getfixturevalue("_shared_servers")
    yield SharedServerView(shared.get())
    shared.settle()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "shared_server: the `server` fixture is the module's one shared server"
    )
    config.addinivalue_line(
        "markers", "slow: heavy (containers, proxies, browsers, fuzzers, attacks): not in test-fast"
    )
    config.addinivalue_line(
        "markers",
        "fresh_server: starts a server of its own (set by conftest for start_server and an "
        "unshared `server`; by hand on tests that start ServerProcess): not in test-fast",
    )


#: Test files that need heavy parts (containers, proxies, a browser, other languages' clients,
#: model training, fuzzers, benches, attack floods, cluster engines): marked ``slow``,
#: so ``make test-fast`` leaves them to ``make test``.
SLOW_FILES = frozenset({
    "tests/test_docker.py", "tests/test_swarm.py", "tests/test_envoy.py",
    "tests/test_console_browser.py", "tests/test_polyglot_clients.py",
    "tests/test_trl_training.py", "tests/test_examples_training.py",
    "tests/test_examples_fork.py", "tests/test_fuzz_bounded.py",
    "tests/test_fuzz_properties.py", "tests/test_chaos.py", "tests/test_bench_smoke.py",
    "tests/test_vector_bench_smoke.py", "tests/test_bench_snapshots.py",
    "tests/test_scaffold.py", "tests/test_snapshot_envs.py", "tests/test_sb3.py",
    "tests/test_reliability_http2.py", "tests/test_reliability_isolated.py",
    "tests/test_reliability_metrics.py", "tests/test_reliability_sessions.py",
    "tests/test_reliability_snapshots.py", "tests/test_reliability_vectors.py",
    "tests/test_slurm.py", "tests/test_ray.py", "tests/test_fleet.py",
    "envs/coding/tests/test_reliability_sandbox.py", "envs/coding/tests/test_coding.py",
})  # fmt: skip
#: Test files that share what the machine has once, by group: the private dockerd (the
#: container tests and the swarm's images), and the coding env's registry, cgroups, uid
#: leases and kernel keys (a coding server reclaims what dead servers left there). Under
#: pytest-xdist (``make test``) a group's files run one after another on one worker.
MACHINE_GROUPS = {
    "tests/test_docker.py": "docker", "tests/test_swarm.py": "docker",
    "envs/coding/tests/": "coding",
    # They serve the coding env too: its start would reclaim (and so log) what a coding
    # test killed a server to see the next one reclaim.
    "tests/test_snapshot_envs.py": "coding", "tests/test_trl_environment.py": "coding",
}  # fmt: skip
ROOT = Path(__file__).resolve().parent


def xdist_group(path: str) -> str:
    """The pytest-xdist work unit of a test file: its machine group, else the file itself
    (so its module-scoped servers start once, on one worker)."""
    for prefix, group in MACHINE_GROUPS.items():
        if path.startswith(prefix):
            return group
    return path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` (``make test``): each worker takes whole files, and a machine
    group's files all go to one worker. pytest-xdist's own loadgroup reads marks into node
    ids in a way pytest 9 no longer keeps (it sets ``_nodeid``), so the groups are made
    here from the paths, with its file scheduler (largest units first)."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid.split("::", 1)[0])

    return FileGroupScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests that start a server process of their own (``fresh_server``): those
    whose fixtures reach ``start_server`` / ``start_console``, or a ``server`` made per
    test."""
    for item in items:
        if item.path.relative_to(ROOT).as_posix() in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
        names = set(getattr(item, "fixturenames", ()))
        if names & {"start_server", "start_console"} or _fresh_server_fixture(item):
            item.add_marker(pytest.mark.fresh_server)


def _fresh_server_fixture(item: pytest.Item) -> bool:
    """The test's ``server`` is one per test: the function-scoped ``server`` above outside
    a ``shared_server`` module. A module's own ``server`` of module scope (the gymnasium
    and adapter tests') is started once for all its tests: those are not fresh."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.get("server") if info is not None else None
    if not defs:
        return False
    return defs[-1].scope == "function" and item.get_closest_marker("shared_server") is None
