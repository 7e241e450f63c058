"""What steps a vector stream's envs: the interface between the batch (:mod:`.batch`)
and its two backends, N gymnasium envs (:mod:`.gymnasium_backend`) and one EnvPool pool
(:mod:`.envpool_backend`).

The batch keeps the configuration, the wire forms and the bookkeeping; a backend only
resets and steps envs by index and returns plain numpy/Python :class:`Rows`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import gymnasium
import numpy as np
import numpy.typing as npt

from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import EnvDescription

__all__ = ["BatchBackend", "Rows", "rows_index"]


@dataclass(slots=True)
class Rows:
    """What a backend answered for the indices of one call (errors have no row).

    Attributes:
        indices: The env index of each row, in call order.
        observations: Per row an element of the observation space, or (``stacked``) one
            batch with a leading dimension of ``len(indices)``.
        stacked: Whether ``observations`` (and ``final_observations``) are batches.
        rewards, terminated, truncated: One per row.
        infos: One JSON-like info (or None) per row; None when no row has one.
        reset: Per row, whether autoreset started a new episode in this call (None: no row).
        final_observations: SAME_STEP: the ended episodes' last observations, for the rows
            whose ``reset`` is True, in row order.
        final_infos: The infos of those last steps.
        errors: Env index -> what its env raised.
        columns: The rewards (float64), terminated and truncated flags as arrays too, when
            the backend has them so (EnvPool): the batch's books read them instead of
            converting the lists back.
    """

    indices: list[int]
    observations: Any
    stacked: bool
    rewards: list[float]
    terminated: list[bool]
    truncated: list[bool]
    infos: list[Mapping[str, Any] | None] | None = None
    reset: list[bool] | None = None
    final_observations: Any = None
    final_infos: list[Mapping[str, Any] | None] | None = None
    errors: dict[int, Exception] = field(default_factory=dict)
    columns: tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_], npt.NDArray[np.bool_]] | None = (
        None
    )


class BatchBackend(Protocol):
    """N envs of one configuration, addressed by index ``0 .. size - 1``."""

    #: The running configuration's description (spaces, step limit, backend).
    description: EnvDescription
    observation_space: gymnasium.Space[Any]
    action_space: gymnasium.Space[Any]

    def reset(self, indices: Sequence[int], seeds: Sequence[int | None]) -> Rows:
        """Start a new episode in each env of ``indices``; rows as for a step.

        Raises:
            InvalidAction: seeds this backend cannot apply (nothing was reset).
        """
        ...

    def step(self, indices: Sequence[int], actions: Any, resetting: Sequence[bool]) -> Rows:
        """Step each env of ``indices`` with its row of ``actions`` (a decoded batch);
        rows whose ``resetting`` is True are reset instead (NEXT_STEP autoreset), and with
        SAME_STEP (the backend's mode) an env whose episode ends is reset at once."""
        ...

    def last_observation(self, index: int) -> Any:
        """Env ``index``'s latest observation (None before its first reset)."""
        ...

    def render(self, index: int) -> Any:
        """Env ``index``'s current frame, or None when it does not render."""
        ...

    def close(self) -> None:
        """Close every env."""
        ...


def rows_index(indices: Sequence[int]) -> slice | npt.NDArray[np.intp]:
    """What indexes the per-env arrays at ``indices`` (increasing, no repeats, as every
    call names them): a slice when they are one run (every env, or one half of a vector
    stream's two requests in flight), else an index array."""
    count = len(indices)
    if count and indices[-1] - indices[0] + 1 == count:
        return slice(indices[0], indices[0] + count)
    return np.asarray(indices, dtype=np.intp)
