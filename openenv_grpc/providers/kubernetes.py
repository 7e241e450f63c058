"""``KubernetesProvider``: an environment's servers as a Deployment behind a headless Service.

The objects are plain dicts (what ``kubectl apply -f`` reads), rendered by :meth:`render`
and applied with the official ``kubernetes`` client (``pip install 'openenv-grpc[k8s]'``)
when a cluster is configured. The shapes match ``deploy/k8s/``:

- **Probes are native gRPC probes** on ``grpc.health.v1``. Liveness asks for service ``""``,
  which stays SERVING while the process works, however full it is: a full pod is never
  restarted. Readiness asks for the env service, which goes NOT_SERVING when the server
  drains, so a draining pod leaves the Service's endpoints.
- **The Service is headless** (``clusterIP: None``). A normal ClusterIP Service balances
  per TCP connection (kube-proxy), and gRPC multiplexes every session of a client over one
  connection, so all of one trainer's sessions would land on one pod. Headless DNS returns
  every ready pod's address; gRPC clients with ``round_robin`` (:meth:`channel` sets it)
  and Envoy (a STRICT_DNS cluster) then balance per stream, that is per session.
- **terminationGracePeriodSeconds** exceeds the server's ``GRACE_PERIOD``, so Kubernetes
  never SIGKILLs a pod before its sessions have had their grace period and every env is
  closed.
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Mapping
from typing import Any

import grpc

from openenv_grpc.metadata import SERVICE_NAME
from openenv_grpc.providers.base import Provider, ProviderError

__all__ = ["KubernetesProvider"]

Manifest = dict[str, Any]


class KubernetesProvider(Provider):
    """A Deployment of ``replicas`` server pods, a headless Service and a PodDisruptionBudget.

    Args:
        name: Name of the Deployment, Service and PDB (a DNS label).
        image: Container image whose ``openenv-grpc`` command serves ``env``.
        env: What ``openenv-grpc serve`` gets inside the container.
        namespace: Namespace of every object.
        replicas: Pods to run.
        port: gRPC port in the pod.
        metrics_port: Prometheus port in the pod (``openenv_sessions_active`` for the HPA).
        max_concurrent_envs: Sessions per pod (``MAX_CONCURRENT_ENVS``).
        grace_period: Seconds sessions get on drain (``GRACE_PERIOD``); the pod's
            ``terminationGracePeriodSeconds`` is this plus ``shutdown_margin``.
        shutdown_margin: Seconds past the grace period for closing envs and exiting.
        requests: Container resource requests.
        limits: Container resource limits.
        extra_env: More environment variables for the server (e.g. ``IDLE_TIMEOUT``).
        labels: More labels on every object and pod.
        target_override: The target clients use, when they are not inside the cluster
            (an Envoy, a port-forward); default is the Service's cluster DNS name.
        delete_on_stop: Whether :meth:`stop` deletes what :meth:`start` applied.
        api_client: A ``kubernetes.client.ApiClient``; default: loaded from kubeconfig,
            else from the in-cluster service account.
    """

    def __init__(
        self,
        name: str,
        image: str,
        env: str = "echo",
        *,
        namespace: str = "default",
        replicas: int = 2,
        port: int = 50051,
        metrics_port: int = 9090,
        max_concurrent_envs: int = 1024,
        grace_period: int = 25,
        shutdown_margin: int = 10,
        requests: Mapping[str, str] | None = None,
        limits: Mapping[str, str] | None = None,
        extra_env: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        target_override: str | None = None,
        delete_on_stop: bool = True,
        api_client: Any = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        super().__init__(credentials=credentials)
        if shutdown_margin <= 0:
            raise ValueError("shutdown_margin must be positive: the pod must outlive the drain")
        self.name = name
        self.image = image
        self.env = env
        self.namespace = namespace
        self.replicas = replicas
        self.port = port
        self.metrics_port = metrics_port
        self.max_concurrent_envs = max_concurrent_envs
        self.grace_period = grace_period
        self.shutdown_margin = shutdown_margin
        self.requests = dict(requests or {"cpu": "500m", "memory": "512Mi"})
        self.limits = dict(limits or {"cpu": "2", "memory": "2Gi"})
        self.extra_env = dict(extra_env or {})
        self.labels = dict(labels or {})
        self.target_override = target_override
        self.delete_on_stop = delete_on_stop
        self._api_client = api_client
        self._started = False

    # -- rendering ---------------------------------------------------------------------

    def selector(self) -> dict[str, str]:
        """The labels that select this provider's pods (Service, PDB, Deployment)."""
        return {"app.kubernetes.io/name": "openenv-grpc", "app.kubernetes.io/instance": self.name}

    def _labels(self) -> dict[str, str]:
        return {**self.labels, **self.selector(), "app.kubernetes.io/component": "env-server"}

    def _metadata(self) -> dict[str, Any]:
        return {"name": self.name, "namespace": self.namespace, "labels": self._labels()}

    def render_deployment(self) -> Manifest:
        """The Deployment (``apps/v1``) as a dict."""
        env = {
            "HOST": "0.0.0.0",  # in a pod, listen on the pod's address, not loopback
            "PORT": str(self.port),
            "MAX_CONCURRENT_ENVS": str(self.max_concurrent_envs),
            "GRACE_PERIOD": str(self.grace_period),
            "METRICS_PORT": str(self.metrics_port),
            "METRICS_HOST": "0.0.0.0",  # the endpoint is loopback-only by default
            **self.extra_env,
        }
        container = {
            "name": "server",
            "image": self.image,
            "imagePullPolicy": "IfNotPresent",
            "command": ["openenv-grpc", "serve", self.env],
            "env": [{"name": key, "value": value} for key, value in env.items()],
            "ports": [
                {"name": "grpc", "containerPort": self.port, "protocol": "TCP"},
                {"name": "metrics", "containerPort": self.metrics_port, "protocol": "TCP"},
            ],
            # Slow env imports (Atari, OpenSpiel) get a minute before liveness counts.
            "startupProbe": {
                "grpc": {"port": self.port, "service": ""},
                "periodSeconds": 2,
                "failureThreshold": 30,
            },
            # "" answers SERVING whatever the load: a full pod is alive, never restarted.
            "livenessProbe": {
                "grpc": {"port": self.port, "service": ""},
                "periodSeconds": 10,
                "timeoutSeconds": 5,
                "failureThreshold": 3,
            },
            # The env service turns NOT_SERVING on drain: the pod leaves the endpoints.
            "readinessProbe": {
                "grpc": {"port": self.port, "service": SERVICE_NAME},
                "periodSeconds": 2,
                "timeoutSeconds": 2,
                "failureThreshold": 2,  # one slow answer from a busy pod is not a drain
                "successThreshold": 1,
            },
            "resources": {"requests": dict(self.requests), "limits": dict(self.limits)},
            # The images of deploy/docker run as uid 10001: refuse to run one as root.
            "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True},
        }
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": self._metadata(),
            "spec": {
                "replicas": self.replicas,
                "selector": {"matchLabels": self.selector()},
                # Roll one pod at a time and bring the new one up first: sessions on the old
                # pod drain while capacity stays whole.
                "strategy": {
                    "type": "RollingUpdate",
                    "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
                },
                "template": {
                    "metadata": {
                        "labels": self._labels(),
                        "annotations": {
                            "prometheus.io/scrape": "true",
                            "prometheus.io/port": str(self.metrics_port),
                            "prometheus.io/path": "/metrics",
                        },
                    },
                    "spec": {
                        "terminationGracePeriodSeconds": self.grace_period + self.shutdown_margin,
                        "containers": [container],
                    },
                },
            },
        }

    def render_service(self) -> Manifest:
        """The headless Service (``v1``) as a dict: DNS lists every ready pod."""
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self._metadata(),
            "spec": {
                "clusterIP": "None",
                "selector": self.selector(),
                "ports": [
                    {
                        "name": "grpc",
                        "port": self.port,
                        "targetPort": "grpc",
                        "protocol": "TCP",
                        "appProtocol": "kubernetes.io/h2c",
                    },
                    {
                        "name": "metrics",
                        "port": self.metrics_port,
                        "targetPort": "metrics",
                        "protocol": "TCP",
                    },
                ],
            },
        }

    def render_pdb(self) -> Manifest:
        """A PodDisruptionBudget (``policy/v1``): voluntary evictions take one pod at a time."""
        return {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": self._metadata(),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": self.selector()}},
        }

    def render(self) -> list[Manifest]:
        """Every object :meth:`apply` creates, in order: Deployment, Service, PDB."""
        return [self.render_deployment(), self.render_service(), self.render_pdb()]

    # -- the cluster -------------------------------------------------------------------

    @property
    def target(self) -> str:
        """``dns:///NAME.NAMESPACE.svc.cluster.local:PORT`` (or ``target_override``).

        Raises:
            ProviderError: not started and no ``target_override``.
        """
        if self.target_override is not None:
            return self.target_override
        if not self._started:
            raise ProviderError("the provider has not been started")
        return f"dns:///{self.name}.{self.namespace}.svc.cluster.local:{self.port}"

    def extra_channel_options(self) -> list[tuple[str, Any]]:
        """``round_robin`` over every address the headless Service's DNS name returns."""
        config: dict[str, Any] = {"loadBalancingConfig": [{"round_robin": {}}]}
        return [("grpc.service_config", json.dumps(config))]

    def _client(self) -> Any:
        """The ``kubernetes.client`` module, with ``self._api_client`` loaded.

        Raises:
            ProviderError: the ``kubernetes`` package is not installed.
        """
        try:
            kubernetes = importlib.import_module("kubernetes")
        except ImportError as exc:
            raise ProviderError("pip install 'openenv-grpc[k8s]' for KubernetesProvider") from exc
        if self._api_client is None:
            try:
                kubernetes.config.load_kube_config()
            except Exception:  # no kubeconfig: maybe we run in a pod
                kubernetes.config.load_incluster_config()
            self._api_client = kubernetes.client.ApiClient()
        return kubernetes.client

    def _apis(self) -> list[tuple[Manifest, Any, str]]:
        """(manifest, API object, method suffix) for each rendered object."""
        client = self._client()
        apps = client.AppsV1Api(self._api_client)
        core = client.CoreV1Api(self._api_client)
        policy = client.PolicyV1Api(self._api_client)
        return [
            (self.render_deployment(), apps, "namespaced_deployment"),
            (self.render_service(), core, "namespaced_service"),
            (self.render_pdb(), policy, "namespaced_pod_disruption_budget"),
        ]

    def apply(self) -> None:
        """Create each object, or patch it when it exists already.

        Raises:
            ProviderError: no ``kubernetes`` package.
            kubernetes.client.ApiException: the API server refused an object.
        """
        client = self._client()
        for manifest, api, kind in self._apis():
            try:
                getattr(api, f"create_{kind}")(self.namespace, manifest)
            except client.ApiException as exc:
                if exc.status != 409:  # 409: it exists; bring it to this spec
                    raise
                getattr(api, f"patch_{kind}")(self.name, self.namespace, manifest)

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Poll the Deployment until ``replicas`` pods are ready (readiness = SERVING).

        Raises:
            ProviderError: not ready within ``timeout`` seconds.
        """
        apps = self._client().AppsV1Api(self._api_client)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = apps.read_namespaced_deployment_status(self.name, self.namespace).status
            if (status.ready_replicas or 0) >= self.replicas:
                return
            time.sleep(2.0)
        raise ProviderError(f"deployment {self.name} not ready after {timeout}s")

    def start(self, timeout: float = 300.0) -> None:
        """Apply the objects and wait until every pod is ready.

        Raises:
            ProviderError: no ``kubernetes`` package, or the pods were not ready in time
                (what was applied is deleted again when ``delete_on_stop``).
        """
        self.apply()
        self._started = True
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _stop_servers(self) -> None:
        if not self._started:
            return
        self._started = False
        if not self.delete_on_stop:
            return
        client = self._client()
        for _, api, kind in reversed(self._apis()):
            try:
                getattr(api, f"delete_{kind}")(self.name, self.namespace)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
