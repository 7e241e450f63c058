"""Where servers come from: a local process (the default, no Docker) or Kubernetes pods.

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
