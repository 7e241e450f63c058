"""Where servers come from: a local process (the default), a Docker container, or Kubernetes pods.

``with LocalProcessProvider("echo") as p, p.session(EchoEnv) as env: env.reset()``
"""

from openenv_grpc.providers.base import Provider, ProviderError, open_session, wait_serving
from openenv_grpc.providers.kubernetes import KubernetesProvider
from openenv_grpc.providers.local import LocalProcessProvider

__all__ = [
    "KubernetesProvider",
    "LocalProcessProvider",
    "Provider",
    "ProviderError",
    "open_session",
    "wait_serving",
]


def __getattr__(name: str) -> object:
    """``LocalDockerProvider`` and ``cleanup_orphans`` on first use: docker is an extra."""
    if name in ("LocalDockerProvider", "cleanup_orphans"):
        from openenv_grpc.providers import docker_provider

        return getattr(docker_provider, name)
    raise AttributeError(name)
