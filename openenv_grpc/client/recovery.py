"""Recovery: an episode that survives the loss of its server.

With ``Session(target, recovery=Recovery(every=K, targets=[...]))`` a session keeps, at
all times, a way back to where its episode is: a *base* (the last snapshot, or the
seeded reset that started the episode) and the actions taken since. It snapshots every
``K`` steps, so the actions kept are at most ``K``. When the stream is lost
(:class:`~openenv_grpc.client.errors.SessionLost`: server killed, drained, pod gone,
worker crashed), the call that saw it does not raise: the session reopens -- on its own
target, then on each of ``targets``, round after round, for up to ``within`` seconds --
restores the base, replays the actions (checking that they give what they gave before),
and makes the call again. The episode goes on with its id and step count; the loop sees
one logged warning and a counter (``env.recoveries``, ``Recovery.recovered``).

Exact for deterministic envs (the same state and actions give the same transitions),
which is what snapshots promise when the env carries its random generators in them. An
env without snapshots is recovered by replaying the episode from its seeded reset
(every action since is kept); an unseeded episode of such an env cannot be recovered,
and the loss is raised as usual.

A session that made its channel reopens on a fresh one each attempt; one given a
channel reopens on it, so it waits for that channel to reconnect: channels made by
:mod:`openenv_grpc.client.channel` (and a fleet's) retry a connect at most 1.2 s apart
(``MAX_RECONNECT_BACKOFF_MS``), where gRPC's defaults grow to 120 s and kept a
recovery waiting up to 11 s after its server was back.

The procedure is written once, as coroutines, over the three things a shell does
(:class:`RecoveryIO`); the blocking ``Session`` runs it with :func:`run_blocking`,
its awaits finishing at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import Message

from openenv_grpc.client.errors import EnvError, SessionLost, SessionRefused, SessionTimeout
from openenv_grpc.client.outcome import Restored, StepOutcome
from openenv_grpc.client.protocol import SessionProtocol
from openenv_grpc.v1 import session_pb2 as pb

__all__ = ["RecoveringCalls", "Recovery", "RecoveryIO", "run_blocking"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Pause before the second round of attempts; it doubles each round, up to the cap.
_FIRST_PAUSE = 0.05
_MAX_PAUSE = 1.0


class Recovery:
    """The recovery option of a session (shared by any number of sessions).

    Args:
        every: Snapshot after every this many steps (1: every step). Fewer snapshots
            cost fewer round trips; more keep the replay after a loss short.
        targets: Other servers of the same env and version, holding the same snapshot
            key (``SNAPSHOT_KEYS``), tried in order after the session's own target.
        within: Seconds a call keeps trying to recover before the loss is raised.

    Raises:
        ValueError: ``every`` below 1 or ``within`` not positive.
    """

    __slots__ = ("_count", "_lock", "every", "targets", "within")

    def __init__(self, every: int = 1, targets: Sequence[str] = (), within: float = 30.0) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        if within <= 0:
            raise ValueError(f"within must be > 0, got {within}")
        self.every = every
        self.targets = tuple(targets)
        self.within = within
        self._count = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Recovery(every={self.every}, targets={list(self.targets)}, within={self.within})"

    @property
    def recovered(self) -> int:
        """Losses recovered so far by every session using this option."""
        return self._count

    def _counted(self) -> None:
        with self._lock:
            self._count += 1


class RecoveryIO(Protocol):
    """What a session shell does for recovery, awaited (a blocking shell's finish at once)."""

    async def _io_roundtrip(self, request: pb.SessionRequest, timeout: float | None) -> Any:
        """Send ``request`` on the open stream and return its answer.

        Raises:
            SessionLost: the stream ended. SessionTimeout: no answer within ``timeout``.
        """
        ...

    async def _io_reopen(self, target: str | None) -> None:
        """Open a fresh session on ``target`` (None: the session's own), with a fresh
        channel where the session makes its own.

        Raises:
            SessionRefused: it could not be opened.
        """
        ...

    async def _io_pause(self, seconds: float) -> None:
        """Sleep ``seconds``."""
        ...


def run_blocking(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine whose every await finishes at once (the blocking shell's I/O).

    Raises:
        Exception: whatever the coroutine raised.
    """
    try:
        coroutine.send(None)
    except StopIteration as finished:
        return finished.value  # type: ignore[no-any-return]
    coroutine.close()
    raise RuntimeError("a blocking session's call awaited something that waits")


class _NotRecoverable(Exception):
    """The episode cannot be brought back on any server (the message says why)."""


class _TargetRefused(Exception):
    """This target cannot take the episode (the next one may)."""


class RecoveringCalls:
    """The calls of one session with recovery on: they keep the episode's base and the
    actions since, and survive a lost stream (see the module's docstring)."""

    __slots__ = (
        "_actions", "_base_reset", "_base_snapshot", "_can_snapshot", "_io", "_outcomes",
        "_protocol", "_recovery", "recoveries",
    )  # fmt: skip

    def __init__(self, recovery: Recovery, protocol: SessionProtocol, io: RecoveryIO) -> None:
        self._recovery = recovery
        self._protocol = protocol
        self._io = io
        #: The last snapshot of the episode, or (without one) the reset that started it.
        self._base_snapshot: bytes | None = None
        self._base_reset: pb.ResetCommand | None = None
        #: Actions since the base, as sent, and what each gave.
        self._actions: list[any_pb2.Any] = []
        self._outcomes: list[tuple[float | None, bool, bool]] = []
        self._can_snapshot = True
        #: Losses this session recovered from.
        self.recoveries = 0

    # -- the calls --------------------------------------------------------------------

    async def reset(
        self,
        seed: int | None,
        episode_id: str | None,
        options: Message | None,
        timeout: float | None,
    ) -> StepOutcome[Any]:
        protocol = self._protocol
        request, outcome = await self._call(
            lambda: protocol.reset_request(seed, episode_id, options),
            protocol.step_result, timeout, replay=False,
        )  # fmt: skip
        base = pb.ResetCommand()
        base.CopyFrom(request.reset)
        base.episode_id = outcome.episode_id  # the server's, when it chose one
        self._rebase(None, base)
        if seed is None:  # an unseeded reset does not repeat: only a snapshot brings it back
            await self._snapshot_quietly(timeout)
        return outcome  # type: ignore[no-any-return]

    async def step(self, action: Message, timeout: float | None) -> StepOutcome[Any]:
        protocol = self._protocol
        request, outcome = await self._call(
            lambda: protocol.step_request(action), protocol.step_result, timeout
        )
        self._actions.append(request.step.action)
        self._outcomes.append(_trace(outcome))
        if len(self._actions) >= self._recovery.every:
            await self._snapshot_quietly(timeout)
        return outcome  # type: ignore[no-any-return]

    async def ask(self, command: str, result: str, timeout: float | None) -> Any:
        """A query passed through (``SessionQueries``): its ``result`` field."""
        protocol = self._protocol
        _, answer = await self._call(
            lambda: protocol.query_request(command),
            lambda response: protocol.query_result(response, result),
            timeout,
        )
        return answer

    async def snapshot(self, timeout: float | None) -> bytes:
        protocol = self._protocol
        _, data = await self._call(
            lambda: protocol.query_request("snapshot"), protocol.snapshot_result, timeout
        )
        self._rebase(data, None)  # a snapshot the caller asked for is a base as good as ours
        return data  # type: ignore[no-any-return]

    async def restore(self, data: bytes, timeout: float | None) -> Restored:
        protocol = self._protocol
        _, restored = await self._call(
            lambda: protocol.restore_request(data), protocol.restore_result, timeout,
            replay=False,
        )  # fmt: skip
        self._rebase(bytes(data), None)
        return restored  # type: ignore[no-any-return]

    # -- keeping the base ---------------------------------------------------------------

    def _rebase(self, snapshot: bytes | None, reset: pb.ResetCommand | None) -> None:
        self._base_snapshot, self._base_reset = snapshot, reset
        self._actions.clear()
        self._outcomes.clear()

    async def _snapshot_quietly(self, timeout: float | None) -> None:
        """Take the snapshot recovery needs; a refusal is logged, never raised (the call
        that asked for it succeeded)."""
        if not self._can_snapshot:
            return
        protocol = self._protocol
        try:
            _, data = await self._call(
                lambda: protocol.query_request("snapshot"), protocol.snapshot_result, timeout
            )
        except EnvError as error:
            if error.code is grpc.StatusCode.UNIMPLEMENTED:
                self._can_snapshot = False
                log.warning(
                    "recovery: the env has no snapshots; a lost session is recovered by "
                    "replaying its episode from the seeded reset"
                )
            else:
                log.warning("recovery: snapshot failed (%s); keeping the actions since", error)
            return
        self._rebase(data, None)

    # -- surviving a loss -------------------------------------------------------------------

    async def _call(
        self,
        build: Callable[[], pb.SessionRequest],
        decode: Callable[[Any], Any],
        timeout: float | None,
        *,
        replay: bool = True,
    ) -> tuple[pb.SessionRequest, Any]:
        """Make one call; after a lost stream, recover and make it again. ``replay``:
        the call needs the episode back first (not so a reset or a restore).

        Raises:
            SessionLost: recovery was impossible, or gave up after ``within`` seconds.
            EnvError, SessionTimeout: as the call itself raises them.
        """
        deadline: float | None = None
        recovered = 0
        while True:
            request = build()
            try:
                return request, decode(await self._io._io_roundtrip(request, timeout))
            except SessionLost as lost:
                if recovered >= _MAX_RETRIES:
                    # The same call lost a fresh stream each time: it may be what kills
                    # the server (or its env process); making it again would only repeat
                    # that, and take the neighbours there down with it.
                    raise _gave_up(
                        lost,
                        f"this call lost the stream again after {recovered} recoveries; it "
                        "is not made again (it may be what ends the stream)",
                    ) from None
                if deadline is None:
                    deadline = time.monotonic() + self._recovery.within
                await self._recover(lost, timeout, replay, deadline)
                recovered += 1

    async def _recover(
        self, lost: SessionLost, timeout: float | None, replay: bool, deadline: float
    ) -> None:
        """Reopen, and bring the episode back if ``replay``, before ``deadline``.

        Raises:
            SessionLost: ``lost``, with why it could not be recovered.
        """
        started = time.monotonic()
        replay = replay and (self._base_snapshot is not None or self._base_reset is not None)
        if replay and self._base_snapshot is None and not self._base_reset.HasField("seed"):  # type: ignore[union-attr]
            raise _gave_up(lost, "the episode was not seeded and the env has no snapshots")
        attempts, last = 0, "none"
        for pause, target in self._schedule(deadline):
            await self._io._io_pause(pause)
            attempts += 1
            try:
                await self._io._io_reopen(target)
                if replay:
                    await self._replay(timeout)
            except (SessionRefused, SessionLost, SessionTimeout, _TargetRefused) as failure:
                # A timed-out replay leaves its stream open: the next attempt cancels it.
                last = f"{target or 'own target'}: {failure}"
                continue
            except _NotRecoverable as failure:
                raise _gave_up(lost, str(failure)) from None
            self.recoveries += 1
            self._recovery._counted()
            log.warning(
                "session lost (%s: %s); recovered on %s after %d attempt(s) in %.2fs: "
                "episode %s at step %d (from a %s, %d action(s) replayed)",
                lost.code.name, lost.message, target or "its own target", attempts,
                time.monotonic() - started, self._protocol.episode_id,
                self._protocol.step_count,
                "snapshot" if self._base_snapshot is not None else "seeded reset",
                len(self._actions),
            )  # fmt: skip
            return
        raise _gave_up(
            lost,
            f"no server took the episode within {self._recovery.within:g}s "
            f"({attempts} attempt(s); last: {last})",
        )

    def _schedule(self, deadline: float) -> Iterator[tuple[float, str | None]]:
        """(pause, target) of each attempt until ``deadline``: rounds over the session's
        own target and then the others, no pause within a round, pauses growing between.
        A pause that would pass the deadline is cut to it, and one last round is made
        there: a server back in the window's last second is still found."""
        targets: list[str | None] = [None, *self._recovery.targets]
        pause = 0.0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            yield min(pause, left), targets[0]
            for target in targets[1:]:  # a round begun before the deadline is finished
                yield 0.0, target
            pause = min(max(pause * 2, _FIRST_PAUSE), _MAX_PAUSE)

    async def _replay(self, timeout: float | None) -> None:
        """Restore the base on the fresh session and take the actions since again.

        Raises:
            _TargetRefused: the base was refused here (another key, env or version).
            _NotRecoverable: a replayed action was refused (the env is not deterministic).
            SessionLost: the stream ended again.
        """
        protocol, io = self._protocol, self._io
        try:
            if self._base_snapshot is not None:
                request = protocol.restore_request(self._base_snapshot)
                protocol.restore_result(await io._io_roundtrip(request, timeout))
            else:
                assert self._base_reset is not None
                request = protocol.replayed_reset(self._base_reset)
                protocol.step_result(await io._io_roundtrip(request, timeout))
        except EnvError as error:
            raise _TargetRefused(str(error)) from None
        for index, (action, before) in enumerate(zip(self._actions, self._outcomes, strict=True)):
            try:
                request = protocol.replayed_step(action)
                outcome = protocol.step_result(await io._io_roundtrip(request, timeout))
            except EnvError as error:
                raise _NotRecoverable(f"replayed action {index + 1} was refused: {error}") from None
            if _trace(outcome) != before:
                log.warning(
                    "recovery: replayed action %d gave %s, not %s as before: the env is not "
                    "deterministic; the episode goes on from the replayed state",
                    index + 1, _trace(outcome), before,
                )  # fmt: skip


def _trace(outcome: StepOutcome[Any]) -> tuple[float | None, bool, bool]:
    """What a replayed step must give again (a reward of None, no reward, is not 0)."""
    reward = None if outcome.no_reward else outcome.reward
    return reward, outcome.terminated, outcome.truncated


#: Recoveries one call may cause: past them, a call that lost each fresh stream is given
#: up on (it may be what ends the stream).
_MAX_RETRIES = 2


def _gave_up(lost: SessionLost, why: str) -> SessionLost:
    return SessionLost(lost.code, f"{lost.message}; not recovered: {why}")
