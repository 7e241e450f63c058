"""Where each env's episode is, and what a stream says when a command does not fit.

One phase machine for every env the driver holds (``driver.py``): a Session's one env and
each env of a vector stream go through the same phases. Only the wording differs: a
Session speaks of "the episode" and "the session", a vector stream names the env by its
index and speaks of "the stream" (:data:`SESSION_WORDS`, :data:`VECTOR_WORDS`).
"""

from __future__ import annotations

import enum
import itertools
import os
from dataclasses import dataclass

from openenv_grpc.server.model.snapshots import phase_codes

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
    #: Its env process was lost to a call that did not name it: a fresh env is in its
    #: place, which the next step, state or snapshot naming it is told, once (then it is
    #: NO_EPISODE), unless a reset or a restore gives it an episode first. Until then the
    #: driver keeps the phase its client knows it in (what refusals quote).
    LOST = 5


#: Phase -> snapshot phase code, for the phases that can be captured; and back.
CAPTURED_PHASE, RESTORED_PHASE = phase_codes(Phase)


def ended_phase(terminated: bool, truncated: bool) -> Phase:
    """The phase after a transition with these flags."""
    if terminated:
        return Phase.TERMINATED
    if truncated:
        return Phase.TRUNCATED
    return Phase.RUNNING


def new_episode_id() -> str:
    """A fresh episode's id, unique in this server: 32 hex digits, a random prefix of the
    process and a counter (uuid4 cost ~2 µs an id, ~6 per message of 64 CartPoles
    autoresetting; this ~0.2 µs). Ids name episodes; they are no secret (snapshots are
    signed)."""
    return f"{_prefix}{next(_counter):016x}"


def _reseed() -> None:
    """A forked server process (``--workers``) gets ids of its own."""
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
    #: True: a row's message names its env ("env 3: ...").
    by_index: bool
    #: A hung call replaced the env(s): what to do now.
    replaced: str
    #: A hung call's env(s) could not be replaced: the factory raised.
    not_replaced: str
    #: A hung call's env(s) could not be replaced: no slot is free.
    no_fresh: str

    def row(self, index: int, message: str) -> str:
        """``message`` about env ``index``, as this stream words it."""
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
