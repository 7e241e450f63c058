"""Where servers come from: a local process (the default), a Docker container, a Docker swarm
service, Kubernetes pods, Ray actors on a Ray cluster, or the nodes of a SLURM allocation.

``with LocalProcessProvider("echo") as p, p.session(EchoEnv) as env: env.reset()``
"""

from openenv_grpc.providers.base import Provider, ProviderError, wait_serving
from openenv_grpc.providers.kubernetes import KubernetesProvider
from openenv_grpc.providers.local import LocalProcessProvider

__all__ = [
    "KubernetesProvider",
    "LocalProcessProvider",
    "Provider",
    "ProviderError",
    "wait_serving",
]


#: Names of the Docker providers, imported on first use (docker is an extra).
_LAZY = {
    "LocalDockerProvider": "openenv_grpc.providers.docker_provider",
    "cleanup_orphans": "openenv_grpc.providers.docker_provider",
    "DockerSwarmProvider": "openenv_grpc.providers.swarm",
    "cleanup_orphan_services": "openenv_grpc.providers.swarm",
    "RayProvider": "openenv_grpc.providers.ray_provider",
    "SlurmProvider": "openenv_grpc.providers.slurm",
    "cleanup_orphan_jobs": "openenv_grpc.providers.slurm",
}


def __getattr__(name: str) -> object:
    """``LocalDockerProvider``, ``DockerSwarmProvider``, their clean-ups, ``RayProvider`` and
    ``SlurmProvider`` on first use: docker and ray are extras (SLURM needs only its
    commands)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
