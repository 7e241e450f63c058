"""The one request driver: the episodes of a stream's envs, and each command over them.

Every stream is a driver over N envs -- a Session is a driver of one, seen through
``session_view.py``; a VectorSession is one of N, seen through ``vector_view.py``. The
views turn their wire's requests into the calls below and the results back into their
wire's answers; the driver owns what both need once:

- each env's bookkeeping (episode id, step count, its :class:`~.phases.Phase`), so the
  phase machine, the autoreset books and what a failure does to an episode live here;
- the autoresets of a loop batch: each step carries them (``batch.Autoresets``): under
  NEXT_STEP the envs stepped whose episodes ended (their phase) and the ids of the
  episodes they start, under SAME_STEP an id for every env stepped, and the options of
  each env's last reset by the client (kept here; a restore drops them). The batch keeps
  no autoreset state; a native batch makes its own autoresets;
- the envs lost with their env process (``--isolated``): the batch calls report them
  (``calls.Losses``), they are LOST here, and the driver says what a request naming one
  gets (:meth:`Driver.book_lost`);
- which envs may step, and what the ones that may not are told (in the view's words);
- snapshots, sealed and opened with ``snapshots.py`` (the same bytes for both kinds of
  stream: a snapshot of one env of a vector restores into a Session and back), each
  authenticated before any env code sees it;
- what a refused batch call does to the episodes (:meth:`Driver.refused`);
- the message limit for answers it can measure before they are built.

The envs themselves are behind :class:`~.calls.BatchCalls`, in this process or spread
over env processes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import Message

from openenv_grpc.environment import AutoresetMode
from openenv_grpc.server.errors import RequestError, RowError, describe, qualname
from openenv_grpc.server.local.batch import NO_AUTORESETS, Autoresets, BatchOutcome
from openenv_grpc.server.local.calls import (
    BatchCalls,
    BatchRefused,
    LosesEnvs,
    ResetArgs,
    RestoreArgs,
    StepArgs,
)
from openenv_grpc.server.model.phases import (
    CAPTURED_PHASE,
    RESTORED_PHASE,
    Phase,
    Words,
    ended_phase,
    new_episode_id,
)
from openenv_grpc.server.model.queries import QUERIES, AnswerTooLarge, BatchStates, ReadsWithin
from openenv_grpc.server.model.snapshots import (
    Captured,
    SnapshotRefused,
    SnapshotSeal,
    default_seal,
    sealing,
)
from openenv_grpc.server.model.spec import EnvSpec
from openenv_grpc.server.process.metrics import ORPHANED_STEPS

__all__ = ["Driver", "Restored", "Sealed"]

log = logging.getLogger(__name__)

_FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
_INTERNAL = grpc.StatusCode.INTERNAL.value[0]
_DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED.value[0]
#: Per-env codes after which the env is a fresh one (its process died or was stopped).
_REPLACED = {_UNAVAILABLE, _DEADLINE_EXCEEDED}
#: Envs whose states (or snapshots) a large command reads first, to measure their size.
_STATE_PROBE = 4
#: The phases of an ended episode (under NEXT_STEP, its next step autoresets it).
_ENDED = (Phase.TERMINATED, Phase.TRUNCATED)


@dataclass(slots=True)
class Sealed:
    """A snapshot command's result: the sealed snapshots of ``rows``, the envs that have
    none, and the payload's bytes (over the limit: ``too_large`` says so, nothing sealed)."""

    rows: list[int] = field(default_factory=list)
    snapshots: list[bytes] = field(default_factory=list)
    errors: dict[int, RowError] = field(default_factory=dict)
    too_large: str | None = None


@dataclass(slots=True)
class Restored:
    """A restore command's result: the envs restored (their books are the captured ones
    now) and the envs that were not."""

    rows: list[int] = field(default_factory=list)
    errors: dict[int, RowError] = field(default_factory=dict)


@dataclass(slots=True)
class _Lost:
    """What the driver keeps of an env in :attr:`Phase.LOST`."""

    #: What it is told, once, by the next step, state or snapshot that names it.
    error: RowError
    #: The phase its client knows it in: what a refusal of a request naming it quotes,
    #: and what a call that ran before the loss books.
    known: Phase


