"""``EchoEnv.from_docker_image(image)``: a session on a container of its own.

The client package knows no provider (dependencies run one way: providers import the
client, never the reverse), so the one-liner lives here, as mixins a typed client adds
before its session base::

    class EchoEnv(FromDockerImage, Session[EchoAction, EchoObservation, EchoState, ...]):
        ...

    with EchoEnv.from_docker_image("openenv-grpc-echo:0.1.0", mem_limit="512m") as env:
        env.reset()

Any session class can do the same with any provider: ``EchoEnv.launch(provider)``.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from openenv_grpc.client.session_core import SessionSource

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["AsyncFromDockerImage", "FromDockerImage"]


class _Launches(Protocol):
    @classmethod
    def launch(cls, provider: SessionSource, **kwargs: Any) -> Self: ...


class _LaunchesAsync(Protocol):
    @classmethod
    def launch(cls, provider: SessionSource, **kwargs: Any) -> Awaitable[Self]: ...


LaunchesT = TypeVar("LaunchesT", bound=_Launches)
LaunchesAsyncT = TypeVar("LaunchesAsyncT", bound=_LaunchesAsync)


def _docker_provider(image: str, provider_kwargs: dict[str, Any]) -> SessionSource:
    # Imported here: docker is an extra, and the typed clients import this module.
    from openenv_grpc.providers.docker_provider import LocalDockerProvider

    return LocalDockerProvider(image, **provider_kwargs)


class FromDockerImage:
    """Adds ``from_docker_image`` to a blocking typed client (a ``Session`` subclass)."""

    @classmethod
    def from_docker_image(cls: type[LaunchesT], image: str, **provider_kwargs: Any) -> LaunchesT:
        """A session on a container of ``image`` of its own, started now (host network,
        loopback port, until health SERVING); the container goes when the session ends,
        also when opening it fails. ``provider_kwargs`` go to
        :class:`~openenv_grpc.providers.docker_provider.LocalDockerProvider`
        (``max_concurrent_envs``, ``cpus``, ``mem_limit``, ...); needs the docker extra.

        Raises:
            ProviderError: no Docker daemon, or the container did not become healthy.
        """
        return cls.launch(_docker_provider(image, provider_kwargs))


class AsyncFromDockerImage:
    """Adds ``from_docker_image`` to an asyncio typed client (an ``AsyncSession`` subclass):
    ``env = await AsyncEchoEnv.from_docker_image(image)``, then ``async with env``."""

    @classmethod
    async def from_docker_image(
        cls: type[LaunchesAsyncT], image: str, **provider_kwargs: Any
    ) -> LaunchesAsyncT:
        """See :meth:`FromDockerImage.from_docker_image`."""
        return await cls.launch(_docker_provider(image, provider_kwargs))
