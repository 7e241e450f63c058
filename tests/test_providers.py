"""Providers: LocalProcessProvider against real servers; KubernetesProvider's rendered
objects (validated offline, strictly) and its API calls against a loopback stand-in for
the Kubernetes API server."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
import kubernetes
import kubernetes_validate
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from openenv_grpc.client import SessionRefused, fetch_info
from openenv_grpc.metadata import SERVICE_NAME
from openenv_grpc.providers import (
    KubernetesProvider,
    LocalProcessProvider,
    ProviderError,
)
from openenv_grpc_envs.echo import AsyncEchoEnv, EchoAction, EchoEnv

# -- LocalProcessProvider -------------------------------------------------------------


def health(target: str, service: str) -> int:
    with grpc.insecure_channel(target) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return int(health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status)


def test_local_provider_starts_healthy_serves_sessions_and_drains_on_stop() -> None:
    with LocalProcessProvider("echo", max_concurrent_envs=4, grace=5) as provider:
        assert provider.target.startswith("127.0.0.1:") and provider.running()
        # start() returned only once the env service was SERVING.
        assert health(provider.target, SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
        assert fetch_info(provider.target).capacity.max_sessions == 4
        with provider.session(EchoEnv) as env:
            env.reset(seed=1)
            assert env.step(EchoAction(message="hi")).observation.echoed_message == "hi"
            assert fetch_info(provider.target).capacity.active_sessions == 1

        async def rollout() -> str:
            async with provider.session(AsyncEchoEnv) as env:
                await env.reset(seed=3)
                return (await env.step(EchoAction(message="async"))).observation.echoed_message

        assert asyncio.run(rollout()) == "async"
    # SIGTERM drained it: exit code 0 and the server's last line.
    assert not provider.running() and provider.returncode == 0
    assert any("drained" in line for line in provider.stdout_lines)


def test_a_launched_session_owns_its_server_sync_and_async() -> None:
    provider = LocalProcessProvider("echo", grace=2)
    with EchoEnv.launch(provider) as env:
        assert provider.running()
        env.reset(seed=1)
        assert env.step(EchoAction(message="mine")).observation.echoed_message == "mine"
    assert not provider.running() and provider.returncode == 0  # drained with the session

    async def rollout() -> tuple[LocalProcessProvider, str]:
        other = LocalProcessProvider("echo", grace=2)
        env = await AsyncEchoEnv.launch(other)
        async with env:
            await env.reset()
            echoed = (await env.step(EchoAction(message="async"))).observation.echoed_message
        return other, echoed

    other, echoed = asyncio.run(rollout())
    assert echoed == "async" and not other.running()


def test_a_launched_session_that_cannot_open_stops_its_server() -> None:
    provider = LocalProcessProvider("echo", extra_env={"AUTH_TOKEN": "secret"})
    env = EchoEnv.launch(provider)
    with pytest.raises(SessionRefused, match="UNAUTHENTICATED"):
        env.open()
    assert not provider.running()


def test_local_provider_leaves_no_child_when_the_body_raises() -> None:
    provider = LocalProcessProvider("echo", grace=1)
    with pytest.raises(ZeroDivisionError), provider:
        env = provider.session(EchoEnv)
        env.open()  # an open session does not keep the server alive
        pid = provider.pid
        1 / 0  # noqa: B018
    assert pid is not None and not provider.running()
    assert provider.returncode is not None
    # Nothing listens there any more.
    with pytest.raises(SessionRefused), EchoEnv(f"127.0.0.1:{provider.port}") as again:
        again.reset()
    env.abort()


def test_local_provider_kills_a_server_that_outlives_its_stop_timeout() -> None:
    # A 60 s grace with a session open on a channel of its own (stop() closes only the
    # provider's channels): SIGTERM alone would take a minute.
    provider = LocalProcessProvider("echo", grace=60, stop_timeout=1)
    with provider:
        env = EchoEnv(provider.target)
        env.open()
        env.reset()
    assert provider.returncode == -9  # SIGKILL after the stop timeout
    env.abort()


def test_local_provider_start_failure_reports_stderr_and_leaves_nothing() -> None:
    provider = LocalProcessProvider("no-such-env-anywhere", start_timeout=30)
    with pytest.raises(ProviderError) as failure:
        provider.start()
    assert "stderr" in str(failure.value)
    assert not provider.running()
    with pytest.raises(ProviderError):
        _ = LocalProcessProvider("echo").target  # not started: no target


# -- KubernetesProvider: rendering ----------------------------------------------------


def custom_provider(**kwargs: Any) -> KubernetesProvider:
    return KubernetesProvider(
        "wordle-pool",
        image="registry.example/openenv-grpc-wordle:1.2",
        env="wordle",
        namespace="rl",
        replicas=5,
        port=7000,
        metrics_port=7001,
        max_concurrent_envs=256,
        grace_period=60,
        requests={"cpu": "1", "memory": "1Gi"},
        limits={"cpu": "4", "memory": "4Gi"},
        extra_env={"IDLE_TIMEOUT": "120"},
        labels={"team": "rl"},
        **kwargs,
    )


def test_rendered_objects_validate_strictly() -> None:
    for provider in (custom_provider(), KubernetesProvider("e", image="i")):
        for manifest in provider.render():
            for version in ("1.27.0", kubernetes_validate.utils.latest_version()):
                kubernetes_validate.validate(manifest, version, strict=True)


def test_rendered_deployment_probes_ports_resources_env() -> None:
    deployment, service, pdb = custom_provider().render()
    assert deployment["metadata"]["namespace"] == "rl" and deployment["spec"]["replicas"] == 5
    pod = deployment["spec"]["template"]
    [container] = pod["spec"]["containers"]
    assert container["image"] == "registry.example/openenv-grpc-wordle:1.2"
    assert container["command"] == ["openenv-grpc", "serve", "wordle"]
    # Liveness on "" (never tied to capacity), readiness on the env service (drain).
    assert container["livenessProbe"]["grpc"] == {"port": 7000, "service": ""}
    assert container["readinessProbe"]["grpc"] == {"port": 7000, "service": SERVICE_NAME}
    assert container["startupProbe"]["grpc"]["port"] == 7000
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env == {
        "HOST": "0.0.0.0",
        "PORT": "7000",
        "MAX_CONCURRENT_ENVS": "256",
        "GRACE_PERIOD": "60",
        "METRICS_PORT": "7001",
        "METRICS_HOST": "0.0.0.0",
        "IDLE_TIMEOUT": "120",
    }
    assert pod["spec"]["terminationGracePeriodSeconds"] > 60
    assert container["resources"] == {
        "requests": {"cpu": "1", "memory": "1Gi"},
        "limits": {"cpu": "4", "memory": "4Gi"},
    }
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"grpc": 7000, "metrics": 7001}
    # Labels and selectors agree across the three objects.
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert pod["metadata"]["labels"]["team"] == "rl"
    assert service["spec"]["selector"] == selector == pdb["spec"]["selector"]["matchLabels"]
    assert service["spec"]["clusterIP"] == "None"  # headless: balanced per stream
    grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert grpc_port["port"] == 7000 and grpc_port["targetPort"] == "grpc"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "7001"


def test_kubernetes_provider_target_and_channel() -> None:
    provider = custom_provider()
    with pytest.raises(ProviderError):
        _ = provider.target  # not started
    with pytest.raises(ValueError):
        KubernetesProvider("x", image="i", shutdown_margin=0)
    options = dict(provider.extra_channel_options())
    assert json.loads(options["grpc.service_config"]) == {
        "loadBalancingConfig": [{"round_robin": {}}]
    }
    assert custom_provider(target_override="127.0.0.1:1").target == "127.0.0.1:1"


# -- KubernetesProvider: the API calls ----------------------------------------------


class FakeApiServer(ThreadingHTTPServer):
    """Answers the calls KubernetesProvider makes, like an API server would, and records
    them. Objects live in ``objects``; a second create of one answers 409."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.objects: dict[str, dict[str, Any]] = {}
        super().__init__(("127.0.0.1", 0), FakeApiHandler)