class Driver:
    """The envs of one stream (``size`` of them) and their episodes."""

    __slots__ = (
        "_calls", "_closing", "_held", "_lost", "_max_response", "_metrics", "_mode",
        "_options", "_orphan", "_quiet", "_seal", "_size", "_spec", "_steppable",
        "_wire_options", "_words", "all", "ends", "episode_ids", "phases", "step_counts",
    )  # fmt: skip

    def __init__(
        self,
        spec: EnvSpec,
        size: int,
        autoreset: AutoresetMode,
        calls: BatchCalls,
        words: Words,
        snapshots: SnapshotSeal | None = None,
        *,
        max_response: int | None = None,
    ) -> None:
        self._spec = spec
        #: Seals and opens the envs' snapshots (the server's key ring and size limit).
        self._seal = snapshots if snapshots is not None else default_seal(spec.name, spec.version)
        #: The largest answer the stream may send (--max-message-bytes); None: no check
        #: here (the session still checks the serialized answer).
        self._max_response = max_response
        self._size = size
        self._mode = autoreset
        self._calls = calls
        self._words = words
        #: Every index, in order: what an empty index list means (never mutated).
        self.all: Sequence[int] = range(size)
        #: The phases in which an env may be stepped: under NEXT_STEP an ended episode
        #: steps into an autoreset.
        self._steppable = {Phase.RUNNING}
        if autoreset is AutoresetMode.NEXT_STEP:
            self._steppable |= {Phase.TERMINATED, Phase.TRUNCATED}
        self.phases = [Phase.NO_EPISODE] * size
        self.episode_ids = [""] * size
        self.step_counts = [0] * size
        #: Set when nothing is left to serve (closed, or not replaceable): the stream ends.
        self.ends = False
        #: Several requests may be in flight at once on a vector stream: each env is held
        #: by at most one of them (env index -> the request's id), from its check to its
        #: answer, so nothing of one env is lost or reordered.
        self._held: dict[int, int] = {}
        #: Set while no env is held (a close waits for it).
        self._quiet: asyncio.Event | None = None
        #: The request id of a close under way: requests after it are refused.
        self._closing: int | None = None
        #: Counts the steps the envs completed after their request was given up.
        self._metrics = ORPHANED_STEPS.get()
        self._orphan = self._orphaned  # bound once: every step hands it on
        #: The envs in Phase.LOST (index -> what it is told, the phase its client knows):
        #: an env is here exactly when its phase is LOST.
        self._lost: dict[int, _Lost] = {}
        #: Env index -> the options of its last reset by the client (decoded, and as they
        #: came on the wire), which its autoresets use; absent: none (or a restore since).
        self._options: dict[int, Message] = {}
        self._wire_options: dict[int, any_pb2.Any] = {}
        if isinstance(calls, LosesEnvs):
            calls.report_losses(self)

    @property
    def spec(self) -> EnvSpec:
        return self._spec

    @property
    def size(self) -> int:
        return self._size

    @property
    def native(self) -> bool:
        """The stream's envs answer in a native batch form."""
        return self._calls.native

    @property
    def words(self) -> Words:
        return self._words

    # -- which envs may step --------------------------------------------------------------

    def cannot_step(self, index: int) -> str | None:
        """Why env ``index`` may not step now (None: it may; a LOST env that may is told
        of its loss by the step)."""
        phase = self.known_phase(index)
        return None if phase in self._steppable else self._words.needs_reset[phase]

    def blocked(self, indices: Sequence[int]) -> dict[int, RowError]:
        """The envs of ``indices`` that may not step, with their FAILED_PRECONDITION."""
        phases, steppable = self.phases, self._steppable
        # The phases of the envs named, as a set: one pass in C for the common case
        # where every one may step.
        named = set(phases) if indices is self.all else {phases[i] for i in indices}
        if named <= steppable:
            return {}
        words, known = self._words, self.known_phase
        return {
            index: RowError(_FAILED_PRECONDITION, words.row(index, words.needs_reset[phase]))
            for index in indices
            if (phase := known(index)) not in steppable
        }

    def known_phase(self, index: int) -> Phase:
        """Env ``index``'s phase as its client knows it (a LOST env's, from before)."""
        phase = self.phases[index]
        return self._lost[index].known if phase is Phase.LOST else phase

    # -- envs lost with their env process ---------------------------------------------------

    def book_lost(self, errors: Mapping[int, RowError]) -> None:
        """``calls.Losses``: these envs are fresh ones since their process was lost to a
        call that did not name them (or their answer was never sent). Each is LOST: the
        next step, state or snapshot naming it is told its error (never run on an env that
        was not reset), once, and it has no episode from then on; a reset or a restore
        that succeeds gives it an episode first; a step in batch form naming it is
        refused as a whole."""
        phases, lost = self.phases, self._lost
        for index, error in errors.items():
            entry = lost.get(index)
            if entry is None:
                lost[index] = _Lost(error, phases[index])
                phases[index] = Phase.LOST
            else:
                entry.error = error

    def book_told(self, indices: Iterable[int]) -> None:
        """``calls.Losses``: these envs learn of their loss from the answer under way."""
        lost = self._lost
        if lost:
            for index in indices:
                entry = lost.pop(index, None)
                if entry is not None:
                    self.phases[index] = entry.known

    def _tell(self, indices: Sequence[int]) -> tuple[Sequence[int], dict[int, RowError]]:
        """The envs of ``indices`` that are not LOST, and the LOST ones' errors: these are
        told now (no longer LOST; the answer's errors book them as fresh envs)."""
        lost = self._lost
        if not lost or lost.keys().isdisjoint(indices):
            return indices, {}
        rest: list[int] = []
        told: dict[int, RowError] = {}
        for index in indices:
            entry = lost.pop(index, None)
            if entry is None:
                rest.append(index)
            else:
                self.phases[index] = entry.known
                told[index] = entry.error
        return rest, told

    def _found(self, indices: Sequence[int]) -> dict[int, RowError]:
        """A reset or a restore names these envs: the LOST ones are not (returned, for
        :meth:`_still_lost` to book again those that got no episode)."""
        lost = self._lost
        if not lost or lost.keys().isdisjoint(indices):
            return {}
        found: dict[int, RowError] = {}
        for index in indices:
            entry = lost.pop(index, None)
            if entry is not None:
                self.phases[index] = entry.known
                found[index] = entry.error
        return found

    def _still_lost(self, found: dict[int, RowError]) -> None:
        """After a booking: the envs of ``found`` (see :meth:`_found`) that got no episode
        are LOST again, and an env that is LOST stays so, what was booked for it being
        the phase its client knows it in."""
        lost = self._lost
        if lost:
            phases = self.phases
            for index, entry in lost.items():
                if phases[index] is not Phase.LOST:
                    entry.known = phases[index]
                    phases[index] = Phase.LOST
        if found:
            self.book_lost(found)

    def _refuse_lost_batch(self, indices: Sequence[int]) -> None:
        """A batch-form step steps every env it names or none.

        Raises:
            BatchRefused: FAILED_PRECONDITION, some of ``indices`` are LOST.
        """
        lost = [index for index in indices if index in self._lost]
        if lost:
            named = ", ".join(map(str, lost[:8])) + (" ..." if len(lost) > 8 else "")
            refused = BatchRefused(
                _FAILED_PRECONDITION,
                f"envs {named} are fresh ones since their env process was lost: reset them "
                "(a batch_action steps every env it names; nothing was done)",
            )
            refused.indices = indices
            raise refused

    # -- requests in flight -----------------------------------------------------------------

    def hold(self, indices: Sequence[int], request_id: int) -> None:
        """Hold the envs of ``indices`` for request ``request_id`` until :meth:`let_go`.

        Raises:
            RequestError: FAILED_PRECONDITION, an env named is held by a request still in
                flight, or a close is under way (nothing was done).
        """
        held = self._held
        if self._closing is not None:
            raise RequestError(
                _FAILED_PRECONDITION,
                f"the stream is closing (request {self._closing} closes it): nothing was done",
            )
        if held:
            self._refuse_held(indices, held)
        if self._quiet is not None:  # a close waits until nothing is held
            self._quiet.clear()
        if indices is self.all:  # every env: one entry stands for them all
            held[-1] = request_id
        else:
            for index in indices:
                held[index] = request_id

    def _refuse_held(self, indices: Sequence[int], held: dict[int, int]) -> None:
        """Raise if a request in flight holds an env of ``indices`` (``held`` not empty)."""
        if -1 in held:  # a request in flight names every env
            busy, owner = list(indices), {i: held[-1] for i in indices}
        elif indices is self.all or not held.keys().isdisjoint(indices):
            busy, owner = [i for i in indices if i in held], held
        else:
            return
        named = ", ".join(f"env {i} (request {owner[i]})" for i in busy[:8])
        more = f" and {len(busy) - 8} more" if len(busy) > 8 else ""
        raise RequestError(
            _FAILED_PRECONDITION,
            f"{named}{more} still in flight: a request may name only envs that no request "
            "in flight names; wait for its answer (nothing was done)",
        )

    def let_go(self, indices: Sequence[int]) -> None:
        """Release the envs :meth:`hold` took."""
        held = self._held
        if indices is self.all:
            held.pop(-1, None)
        else:
            for index in indices:
                held.pop(index, None)
        if not held and self._quiet is not None:
            self._quiet.set()

    async def closing(self, request_id: int) -> None:
        """Refuse every request from now on and wait until no env is held (the requests in
        flight are answered before the close)."""
        self._closing = request_id
        if not self._held:
            return
        if self._quiet is None:
            self._quiet = asyncio.Event()
        await self._quiet.wait()

    # -- commands ---------------------------------------------------------------------------

    async def step(self, args: StepArgs) -> tuple[BatchOutcome, int, float]:
        """Step the envs of ``args`` (all may step: see :meth:`blocked`); returns the
        outcome, the env steps taken (a NEXT_STEP autoreset row took none) and the call's
        seconds.

        Raises:
            BatchRefused: the whole call failed (see :meth:`refused`).
        """
        started = time.perf_counter()
        named = args.indices
        told: dict[int, RowError] = {}
        if self._lost:  # a LOST env is told, not stepped; in batch form, nothing steps
            if args.batch_form:
                self._refuse_lost_batch(named)
            else:
                indices, told = self._tell(named)
                if told:
                    keep = [k for k, index in enumerate(named) if index not in told]
                    actions, wire = args.actions, args.wire
                    args = StepArgs(
                        indices, [actions[k] for k in keep], [wire[k] for k in keep], False
                    )
        # Should the stream end while the envs step, their steps are booked and counted
        # all the same (an env in a thread finishes its step); else its answer counts them.
        args.orphaned = self._orphan
        if self._mode is not AutoresetMode.DISABLED:
            args.autoresets = self._autoresets(args.indices)
        try:
            outcome = await self._calls.step(args) if args.indices else BatchOutcome()
        except BatchRefused as err:
            err.indices = named
            raise
        if told:  # the answer's errors: the told ones first, in index order
            told.update(outcome.errors)
            outcome.errors = told
        seconds = time.perf_counter() - started
        return outcome, self._book_step(outcome), seconds

    def _autoresets(self, indices: Sequence[int]) -> Autoresets:
        """The autoresets a step of ``indices`` makes (a loop batch's; a native batch makes
        its own): under NEXT_STEP the envs whose episodes ended, each with a fresh episode
        id, under SAME_STEP every env stepped (should its episode end at this step), each
        with the options of its last reset by the client. A SAME_STEP autoreset's id is
        made where it happens and reported in the outcome: an id for every env on every
        step would cost each step of N envs N ids (and, isolated, N ids in its frame) for
        the few episodes that end."""
        if self._calls.native:
            return NO_AUTORESETS
        if self._mode is AutoresetMode.SAME_STEP:
            kept = self._options
            # No id ("": made where the autoreset happens); only the envs with options.
            ids = {index: "" for index in indices if index in kept} if kept else {}
            if not ids:
                return NO_AUTORESETS
        else:
            phases = self.phases
            if Phase.TERMINATED not in phases and Phase.TRUNCATED not in phases:
                return NO_AUTORESETS
            ids = {index: new_episode_id() for index in indices if phases[index] in _ENDED}
            if not ids:
                return NO_AUTORESETS
        options, wire = self._options, self._wire_options
        if not options:
            return Autoresets(ids)
        return Autoresets(
            ids,
            {index: options[index] for index in ids if index in options},
            {index: wire[index] for index in ids if index in wire},
        )

    def _orphaned(self, outcome: BatchOutcome, seconds: float) -> None:
        """Book a step the envs completed (in ``seconds``) after its request was given up,
        and count its env steps in the session's metrics, as its answer would have been."""
        stepped = self._book_step(outcome)
        if stepped == 1:
            self._metrics.step(seconds)
        elif stepped:
            self._metrics.env_steps(stepped, seconds)

    async def reset(self, args: ResetArgs) -> BatchOutcome:
        """Reset the envs of ``args``; their episodes start (or break).

        Raises:
            BatchRefused: the whole call failed.
        """
        found = self._found(args.indices)  # a reset may give a LOST env an episode
        try:
            outcome = await self._calls.reset(args)
        except BaseException as err:
            if isinstance(err, BatchRefused):
                err.indices = args.indices
            self._still_lost(found)  # nothing was done: they are still lost
            raise
        chosen = dict(zip(args.indices, args.episode_ids, strict=True))
        phases, ids, counts = self.phases, self.episode_ids, self.step_counts
        for index, terminated, truncated in zip(
            outcome.rows, outcome.terminated, outcome.truncated, strict=True
        ):
            ids[index] = chosen[index]
            counts[index] = 0
            phases[index] = ended_phase(terminated, truncated)
        if self._mode is not AutoresetMode.DISABLED:
            self._keep_options(args, outcome.rows)
        self._book_errors(outcome.errors)
        # Only a reset that succeeded gave a LOST env an episode; a failed one did not.
        self._still_lost({i: e for i, e in found.items() if i in outcome.errors})
        return outcome

    def _keep_options(self, args: ResetArgs, rows: Sequence[int]) -> None:
        """The envs of ``rows`` were reset by ``args``: their autoresets use its options."""
        options, wire = self._options, self._wire_options
        position = {index: k for k, index in enumerate(args.indices)}
        for index in rows:
            k = position[index]
            option = args.options[k]
            if option is None:
                options.pop(index, None)
                wire.pop(index, None)
            else:
                options[index] = option
                wired = args.wire_options[k]
                if wired is None:
                    wire.pop(index, None)
                else:
                    wire[index] = wired

    async def query(self, name: str, indices: Sequence[int]) -> tuple[BatchStates, int]:
        """Each env's answer to query ``name`` (``queries.py``) and their bytes, read no
        further than the message limit (see :meth:`_states_within`); no episode changes.

        Raises:
            BatchRefused: the whole call failed.
        """
        got = await self._states_told(name, indices)
        self._forget_replaced(got[0].errors)
        return got

    async def snapshot(self, indices: Sequence[int]) -> Sealed:
        """Capture each env of ``indices``, sealed with its bookkeeping; no episode changes.

        Raises:
            BatchRefused: the whole call failed.
        """
        out = Sealed()
        errors = self._without_snapshots(indices)
        if errors is not None:
            out.errors = errors
            return out
        errors = out.errors
        known, words = self.known_phase, self._words
        capture = [i for i in indices if known(i) in CAPTURED_PHASE]
        for index in indices:
            if (phase := known(index)) not in CAPTURED_PHASE:
                message = words.row(index, words.nothing_to_capture[phase])
                errors[index] = RowError(_FAILED_PRECONDITION, message)
        got, payload = (
            await self._states_told("snapshot", capture) if capture else (BatchStates(), 0)
        )
        errors.update(got.errors)
        self._forget_replaced(got.errors)
        out.too_large = self.too_large("snapshot", payload)
        if out.too_large is not None:
            return out
        ids, counts = self.episode_ids, self.step_counts
        captured = [
            Captured(ids[i], counts[i], CAPTURED_PHASE[known(i)], data)
            for i, data in zip(got.rows, got.states, strict=True)
        ]
        sealed = await sealing(lambda: self._seal.seal_each(captured), payload)
        for index, one in zip(got.rows, sealed, strict=True):
            if isinstance(one, SnapshotRefused):
                errors[index] = RowError(one.code, words.row(index, one.message))
            else:
                out.rows.append(index)
                out.snapshots.append(one)
        return out

    async def restore(self, indices: Sequence[int], data: Sequence[bytes]) -> Restored:
        """Authenticate each snapshot, hand the envs theirs, and take over the captured
        bookkeeping; a refused snapshot leaves that env's episode as it was.

        Raises:
            BatchRefused: the whole call failed.
        """
        out = Restored()
        errors = self._without_snapshots(indices)
        if errors is not None:
            out.errors = errors
            return out
        errors, words = out.errors, self._words
        opened = await sealing(lambda: self._seal.open_each(data), sum(map(len, data)))
        named: list[int] = []
        captured: list[Captured] = []
        for index, one in zip(indices, opened, strict=True):
            if isinstance(one, SnapshotRefused):
                errors[index] = RowError(one.code, words.row(index, one.message))
            else:
                named.append(index)
                captured.append(one)
        found = self._found(named)  # a restore may give a LOST env an episode
        try:
            failed = await self._calls.restore(RestoreArgs(named, captured)) if named else {}
        except BaseException as err:
            if isinstance(err, BatchRefused):
                err.indices = named
            self._still_lost(found)
            raise
        phases, ids, counts = self.phases, self.episode_ids, self.step_counts
        for index, one in zip(named, captured, strict=True):
            if index not in failed:
                ids[index] = one.episode_id
                counts[index] = one.step_count
                phases[index] = RESTORED_PHASE[one.phase]
                # Its autoresets use no options: the slot's belong to the episode replaced.
                self._options.pop(index, None)
                self._wire_options.pop(index, None)
                out.rows.append(index)
        self._book_errors(failed)
        self._still_lost({i: e for i, e in found.items() if i in failed})
        errors.update(failed)
        return out

    async def close_command(self) -> None:
        """Close every env for a close command; the stream ends after its answer.

        Raises:
            RequestError: INTERNAL, what an env's ``close`` raised (closed all the same).
            BatchRefused: the close failed as a whole (its envs' process, e.g.).
        """
        self.ends = True
        try:
            await self._calls.close_strictly()
        except BatchRefused:
            raise
        except Exception as exc:
            log.exception("environment close() raised")
            raise RequestError(_INTERNAL, f"close failed: {describe(exc)}", qualname(exc)) from None

    async def close(self) -> None:
        """Close every env, once (``backend.SessionBackend``)."""
        await self._calls.close()

    def refused(self, err: BatchRefused, command: str | None) -> None:
        """Book what a refused batch call did to the episodes: a hung call's envs are fresh
        ones, a raising reset or step broke the episodes it named."""
        if err.ends:
            self.ends = True
        if err.replaced or err.ends:
            for index in range(self._size):
                self._forget(index)
        elif err.broken and command not in QUERIES:  # a query changes no episode
            for index in err.indices:
                if self.known_phase(index) is not Phase.NO_EPISODE:
                    self.phases[index] = Phase.BROKEN
        self._still_lost({})

    def too_large(self, command: str, payload: int) -> str | None:
        """The in-band message for a result whose payloads alone (``payload`` bytes: a lower
        bound of its size) are over the message limit; None when they are not.

        Checked before an answer is built: an over-large one would only be built and
        serialized on the event loop to be thrown away (N frames of N envs' states are
        hundreds of MB from one small request). The session checks the serialized answer
        too, for what this bound does not see (infos, ids, framing)."""
        limit = self._max_response
        if limit is None or payload <= limit:
            return None
        return (
            f"the {command} response is at least {payload} bytes, over the server's message "
            f"limit of {limit} bytes (--max-message-bytes): the {command} took effect but "
            "its result cannot be sent (name fewer envs per request, by indices); the "
            "session goes on"
        )

    # -- reading states ---------------------------------------------------------------------

    def _without_snapshots(self, indices: Sequence[int]) -> dict[int, RowError] | None:
        """UNIMPLEMENTED for every env named when the env has no snapshots; else None."""
        if self._spec.snapshots:
            return None
        error = RowError(
            _UNIMPLEMENTED,
            f"environment {self._spec.name!r} does not support snapshots (it does not "
            f"implement snapshot() and restore()); {self._words.stream} goes on",
        )
        return dict.fromkeys(indices, error)

    async def _states_told(self, name: str, indices: Sequence[int]) -> tuple[BatchStates, int]:
        """:meth:`_states_within`, the LOST envs of ``indices`` told rather than read."""
        indices, told = self._tell(indices)
        if not told:
            return await self._states_within(name, indices)
        try:
            got = await self._states_within(name, indices) if indices else (BatchStates(), 0)
        except BaseException:
            self.book_lost(told)  # not told: the next call naming them is
            raise
        states = got[0]
        told.update(states.errors)  # the told ones first, in index order
        states.errors = told
        return got

    async def _states_within(self, name: str, indices: Sequence[int]) -> tuple[BatchStates, int]:
        """What query ``name`` answers for ``indices``, and its bytes, read no further
        than the message limit. Batch calls that read within a room themselves
        (``ReadsWithin``: the env processes) are given the limit and read env by env;
        here, a first call about a few envs measures their answers' size, each next one
        names as many envs as would fit in what is left of the limit at the largest answer
        seen, but never more than were read so far (envs that failed or answered little
        say nothing of the others). Once over the limit the envs not read yet are left
        alone, so one small request never makes the envs build much more than one message
        of them (N envs' frames or snapshots would be N times one): at most about twice
        the limit, or the envs read so far again when the first ones answered little.
        Over the limit, the bytes returned are a lower bound (above the limit) and the
        states may be missing."""
        limit, count, calls = self._max_response, len(indices), self._calls
        if limit is not None and isinstance(calls, ReadsWithin):
            try:
                states = await calls.query_within(name, indices, limit)
            except AnswerTooLarge as over:
                return BatchStates(errors=over.errors), over.at_least
            return states, sum(map(len, states.states))
        read: Callable[[Sequence[int]], Awaitable[BatchStates]] = functools.partial(
            calls.query, name
        )
        if limit is None or count <= _STATE_PROBE:
            states = await read(indices)
            return states, sum(map(len, states.states))
        out = BatchStates()
        payload = start = 0
        chunk = _STATE_PROBE
        largest = 0
        while start < count:
            part = await read(indices[start : start + chunk])
            out.rows.extend(part.rows)
            out.states.extend(part.states)
            out.errors.update(part.errors)
            sizes = list(map(len, part.states))
            payload += sum(sizes)
            largest = max(largest, *sizes, 0)
            start += chunk
            if payload > limit:
                break
            fits = count if not largest else int((limit - payload) / largest) + 1
            chunk = max(1, min(fits, start))
        return out, payload

    # -- bookkeeping ----------------------------------------------------------------------

    def _book_step(self, outcome: BatchOutcome) -> int:
        """Advance each env's episode from a step's rows; returns the env steps taken."""
        # Every env answered: the rows are 0 .. size - 1, booked as whole columns.
        full = len(outcome.rows) == self._size
        stepped = self._book_all(outcome) if full else self._book_rows(outcome)
        if outcome.errors:
            self._book_errors(outcome.errors, stepping=True)
        if self._lost:
            self._still_lost({})
        return stepped

    def _book_all(self, outcome: BatchOutcome) -> int:
        """:meth:`_book_step` when every env has a row: whole columns at once."""
        terminated, truncated, marks = outcome.terminated, outcome.truncated, outcome.autoreset
        running, ended, cut = Phase.RUNNING, Phase.TERMINATED, Phase.TRUNCATED
        if marks is None:
            self.step_counts = [count + 1 for count in self.step_counts]
            if True in terminated or True in truncated:
                self.phases = [
                    ended if term else cut if trunc else running
                    for term, trunc in zip(terminated, truncated, strict=True)
                ]
            else:
                self.phases = [running] * self._size
            return self._size
        self.step_counts = [
            0 if auto else count + 1 for count, auto in zip(self.step_counts, marks, strict=True)
        ]
        # A loop's NEXT_STEP autoreset row has the new episode's first flags: ended there,
        # its next step autoresets it again (see _restart_ends).
        restart_ends = self._restart_ends()
        self.phases = [
            running if auto and not restart_ends else ended if term else cut if trunc else running
            for term, trunc, auto in zip(terminated, truncated, marks, strict=True)
        ]
        ids, new_ids = self.episode_ids, outcome.new_episode_ids
        autoreset = [index for index, auto in enumerate(marks) if auto]
        for index in autoreset:  # a new episode began: the row's observation is its first
            ids[index] = new_ids.get(index) or new_episode_id()
        if self._mode is AutoresetMode.SAME_STEP:
            return self._size  # SAME_STEP's autoreset rows also took the ending step
        return self._size - len(autoreset)

    def _book_rows(self, outcome: BatchOutcome) -> int:
        """:meth:`_book_step` for some envs' rows, one by one."""
        phases, ids, counts = self.phases, self.episode_ids, self.step_counts
        marks = outcome.autoreset
        stepped = 0
        if marks is None:
            for index, terminated, truncated in zip(
                outcome.rows, outcome.terminated, outcome.truncated, strict=True
            ):
                counts[index] += 1
                phases[index] = ended_phase(terminated, truncated)
            return len(outcome.rows)
        same_step = self._mode is AutoresetMode.SAME_STEP
        restart_ends = self._restart_ends()
        new_ids = outcome.new_episode_ids
        for index, terminated, truncated, auto in zip(
            outcome.rows, outcome.terminated, outcome.truncated, marks, strict=True
        ):
            if auto:  # a new episode began: the row's observation is its first
                ids[index] = new_ids.get(index) or new_episode_id()
                counts[index] = 0
                phases[index] = (
                    ended_phase(terminated, truncated) if restart_ends else Phase.RUNNING
                )
                stepped += same_step  # SAME_STEP's row also took the ending step
            else:
                counts[index] += 1
                phases[index] = ended_phase(terminated, truncated)
                stepped += 1
        return stepped

    def _restart_ends(self) -> bool:
        """A loop batch's NEXT_STEP autoreset row carries its reset's flags: an episode that
        ended as it began is ended (its next step autoresets it again), as a client reset's
        is. (A native batch's autoresets are its own: its rows start RUNNING.)"""
        return self._mode is AutoresetMode.NEXT_STEP and not self._calls.native

    def _book_errors(self, errors: dict[int, RowError], stepping: bool = False) -> None:
        # An env may keep its episode after a step that raised (step_errors_end_episode).
        keep = stepping and not getattr(self._spec.env_class, "step_errors_end_episode", True)
        for index, error in errors.items():
            if error.code == _INTERNAL:
                if not keep:
                    self.phases[index] = Phase.BROKEN
            elif error.code in _REPLACED:  # a fresh env took its place
                self._forget(index)

    def _forget_replaced(self, errors: dict[int, RowError]) -> None:
        """A state or snapshot found envs replaced by fresh ones (their process was lost):
        their episodes are gone. (Other failures of those calls change no episode.)"""
        for index, error in errors.items():
            if error.code in _REPLACED:
                self._forget(index)
        if self._lost:
            self._still_lost({})

    def _forget(self, index: int) -> None:
        self.phases[index] = Phase.NO_EPISODE
        self.episode_ids[index] = ""
        self.step_counts[index] = 0
        self._options.pop(index, None)
        self._wire_options.pop(index, None)
