"""The one phase machine of every env the driver holds, each stream's wording of its
refusals (:data:`SESSION_WORDS`, :data:`VECTOR_WORDS`), and episode ids."""

from __future__ import annotations

import enum
import itertools
import os
from dataclasses import dataclass

from openenv_grpc.v1 import snapshot_pb2

__all__ = [
    "CAPTURED_PHASE",
    "RESTORED_PHASE",
    "SESSION_WORDS",
    "VECTOR_WORDS",
    "Phase",
    "Words",
    "ended_phase",
    "new_episode_id",
]


class Phase(enum.IntEnum):
    NO_EPISODE = 0
    RUNNING = 1
    TERMINATED = 2
    TRUNCATED = 3
    BROKEN = 4  # the env raised mid-episode; only a reset may follow
    #: Its env process was lost to a call that did not name it: the next call naming it
    #: is told, once (then NO_EPISODE), unless a reset or restore comes first.
    LOST = 5


#: Phase -> snapshot phase code, for the phases that can be captured; and back.
CAPTURED_PHASE: dict[Phase, int] = {
    Phase.RUNNING: snapshot_pb2.SNAPSHOT_PHASE_RUNNING,
    Phase.TERMINATED: snapshot_pb2.SNAPSHOT_PHASE_TERMINATED,
    Phase.TRUNCATED: snapshot_pb2.SNAPSHOT_PHASE_TRUNCATED,
}
RESTORED_PHASE = {code: phase for phase, code in CAPTURED_PHASE.items()}


def ended_phase(terminated: bool, truncated: bool) -> Phase:
    if terminated:
        return Phase.TERMINATED
    if truncated:
        return Phase.TRUNCATED
    return Phase.RUNNING


def new_episode_id() -> str:
    """A fresh episode's id, unique in this server: a random prefix of the process and a
    counter (10x cheaper than uuid4; ids are no secret)."""
    return f"{_prefix}{next(_counter):016x}"


def _reseed() -> None:
    global _prefix, _counter
    _prefix = os.urandom(8).hex()
    _counter = itertools.count()


_prefix = ""
_counter = itertools.count()
_reseed()
os.register_at_fork(after_in_child=_reseed)


@dataclass(frozen=True, slots=True)
class Words:
    """How one kind of stream words the refusals the driver makes."""

    #: Phase -> why an env in it may not step.
    needs_reset: dict[Phase, str]
    #: Phase -> why an env in it has nothing to snapshot.
    nothing_to_capture: dict[Phase, str]
    #: What goes on after a refusal: "the session" or "the stream".
    stream: str
    #: A row's message names its env ("env 3: ...").
    by_index: bool
    #: A hung call replaced the env(s); the factory raised; no slot is free.
    replaced: str
    not_replaced: str
    no_fresh: str

    def row(self, index: int, message: str) -> str:
        return f"env {index}: {message}" if self.by_index else message


SESSION_WORDS = Words(
    needs_reset={
        Phase.NO_EPISODE: "step before reset: call reset first",
        Phase.TERMINATED: "the episode has terminated: call reset to start a new one",
        Phase.TRUNCATED: "the episode was truncated: call reset to start a new one",
        Phase.BROKEN: "the environment failed during this episode: call reset",
    },
    nothing_to_capture={
        Phase.NO_EPISODE: "snapshot before reset: there is no episode to capture; call reset",
        Phase.BROKEN: "the environment failed during this episode: there is nothing "
        "consistent to capture; call reset",
    },
    stream="the session",
    by_index=False,
    replaced="the environment was replaced with a fresh one: call reset",
    not_replaced="the environment hung and a new one could not be created",
    no_fresh="no fresh environment can be made",
)

VECTOR_WORDS = Words(
    needs_reset={
        Phase.NO_EPISODE: "step before reset: reset it first",
        Phase.TERMINATED: "the episode has terminated and no autoreset is due: reset it",
        Phase.TRUNCATED: "the episode was truncated and no autoreset is due: reset it",
        Phase.BROKEN: "the environment failed during this episode: reset it",
    },
    nothing_to_capture={
        Phase.NO_EPISODE: "snapshot before reset: there is no episode to capture; reset it",
        Phase.BROKEN: "the environment failed during this episode: there is nothing "
        "consistent to capture; reset it",
    },
    stream="the stream",
    by_index=True,
    replaced="every environment of this stream was replaced with a fresh one: reset them",
    not_replaced="the environments hung and new ones could not be created",
    no_fresh="no fresh environments can be made",
)
