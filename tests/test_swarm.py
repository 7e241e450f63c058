"""``DockerSwarmProvider`` on a real Docker swarm: a real dockerd in swarm mode, a real
service with real replicas, real gRPC sessions.

``docker swarm init`` makes private-range networks, which never go on the host here, so the
``swarm`` fixture runs a second, private dockerd inside a network namespace it creates
(tests/support/swarm_daemon.py), with the echo image copied over from the main daemon
(``docker save | docker load``, ~4 s). The provider and the sessions run inside that
namespace too (tests/support/swarm_client.py via ``nsenter``); assertions about what is left
use the daemon's unix socket from here.

Replicas share one port on the node's network (``endpoint="host"``, SO_REUSEPORT): this
kernel has no IPVS, so swarm's routing mesh cannot balance; ``test_ingress_...`` checks
that the provider says so and leaves nothing (or, on a kernel with IPVS, that it works).

Time: the fixture takes ~6 s on this machine (namespace + dockerd + swarm init ~1 s, image
copy ~4 s, teardown ~2 s) once the echo image exists on the main daemon (.ci/run builds it;
a first build on a fresh machine takes minutes). The whole module takes about a minute.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from openenv_grpc.providers.base import ProviderError
from openenv_grpc.providers.docker_provider import LABEL_OWNER_PID, LABEL_PROVIDER
from openenv_grpc.providers.swarm import DockerSwarmProvider, cleanup_orphan_services
from support.swarm_daemon import SwarmDaemon

ROOT = Path(__file__).resolve().parent.parent
CLIENT = str(ROOT / "tests/support/swarm_client.py")

# The fixtures may build the echo image on a fresh machine (see the module doc).
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def main_docker_url() -> str:
    """The main daemon: DOCKER_HOST, else the one scripts/start_dockerd.sh starts (it is
    shared with other tests and never stopped here)."""
    url = os.environ.get("DOCKER_HOST")
    if not url:
        out = subprocess.run(
            ["bash", str(ROOT / "scripts/start_dockerd.sh")],
            check=True, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        url = out.stdout.strip().splitlines()[-1]
    return url


@pytest.fixture(scope="module")
def main_docker(main_docker_url: str) -> Iterator[docker.DockerClient]:
    """A client of the main daemon."""
    client = docker.DockerClient(base_url=main_docker_url)
    client.ping()
    yield client
    client.close()


@pytest.fixture(scope="module")
def echo_image(main_docker_url: str) -> str:
    """The echo image on the main daemon, from the registry-free base (a cache hit)."""
    out = subprocess.run(
        ["bash", str(ROOT / "deploy/docker/build_image.sh"), "echo"],
        env={
            **os.environ,
            "DOCKER_HOST": main_docker_url,
            "BASE_IMAGE": os.environ.get("OPENENV_TEST_BASE_IMAGE", "local"),
        },
        capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def swarm(main_docker: docker.DockerClient, echo_image: str) -> Iterator[SwarmDaemon]:
    """A single-node swarm in a network namespace of its own, holding the echo image."""
    started = time.monotonic()
    daemon = SwarmDaemon()
    try:
        daemon.start()
        daemon.load_image(main_docker, echo_image)
        print(f"swarm ready in {time.monotonic() - started:.1f}s")
        yield daemon
    finally:
        stopping = time.monotonic()
        daemon.stop()
        print(f"swarm torn down in {time.monotonic() - stopping:.1f}s")
    assert not Path(f"/run/netns/{daemon.netns}").exists()
    assert not daemon.data_root.exists() and not daemon.exec_root.exists()


def params(swarm: SwarmDaemon, image: str, **more: Any) -> dict[str, Any]:
    return {"url": swarm.url, "image": image, "tag": uuid.uuid4().hex, **more}


def run_client(swarm: SwarmDaemon, scenario: str, args: dict[str, Any]) -> dict[str, Any]:
    """Run a scenario of tests/support/swarm_client.py inside the namespace."""
    out = swarm.run_inside([sys.executable, CLIENT, scenario, json.dumps(args)], timeout=150)
    assert out.returncode == 0 and out.stdout.strip(), (
        f"client failed ({out.returncode}):\n{out.stderr[-6000:]}"
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def service_names(swarm: SwarmDaemon, tag: str) -> list[str]:
    services = swarm.client.services.list(filters={"label": f"org.openenv-grpc.test={tag}"})
    return [s.name or "" for s in services]


def service_containers(swarm: SwarmDaemon, name: str) -> list[str]:
    label = f"com.docker.swarm.service.name={name}"
    containers = swarm.client.containers.list(all=True, sparse=True, filters={"label": label})
    return [c.id or "" for c in containers]


def wait_until(what: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.2)


def test_replicas_serve_sessions_through_one_address_and_stop_leaves_nothing(
    swarm: SwarmDaemon, echo_image: str
) -> None:
    result = run_client(swarm, "episodes", params(swarm, echo_image, sessions=12))
    assert result["target"].startswith("127.0.0.1:")
    # A full episode through the provider's own session...
    assert result["sync_episode"] == {
        "first_step": 0,
        "echoed": ["a", "bb", "ccc"],
        "truncated": [False, False, True],
        "total_length": 6,
    }
    assert result["second_session"] == "x"  # a second p.session(EchoEnv)
    # ...and 12 more at once, one connection each, all through the one address: they landed
    # on more than one replica (each replica admits a different number: 110, 120, 130).
    sessions = result["sessions"]
    assert len(sessions) == 12
    assert all(s["total_length"] == len(f"s{i}") + 3 for i, s in enumerate(sessions))
    replicas = Counter(s["replica"] for s in sessions)
    assert set(replicas) <= {110, 120, 130}
    assert len(replicas) >= 2, f"every session on one replica: {replicas}"
    for replica, count in replicas.items():  # they were all open at once, there
        actives = [s["active"] for s in sessions if s["replica"] == replica]
        assert min(actives) >= count, (replica, actives)
    # One service, 3 replicas on the host network, owner-labelled, limits applied.
    service = result["service"]
    assert service["replicas"] == 3 and service["networks"] == ["host"]
    assert service["labels"][LABEL_PROVIDER] == "swarm"
    assert service["labels"][LABEL_OWNER_PID].isdigit()
    assert service["limits"] == {"NanoCPUs": 10**9, "MemoryBytes": 256 << 20}
    assert result["running_tasks"] == 3 and result["running_containers"] == 3
    assert result["logs"].count("openenv-grpc: serving echo on") == 3
    # stop(): no service, no container; the watchdog exited with it.
    assert result["left_services"] == [] and result["left_containers"] == []
    assert result["watchdog_exit"] == 0
    print(f"start {result['start_s']}s, stop {result['stop_s']}s, replicas hit {replicas}")


def hold(
    swarm: SwarmDaemon, image: str, replicas: int, **options: Any
) -> tuple[subprocess.Popen[str], dict[str, Any], str]:
    """A client process that started a service through the provider and now sleeps."""
    args = params(swarm, image, replicas=replicas, options=options)
    child = swarm.popen_inside(
        [sys.executable, CLIENT, "hold", json.dumps(args)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert child.stdout is not None and child.stderr is not None
    line = child.stdout.readline()
    if not line:
        child.wait(10)
        pytest.fail(f"the client did not start a service:\n{child.stderr.read()[-4000:]}")
    return child, json.loads(line), args["tag"]


def test_sigkilled_owner_the_watchdog_removes_the_service(
    swarm: SwarmDaemon, echo_image: str
) -> None:
    child, started, tag = hold(swarm, echo_image, replicas=2)
    assert service_names(swarm, tag) == [started["name"]]
    assert len(service_containers(swarm, started["name"])) == 2
    # A live owner's service is never an orphan.
    assert started["name"] not in cleanup_orphan_services(swarm.client)
    child.send_signal(signal.SIGKILL)  # between start and stop: no chance to clean up
    child.wait(10)
    killed = time.monotonic()
    # Nobody else cleans up: the watchdog got the lease and removed the service.
    wait_until("the service removed", lambda: service_names(swarm, tag) == [], 30)
    removed = time.monotonic() - killed
    wait_until("its containers gone", lambda: not service_containers(swarm, started["name"]), 40)
    wait_until("the watchdog exited", lambda: not _alive(started["watchdog_pid"]), 20)
    print(
        f"after SIGKILL: service gone in {removed:.1f}s, containers in "
        f"{time.monotonic() - killed:.1f}s"
    )


def test_sigkilled_owner_without_watchdog_cleanup_orphan_services_removes_it(
    swarm: SwarmDaemon, echo_image: str
) -> None:
    child, started, tag = hold(swarm, echo_image, replicas=1, watchdog=False)
    assert started["watchdog_pid"] is None
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    time.sleep(0.5)
    # Without the watchdog the service outlives its owner...
    assert service_names(swarm, tag) == [started["name"]]
    # ...until the next provider start or cleanup_orphan_services() removes it.
    assert started["name"] in cleanup_orphan_services(swarm.client)
    assert service_names(swarm, tag) == []
    wait_until("its containers gone", lambda: not service_containers(swarm, started["name"]), 40)


def test_a_missing_image_fails_with_the_task_error_and_leaves_nothing(swarm: SwarmDaemon) -> None:
    result = run_client(swarm, "fail", params(swarm, "openenv-grpc-no-such-image:1", replicas=2))
    assert result["error"] is not None
    assert "No such image: openenv-grpc-no-such-image:1" in result["error"], result["error"]
    assert "rejected" in result["error"]
    assert result["left_services"] == [] and result["left_containers"] == []


def test_failing_replicas_fail_with_their_output_and_leave_nothing(
    swarm: SwarmDaemon, echo_image: str
) -> None:
    options = {"extra_env": {"OPENENV_ENV": "no-such-env"}}
    result = run_client(swarm, "fail", params(swarm, echo_image, options=options))
    error = result["error"]
    assert error is not None
    assert "failed, exit code 2" in error, error  # the task's state and exit code
    assert "no environment named 'no-such-env'" in error, error  # the server's own words
    assert result["left_services"] == [] and result["left_containers"] == []


def test_ingress_routing_mesh_works_or_says_why_and_leaves_nothing(
    swarm: SwarmDaemon, echo_image: str
) -> None:
    result = run_client(swarm, "ingress", params(swarm, echo_image, replicas=2))
    assert result["left_services"] == [] and result["left_containers"] == []
    if result["ipvs"]:  # a kernel with IPVS: the mesh balances connections over replicas
        assert result["error"] is None, result["error"]
        assert len({s["replica"] for s in result["sessions"]}) == 2
    else:  # this machine: every replica serves, the mesh cannot; the error says why
        assert result["error"] is not None
        assert "IPVS" in result["error"] and "this kernel has none" in result["error"]
        assert "endpoint='host'" in result["error"]


def test_a_daemon_that_is_not_a_swarm_manager_is_refused(main_docker: docker.DockerClient) -> None:
    provider = DockerSwarmProvider("any-image", client=main_docker, start_timeout=5)
    with pytest.raises(ProviderError, match="not a swarm manager"):
        provider.start()
    with pytest.raises(ProviderError):
        _ = provider.target


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return not stat[stat.rfind(")") + 2 :].startswith("Z")
