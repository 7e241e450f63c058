"""Containers on a real Docker daemon: the echo image built from the local (registry-free)
base, ``LocalDockerProvider`` running an episode through it, and no container left behind,
also when the owning process is SIGKILLed between start and stop.

The daemon is the one ``DOCKER_HOST`` names, else scripts/start_dockerd.sh starts one
(host networking only: ``--bridge=none``). The first build on a fresh machine takes about
two and a half minutes (debootstrap ~90 s, image ~55 s); .ci/run builds both before the
tests, so here they are cache hits.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
from docker.errors import NotFound

from openenv_grpc import SessionRefused
from openenv_grpc.providers import ProviderError
from openenv_grpc.providers.docker_provider import (
    LABEL_OWNER_PID,
    LABEL_PROVIDER,
    LocalDockerProvider,
    cleanup_orphans,
    docker_client,
)
from openenv_grpc_envs.echo import AsyncEchoEnv, EchoAction, EchoEnv, EchoResetOptions

ROOT = Path(__file__).resolve().parent.parent

# The fixtures may build the base and the image on a fresh machine (see the module doc).
pytestmark = pytest.mark.timeout(600)

# A child that starts a container and then waits to be SIGKILLed before it can clean up.
CHILD = """
import json, sys, time
from openenv_grpc.providers.docker_provider import LocalDockerProvider
provider = LocalDockerProvider(
    sys.argv[1], watchdog=sys.argv[2] == "1", grace=2, labels={"org.openenv-grpc.test": sys.argv[3]}
)
provider.start()
print(json.dumps({"name": provider.name, "target": provider.target}), flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def client() -> Iterator[docker.DockerClient]:
    """A client of the daemon at DOCKER_HOST, or of one scripts/start_dockerd.sh starts."""
    saved = os.environ.get("DOCKER_HOST")
    if not saved:
        out = subprocess.run(
            ["bash", str(ROOT / "scripts/start_dockerd.sh")],
            check=True, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        os.environ["DOCKER_HOST"] = out.stdout.strip().splitlines()[-1]
    client = docker_client()
    yield client
    client.close()
    if not saved:
        del os.environ["DOCKER_HOST"]


@pytest.fixture(scope="module")
def echo_image(client: docker.DockerClient) -> str:
    """The echo image, built from the registry-free base (a cache hit after the first)."""
    started = time.monotonic()
    out = subprocess.run(
        ["bash", str(ROOT / "deploy/docker/build_image.sh"), "echo"],
        env={**os.environ, "BASE_IMAGE": os.environ.get("OPENENV_TEST_BASE_IMAGE", "local")},
        capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    print(f"echo image ready in {time.monotonic() - started:.1f}s")
    return out.stdout.strip().splitlines()[-1]


def labelled(client: docker.DockerClient, label: str) -> list[str]:
    """Names of the containers (any state) that carry ``label``."""
    return [c.name or "" for c in client.containers.list(all=True, filters={"label": label})]


def wait_until_gone(client: docker.DockerClient, label: str, timeout: float) -> list[str]:
    """Poll until no container carries ``label``; returns those still there at the end."""
    deadline = time.monotonic() + timeout
    while (left := labelled(client, label)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_image_runs_as_non_root_with_grpc_healthcheck(
    client: docker.DockerClient, echo_image: str
) -> None:
    config = client.images.get(echo_image).attrs["Config"]
    assert config["User"] == "10001:10001"
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["HOST"] == "0.0.0.0"
    assert env["OPENENV_ENV"] == "echo"
    assert {"PORT", "MAX_CONCURRENT_ENVS", "WORKERS"} <= env.keys()
    probe = config["Healthcheck"]["Test"]
    assert "grpc_health.v1" in " ".join(probe)
    # No build tools and no pip in the final image.
    tools = client.containers.run(
        echo_image, entrypoint=["sh", "-c", "command -v gcc cc make pip pip3; true"],
        network_mode="host", remove=True,
    )  # fmt: skip
    assert tools.strip() == b""
    # The probe fails (non-zero) when nothing serves on $PORT.
    with pytest.raises(docker.errors.ContainerError):
        client.containers.run(
            echo_image, entrypoint=probe[1:], environment={"PORT": "9"},
            network_mode="host", remove=True,
        )  # fmt: skip


def test_episode_through_a_container_then_it_is_gone(
    client: docker.DockerClient, echo_image: str
) -> None:
    tag = uuid.uuid4().hex
    label = f"org.openenv-grpc.test={tag}"
    with LocalDockerProvider(
        echo_image, cpus=1, mem_limit="256m", pids_limit=256, max_concurrent_envs=2, grace=2,
        labels={"org.openenv-grpc.test": tag},
    ) as provider:  # fmt: skip
        assert provider.container is not None
        provider.container.reload()
        host = provider.container.attrs["HostConfig"]
        assert host["NetworkMode"] == "host"
        assert (host["NanoCpus"], host["Memory"], host["PidsLimit"]) == (10**9, 256 << 20, 256)
        labels = provider.container.labels
        assert labels[LABEL_PROVIDER] == "docker"
        assert labels[LABEL_OWNER_PID] == str(os.getpid())
        assert provider.target.startswith("127.0.0.1:")

        with provider.session(EchoEnv) as env:
            first = env.reset(seed=3, options=EchoResetOptions(max_steps=2))
            assert first.step_count == 0
            one = env.step(EchoAction(message="hey"))
            two = env.step(EchoAction(message="you"))
            assert one.observation.echoed_message == "hey"
            assert one.reward == pytest.approx(0.3)
            assert (one.truncated, two.truncated, two.step_count) == (False, True, 2)
            assert env.state().total_length == 6
        # The image's own HEALTHCHECK command answers 0 while the server is SERVING.
        probe = client.images.get(echo_image).attrs["Config"]["Healthcheck"]["Test"][1:]
        assert provider.container.exec_run(probe).exit_code == 0
        # A live owner's container is never an orphan.
        assert provider.name not in cleanup_orphans(client)
        assert labelled(client, label) == [provider.name]
        name = provider.name
    assert labelled(client, label) == []
    with pytest.raises(NotFound):
        client.containers.get(name)
    assert "drained, every environment closed" in provider.logs()


def start_child(
    image: str, watchdog: bool, tag: str
) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """A child process that started a container through the provider and now sleeps."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, image, "1" if watchdog else "0", tag],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line:
        child.wait(10)
        pytest.fail(
            f"child did not start a container:\n{child.stderr.read() if child.stderr else ''}"
        )
    return child, json.loads(line)


def test_sigkilled_owner_watchdog_removes_the_container(
    client: docker.DockerClient, echo_image: str
) -> None:
    tag = uuid.uuid4().hex
    label = f"org.openenv-grpc.test={tag}"
    child, started = start_child(echo_image, watchdog=True, tag=tag)
    assert labelled(client, label) == [started["name"]]
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    # Nobody cleans up: the watchdog sees the lease free, stops the server, and the
    # daemon removes the (auto_remove) container.
    assert wait_until_gone(client, label, timeout=30) == []


def test_sigkilled_owner_cleanup_orphans_removes_the_container(
    client: docker.DockerClient, echo_image: str
) -> None:
    tag = uuid.uuid4().hex
    label = f"org.openenv-grpc.test={tag}"
    child, started = start_child(echo_image, watchdog=False, tag=tag)
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    # Without the watchdog the container keeps running after its owner died...
    time.sleep(1.0)
    assert labelled(client, label) == [started["name"]]
    # ...until the next provider start or cleanup_orphans() removes it.
    assert started["name"] in cleanup_orphans(client)
    assert wait_until_gone(client, label, timeout=30) == []


def test_a_session_from_a_docker_image_owns_its_container(
    client: docker.DockerClient, echo_image: str
) -> None:
    """The one-liner: ``with EchoEnv.from_docker_image(image) as env`` starts a container of
    its own and the container goes with the session (sync and asyncio alike)."""
    tag = uuid.uuid4().hex
    label = f"org.openenv-grpc.test={tag}"
    kwargs: dict[str, Any] = {"grace": 2, "labels": {"org.openenv-grpc.test": tag}}
    with EchoEnv.from_docker_image(echo_image, **kwargs) as env:
        assert len(labelled(client, label)) == 1
        env.reset(seed=1)
        assert env.step(EchoAction(message="boxed")).observation.echoed_message == "boxed"
    assert labelled(client, label) == []

    async def main() -> None:
        env = await AsyncEchoEnv.from_docker_image(echo_image, **kwargs)
        async with env:
            assert len(labelled(client, label)) == 1
            await env.reset()
            result = await env.step(EchoAction(message="async"))
            assert result.observation.echoed_message == "async"

    asyncio.run(main())
    assert labelled(client, label) == []


def test_a_docker_image_session_that_fails_to_open_leaves_no_container(
    client: docker.DockerClient, echo_image: str
) -> None:
    tag = uuid.uuid4().hex
    label = f"org.openenv-grpc.test={tag}"
    env = EchoEnv.from_docker_image(
        echo_image, labels={"org.openenv-grpc.test": tag}, extra_env={"AUTH_TOKEN": "secret"}
    )
    with pytest.raises(SessionRefused, match="UNAUTHENTICATED"):
        env.open()  # no token: refused, and the container it started is removed
    assert labelled(client, label) == []
    with pytest.raises(ProviderError, match=r"no image 'openenv-grpc-no-such-image:0'"):
        EchoEnv.from_docker_image("openenv-grpc-no-such-image:0", labels={"x": tag})
