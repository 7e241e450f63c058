"""What the client hands back for a vector reset or step: :class:`VectorOutcome`.

Plain Python columns, one row per env that answered (no numpy here: an adapter such as
``RemoteGymnasiumVectorEnv`` builds arrays from them, or views the raw batch payload).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from google.protobuf import any_pb2
from google.protobuf.message import Message

from openenv_grpc.client.errors import EnvError

__all__ = ["VectorOutcome"]

ObservationT = TypeVar("ObservationT", bound=Message)


@dataclass(frozen=True, slots=True)
class VectorOutcome(Generic[ObservationT]):
    """What a vector reset or step returned. Row ``r`` is about env ``indices[r]``; an env
    whose call failed has no row but an entry in ``errors``.

    Attributes:
        indices: The env index of each row, increasing.
        observations: One typed observation per row (empty when the answer came in batch
            form: see :attr:`batch_observation`).
        rewards, terminated, truncated: One per row.
        episode_ids: Each row's current episode after the call (a new one where
            ``autoreset`` is set).
        step_counts: Steps taken in that episode (0 after a reset or an autoreset).
        infos: Extra data the envs returned, by env index (rows without any left out).
        autoreset: One per row: autoreset started a new episode in this call (NEXT_STEP:
            the row is its first observation, reward 0; SAME_STEP: the row's reward and
            flags are the ended episode's, its observation the new one's).
        final_observations: SAME_STEP: the last observation of each episode that ended,
            by env index.
        final_infos: SAME_STEP: the last info of each episode that ended, by env index.
        errors: Envs that failed, by index (the stream goes on): INTERNAL (reset it),
            INVALID_ARGUMENT (its action was refused; its episode goes on),
            FAILED_PRECONDITION (it cannot step now: reset it), UNAVAILABLE or
            DEADLINE_EXCEEDED (with ``--isolated``: a fresh env took its place: reset it).
        batch_payload: The batch-form observation exactly as received (a
            ``google.protobuf.Any``), when the call asked for the batch form; None
            otherwise. Its ``value`` holds the serialized message.
        batch_final_payload: The same for SAME_STEP's final observations.
        no_reward: The env indices whose env gave no reward (an OpenEnv env's None); their
            rewards read 0.
    """

    indices: list[int]
    observations: list[ObservationT]
    rewards: list[float]
    terminated: list[bool]
    truncated: list[bool]
    episode_ids: list[str]
    step_counts: list[int]
    infos: dict[int, dict[str, Any]] = field(default_factory=dict)
    autoreset: list[bool] = field(default_factory=list)
    final_observations: dict[int, ObservationT] = field(default_factory=dict)
    final_infos: dict[int, dict[str, Any]] = field(default_factory=dict)
    errors: dict[int, EnvError] = field(default_factory=dict)
    batch_payload: any_pb2.Any | None = None
    batch_final_payload: any_pb2.Any | None = None
    no_reward: frozenset[int] = frozenset()
    #: Decodes a batch payload (the typed client's observation type).
    _decode: Callable[[any_pb2.Any], Any] | None = field(default=None, repr=False, compare=False)

    @property
    def batch_observation(self) -> ObservationT | None:
        """The batch-form observation, decoded (on each access; None: not in batch form)."""
        if self.batch_payload is None or self._decode is None:
            return None
        observation: ObservationT = self._decode(self.batch_payload)
        return observation

    @property
    def batch_final_observation(self) -> ObservationT | None:
        """SAME_STEP's final observations in batch form, decoded (None: none)."""
        if self.batch_final_payload is None or self._decode is None:
            return None
        observation: ObservationT = self._decode(self.batch_final_payload)
        return observation

    @property
    def done(self) -> list[bool]:
        """Per row: the episode is over (terminated or truncated)."""
        return [a or b for a, b in zip(self.terminated, self.truncated, strict=True)]

    def row(self, index: int) -> int:
        """The row of env ``index``.

        Raises:
            KeyError: that env has no row (it failed, or was not in the call).
        """
        try:
            return self.indices.index(index)
        except ValueError:
            raise KeyError(index) from None
