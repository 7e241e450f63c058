"""``tests/support/servers.py::started_together``: a module's servers start at once, and
when one cannot start, the ones that did are stopped and its error is raised."""

from __future__ import annotations

import pytest

from openenv_grpc.testing import ServerProcess
from support.servers import started_together


class _NoStart(Exception):
    pass


def _fails() -> ServerProcess:
    raise _NoStart("this role cannot start")


@pytest.mark.fresh_server  # one real server of its own
def test_a_role_that_cannot_start_stops_the_ones_that_did() -> None:
    started: list[ServerProcess] = []

    def echo() -> ServerProcess:
        server = ServerProcess("echo")
        started.append(server)
        return server

    with (
        pytest.raises(_NoStart, match="this role cannot start"),
        started_together({"echo": echo, "broken": _fails}),
    ):
        pytest.fail("the body must not run when a role did not start")
    assert len(started) == 1
    assert started[0].proc.poll() is not None, "the started server was left running"


@pytest.mark.fresh_server
def test_every_role_started_is_stopped_after_the_body() -> None:
    with started_together(
        {"a": lambda: ServerProcess("echo"), "b": lambda: ServerProcess("echo")}
    ) as servers:
        assert sorted(servers) == ["a", "b"]
        assert all(server.info().env_name == "echo" for server in servers.values())
        procs = [server.proc for server in servers.values()]
    assert all(proc.poll() is not None for proc in procs)
