"""What :class:`RemoteGymnasiumVectorEnv` asks of the way it reaches its envs: the two
transports, one vector stream (:mod:`.vector_stream`) and N sessions
(:mod:`.session_streams`), answer the same calls with the same :class:`Batch` values."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import (
    Backend,
    EnvDescription,
    GymnasiumResetOptions,
)

__all__ = ["BACKENDS", "Batch", "LoopThread", "Transport", "gather"]

T = TypeVar("T")

#: The vector transport's ``backend=`` names and the reset option each stands for.
BACKENDS: Mapping[str, int] = {
    "gymnasium": Backend.BACKEND_GYMNASIUM,
    "envpool": Backend.BACKEND_ENVPOOL,
    "auto": Backend.BACKEND_AUTO,
}


@dataclass(slots=True)
class Batch:
    """The rows of a reset or a step, as Gymnasium batches them.

    Attributes:
        observations: The rows' observations, batched (a leading dimension per row).
        rewards, terminated, truncated: One per row (float64, bool, bool).
        infos: ``(env index, info)`` in the order ``VectorEnv._add_info`` must see them
            (for SAME_STEP an ended env's ``final_obs``/``final_info`` before its reset's
            info), as SyncVectorEnv adds them.
    """

    observations: Any
    rewards: npt.NDArray[np.float64]
    terminated: npt.NDArray[np.bool_]
    truncated: npt.NDArray[np.bool_]
    infos: list[tuple[int, dict[str, Any]]] = field(default_factory=list)


class Transport(Protocol):
    """N remote envs of one configuration, reached one way or another."""

    #: The running configuration (spaces, step limit).
    description: EnvDescription

    def reset(
        self,
        indices: Sequence[int],
        seeds: Sequence[int | None],
        options: GymnasiumResetOptions | None,
    ) -> Batch:
        """Reset the envs of ``indices`` (rows in that order); options reconfigure all.

        Raises:
            EnvError: the server refused; SessionLost: a stream ended.
        """
        ...

    def step(self, actions: Any) -> Batch:
        """Step every env with its row of the batched ``actions`` (autoreset included).

        Raises:
            EnvError: an env refused its action or raised (the others stepped);
            SessionLost: a stream ended.
        """
        ...

    def frames(self) -> tuple[Any, ...]:
        """Every env's current frame (None where it does not render)."""
        ...

    def close(self) -> None:
        """Close every remote env and what the transport owns. Idempotent."""
        ...


class LoopThread:
    """An asyncio event loop running in a daemon thread; ``run`` blocks on a coroutine."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._main, name="openenv-grpc-vector-env", daemon=True
        )
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """The coroutine's result, run on the loop (raises what it raised)."""
        future: Future[T] = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        return future.result(timeout)

    def stop(self) -> None:
        """Stop the loop and join its thread. Idempotent."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


async def gather(coroutines: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Every result; if any coroutine raised, the first error once all have finished
    (so no request of this batch is still in flight when the caller sees it)."""
    results = await asyncio.gather(*coroutines, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]
