"""``--isolated``: a vector stream's envs spread over the env processes (to come: until
then such an open is refused with INTERNAL, naming the reason)."""

from __future__ import annotations

from typing import Any

from openenv_grpc.environment import AutoresetMode
from openenv_grpc.server.backend import EnvFactoryError


class SpreadBatchCalls:
    """The envs of one vector stream in env processes."""

    @classmethod
    async def open(cls, pool: Any, size: int, autoreset: AutoresetMode, native: bool) -> Any:
        """Raises:
        EnvFactoryError: always, for now.
        """
        raise EnvFactoryError("vector streams are not served with --isolated yet")

    native = False
