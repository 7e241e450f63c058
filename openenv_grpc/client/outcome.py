"""What the client hands back for a reset or a step (:class:`StepOutcome`) and for a
restore (:class:`Restored`).

(The wire message it is decoded from is ``openenv_grpc.v1.StepResult``; the client's
type has a name of its own so the two are never confused.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from google.protobuf.message import Message

__all__ = ["Restored", "StepOutcome"]

ObservationT = TypeVar("ObservationT", bound=Message)


@dataclass(frozen=True, slots=True)
class StepOutcome(Generic[ObservationT]):
    """What a reset or a step returned.

    Attributes:
        observation: The typed observation (a raw ``Any`` from an untyped session when
            the type is not imported in this process).
        reward: Reward for the step (0 after a reset, and when ``no_reward``).
        terminated: The episode reached a terminal state of the task.
        truncated: The episode was cut short by a limit outside the task.
        episode_id: The episode this result belongs to.
        step_count: Steps taken in this episode so far (0 after a reset).
        info: Extra data the environment returned.
        no_reward: The env gave no reward (an OpenEnv env's None; ``StepResult.no_reward``):
            ``reward`` reads 0. The OpenEnv door answers it as ``"reward": null``.
    """

    observation: ObservationT
    reward: float
    terminated: bool
    truncated: bool
    episode_id: str
    step_count: int
    info: dict[str, Any] = field(default_factory=dict)
    no_reward: bool = False

    @property
    def done(self) -> bool:
        """The episode is over (terminated or truncated): reset before stepping again."""
        return self.terminated or self.truncated


@dataclass(frozen=True, slots=True)
class Restored:
    """Where a session is after a restore: exactly where the snapshot was taken.

    Attributes:
        episode_id: The restored episode's id (the captured one's).
        step_count: Steps taken in it so far.
        terminated: The captured episode had terminated.
        truncated: The captured episode had been truncated.
    """

    episode_id: str
    step_count: int
    terminated: bool
    truncated: bool

    @property
    def done(self) -> bool:
        """The restored episode is over: reset before stepping."""
        return self.terminated or self.truncated