class FakeApiHandler(BaseHTTPRequestHandler):
    server: FakeApiServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length", 0))
        return dict(json.loads(self.rfile.read(length))) if length else {}

    def _record(self) -> str:
        path = self.path.split("?")[0]
        self.server.calls.append((self.command, path))
        return path

    def do_POST(self) -> None:
        path, body = self._record(), self._body()
        key = f"{path}/{body['metadata']['name']}"
        if key in self.server.objects:
            self._answer(409, {"kind": "Status", "code": 409, "reason": "AlreadyExists"})
            return
        self.server.objects[key] = body
        self._answer(201, body)

    def do_PATCH(self) -> None:
        path, body = self._record(), self._body()
        self.server.objects[path] = body
        self._answer(200, body)

    def do_GET(self) -> None:
        path = self._record()
        deployment = self.server.objects[path.removesuffix("/status")]
        replicas = deployment["spec"]["replicas"]
        self._answer(200, {**deployment, "status": {"replicas": replicas,
                                                    "readyReplicas": replicas}})  # fmt: skip

    def do_DELETE(self) -> None:
        path = self._record()
        self.server.objects.pop(path, None)
        self._answer(200, {"kind": "Status", "code": 200})


@pytest.fixture
def api_server() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_kubernetes_provider_applies_waits_and_deletes(api_server: FakeApiServer) -> None:
    config = kubernetes.client.Configuration(host=f"http://127.0.0.1:{api_server.server_port}")
    api = kubernetes.client.ApiClient(config)
    deployments = "/apis/apps/v1/namespaces/rl/deployments"
    services = "/api/v1/namespaces/rl/services"
    budgets = "/apis/policy/v1/namespaces/rl/poddisruptionbudgets"
    with custom_provider(api_client=api) as provider:
        assert provider.target == "dns:///wordle-pool.rl.svc.cluster.local:7000"
        assert api_server.objects[f"{deployments}/wordle-pool"] == provider.render_deployment()
        assert api_server.objects[f"{services}/wordle-pool"] == provider.render_service()
        assert api_server.objects[f"{budgets}/wordle-pool"] == provider.render_pdb()
        assert ("GET", f"{deployments}/wordle-pool/status") in api_server.calls
        provider.apply()  # again: each object exists (409), so it is patched
        assert ("PATCH", f"{deployments}/wordle-pool") in api_server.calls
        assert ("PATCH", f"{services}/wordle-pool") in api_server.calls
    assert [c for c in api_server.calls if c[0] == "DELETE"] == [
        ("DELETE", f"{budgets}/wordle-pool"),
        ("DELETE", f"{services}/wordle-pool"),
        ("DELETE", f"{deployments}/wordle-pool"),
    ]
    assert api_server.objects == {}
    api.close()
