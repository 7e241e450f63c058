"""The one request driver: the episodes of a stream's N envs (a Session is N = 1) and each
command over them. The views (``session_view.py``, ``vector_view.py``) turn their wire's
requests into these calls; the driver owns each env's books (episode id, step count,
:class:`~.phases.Phase`), the autoresets a loop batch makes, the envs lost with their env
process, which envs may step, snapshots, and the message limit it can check early.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
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
_UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED.value[0]
#: Per-env codes after which the env is a fresh one (its process died or was stopped).
_REPLACED = {grpc.StatusCode.UNAVAILABLE.value[0], grpc.StatusCode.DEADLINE_EXCEEDED.value[0]}
#: Envs whose states (or snapshots) a large command reads first, to measure their size.
_STATE_PROBE = 4
_ENDED = (Phase.TERMINATED, Phase.TRUNCATED)


@dataclass(slots=True)
class Sealed:
    """A snapshot command's result: the sealed snapshots of ``rows``, the envs that have
    none, and, over the message limit, what the answer says instead (nothing sealed)."""

    rows: list[int] = field(default_factory=list)
    snapshots: list[bytes] = field(default_factory=list)
    errors: dict[int, RowError] = field(default_factory=dict)
    too_large: str | None = None


@dataclass(slots=True)
class Restored:
    """A restore command's result: the envs restored and the envs that were not."""

    rows: list[int] = field(default_factory=list)
    errors: dict[int, RowError] = field(default_factory=dict)


@dataclass(slots=True)
class _Lost:
    """An env in :attr:`Phase.LOST`: what the next step, state or snapshot naming it is
    told, once, and the phase its client knows it in."""

    error: RowError
    known: Phase


class Driver:
    """The envs of one stream (``size`` of them) and their episodes."""

    __slots__ = (
        "_calls", "_closing", "_held", "_lost", "_max_response", "_metrics", "_mode",
        "_options", "_orphan", "_quiet", "_seal", "_steppable", "_words",
        "all", "ends", "episode_ids", "phases", "size", "spec", "step_counts",
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
        self.spec = spec
        self._seal = snapshots if snapshots is not None else default_seal(spec.name, spec.version)
        #: The largest answer the stream may send; None: the session checks it alone.
        self._max_response = max_response
        self.size = size
        self._mode = autoreset
        self._calls = calls
        self._words = words
        self.all: Sequence[int] = range(size)  # what an empty index list means
        self._steppable = {Phase.RUNNING}
        if autoreset is AutoresetMode.NEXT_STEP:  # an ended episode steps into an autoreset
            self._steppable |= {Phase.TERMINATED, Phase.TRUNCATED}
        self.phases = [Phase.NO_EPISODE] * size
        self.episode_ids = [""] * size
        self.step_counts = [0] * size
        self.ends = False  # nothing is left to serve (closed, or not replaceable)
        #: Env index -> the request in flight that holds it (-1: all envs).
        self._held: dict[int, int] = {}
        self._quiet: asyncio.Event | None = None  # set while no env is held
        self._closing: int | None = None  # the request id of a close under way
        #: Counts the steps the envs completed after their request was given up.
        self._metrics = ORPHANED_STEPS.get()
        self._orphan = self._orphaned  # bound once: every step hands it on
        self._lost: dict[int, _Lost] = {}  # exactly the envs whose phase is LOST
        #: Env index -> the options of its last reset by the client (decoded, and as they
        #: came on the wire), which its autoresets use; a restore drops them.
        self._options: dict[int, Message] = {}
        if isinstance(calls, LosesEnvs):
            calls.report_losses(self)

    @property
    def native(self) -> bool:
        """The stream's envs answer in a native batch form."""
        return self._calls.native

    def cannot_step(self, index: int) -> str | None:
        """Why env ``index`` may not step now (None: it may; a LOST env is told by the
        step)."""
        if self.phases[index] in self._steppable:  # LOST is not: the common case first
            return None
        phase = self.known_phase(index)
        return None if phase in self._steppable else self._words.needs_reset[phase]

    def blocked(self, indices: Sequence[int]) -> dict[int, RowError]:
        """The envs of ``indices`` that may not step, with their FAILED_PRECONDITION."""
        phases, steppable = self.phases, self._steppable
        # One pass in C for the common case where every one may step.
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

    # -- envs lost with their env process (``calls.Losses``) --------------------------------

    def book_lost(self, errors: Mapping[int, RowError]) -> None:
        """These envs are fresh ones since their process was lost: each is LOST until the
        next step, state or snapshot naming it is told its error, or a reset or restore
        gives it an episode; a batch-form step naming it is refused as a whole."""
        phases, lost = self.phases, self._lost
        for index, error in errors.items():
            entry = lost.get(index)
            if entry is None:
                lost[index] = _Lost(error, phases[index])
                phases[index] = Phase.LOST
            else:
                entry.error = error

    def book_told(self, indices: Iterable[int]) -> None:
        """These envs learn of their loss from the answer under way."""
        lost = self._lost
        if lost:
            for index in indices:
                entry = lost.pop(index, None)
                if entry is not None:
                    self.phases[index] = entry.known

    def _tell(self, indices: Sequence[int]) -> tuple[Sequence[int], dict[int, RowError]]:
        """The envs of ``indices`` not LOST, and the LOST ones' errors, which are no longer
        LOST (told now, or, for a reset or restore, booked again by :meth:`_still_lost`
        should they get no episode)."""
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

    def _still_lost(self, found: dict[int, RowError]) -> None:
        """After a booking: the envs of ``found`` are LOST again, and an env still LOST
        stays so, what was booked for it being the phase its client knows."""
        lost = self._lost
        if lost:
            phases = self.phases
            for index, entry in lost.items():
                if phases[index] is not Phase.LOST:
                    entry.known = phases[index]
                    phases[index] = Phase.LOST
        if found:
            self.book_lost(found)

    # -- requests in flight ---------------------------------------------------------------

    def hold(self, indices: Sequence[int], request_id: int) -> None:
        """Hold the envs of ``indices`` for request ``request_id`` until :meth:`let_go`.
        Raises RequestError (FAILED_PRECONDITION): one is held already, or a close is on."""
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
        if indices is self.all:
            held[-1] = request_id
        else:
            for index in indices:
                held[index] = request_id

    def _refuse_held(self, indices: Sequence[int], held: dict[int, int]) -> None:
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
        held = self._held
        if indices is self.all:
            held.pop(-1, None)
        else:
            for index in indices:
                held.pop(index, None)
        if not held and self._quiet is not None:
            self._quiet.set()

    async def closing(self, request_id: int) -> None:
        """Refuse every request from now on and wait until no env is held."""
        self._closing = request_id
        if not self._held:
            return
        if self._quiet is None:
            self._quiet = asyncio.Event()
        await self._quiet.wait()

    # -- commands -------------------------------------------------------------------------

    async def step(self, args: StepArgs) -> tuple[BatchOutcome, int, float]:
        """Step the envs of ``args`` (all may step: see :meth:`blocked`); returns the
        outcome, the env steps taken (a NEXT_STEP autoreset row took none) and the call's
        seconds. Raises BatchRefused: the whole call failed (see :meth:`refused`)."""
        started = time.perf_counter()
        named = args.indices
        told: dict[int, RowError] = {}
        if self._lost:  # a LOST env is told, not stepped; in batch form, nothing steps
            if args.batch_form:
                lost = [index for index in named if index in self._lost]
                if lost:
                    listed = ", ".join(map(str, lost[:8])) + (" ..." if len(lost) > 8 else "")
                    refused = BatchRefused(
                        _FAILED_PRECONDITION,
                        f"envs {listed} are fresh ones since their env process was lost: reset "
                        "them (a batch_action steps every env it names; nothing was done)",
                    )
                    refused.indices = named
                    raise refused
            else:
                indices, told = self._tell(named)
                if told:
                    keep = [k for k, index in enumerate(named) if index not in told]
                    actions = args.actions
                    args = StepArgs(indices, [actions[k] for k in keep], False)
        # Should the stream end meanwhile, the steps are booked and counted all the same.
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
        """The autoresets a loop batch's step of ``indices`` makes: under NEXT_STEP the
        envs whose episodes ended, each with a fresh episode id; under SAME_STEP the envs
        stepped that have reset options, with no id (made where the autoreset happens, so
        that a step does not cost N ids for the few episodes that end)."""
        if self._calls.native:
            return NO_AUTORESETS
        if self._mode is AutoresetMode.SAME_STEP:
            kept = self._options
            ids = {index: "" for index in indices if index in kept} if kept else {}
        else:
            phases = self.phases
            if Phase.TERMINATED not in phases and Phase.TRUNCATED not in phases:
                return NO_AUTORESETS
            ids = {index: new_episode_id() for index in indices if phases[index] in _ENDED}
        if not ids:
            return NO_AUTORESETS
        options = self._options
        if not options:
            return Autoresets(ids)
        return Autoresets(ids, {index: options[index] for index in ids if index in options})

    def _orphaned(self, outcome: BatchOutcome, seconds: float) -> None:
        """Book and count a step the envs completed after its request was given up."""
        stepped = self._book_step(outcome)
        if stepped == 1:
            self._metrics.step(seconds)
        elif stepped:
            self._metrics.env_steps(stepped, seconds)

    async def reset(self, args: ResetArgs) -> BatchOutcome:
        """Reset the envs of ``args``; raises BatchRefused: the whole call failed."""
        found = self._tell(args.indices)[1]  # a reset may give a LOST env an episode
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
        self._still_lost({i: e for i, e in found.items() if i in outcome.errors})
        return outcome

    def _keep_options(self, args: ResetArgs, rows: Sequence[int]) -> None:
        """The envs of ``rows`` were reset by ``args``: their autoresets use its options."""
        options = self._options
        position = {index: k for k, index in enumerate(args.indices)}
        for index in rows:
            option = args.options[position[index]]
            if option is None:
                options.pop(index, None)
            else:
                options[index] = option

    async def snapshot(self, indices: Sequence[int]) -> Sealed:
        """Capture each env of ``indices``, sealed with its books; raises BatchRefused:
        the whole call failed."""
        if not self.spec.snapshots:
            return Sealed(errors=self._no_snapshots(indices))
        out = Sealed()
        errors = out.errors
        known, words = self.known_phase, self._words
        capture = [i for i in indices if known(i) in CAPTURED_PHASE]
        for index in indices:
            if (phase := known(index)) not in CAPTURED_PHASE:
                message = words.row(index, words.nothing_to_capture[phase])
                errors[index] = RowError(_FAILED_PRECONDITION, message)
        got, payload = await self.query("snapshot", capture) if capture else (BatchStates(), 0)
        errors.update(got.errors)
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
        """Authenticate each snapshot, hand the envs theirs and take over the captured
        books (a refused one changes nothing); raises BatchRefused: the whole call failed."""
        if not self.spec.snapshots:
            return Restored(errors=self._no_snapshots(indices))
        out = Restored()
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
        found = self._tell(named)[1]  # a restore may give a LOST env an episode
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
                out.rows.append(index)
        self._book_errors(failed)
        self._still_lost({i: e for i, e in found.items() if i in failed})
        errors.update(failed)
        return out

    async def close_command(self) -> None:
        """Close every env for a close command. Raises RequestError (INTERNAL): what an
        env's ``close`` raised (closed all the same); BatchRefused: it failed as a whole."""
        self.ends = True
        try:
            await self._calls.close_strictly()
        except BatchRefused:
            raise
        except Exception as exc:
            log.exception("environment close() raised")
            raise RequestError(_INTERNAL, f"close failed: {describe(exc)}", qualname(exc)) from None

    async def close(self) -> None:
        await self._calls.close()

    def refused(self, err: BatchRefused, command: str | None) -> None:
        """Book what a refused batch call did to the episodes: a hung call's envs are fresh
        ones, a raising reset or step broke the episodes it named."""
        if err.ends:
            self.ends = True
        if err.replaced or err.ends:
            for index in range(self.size):
                self._forget(index)
        elif err.broken and command not in QUERIES:  # a query changes no episode
            for index in err.indices:
                if self.known_phase(index) is not Phase.NO_EPISODE:
                    self.phases[index] = Phase.BROKEN
        self._still_lost({})

    def too_large(self, command: str, payload: int) -> str | None:
        """The in-band message for a result whose payloads alone (``payload`` bytes) are
        over the message limit, checked before the answer is built (N envs' frames would
        be built on the loop to be thrown away); None when they are not."""
        limit = self._max_response
        if limit is None or payload <= limit:
            return None
        return (
            f"the {command} response is at least {payload} bytes, over the server's message "
            f"limit of {limit} bytes (--max-message-bytes): the {command} took effect but "
            "its result cannot be sent (name fewer envs per request, by indices); the "
            "session goes on"
        )

    # -- reading states -------------------------------------------------------------------

    def _no_snapshots(self, indices: Sequence[int]) -> dict[int, RowError]:
        error = RowError(
            _UNIMPLEMENTED,
            f"environment {self.spec.name!r} does not support snapshots (it does not "
            f"implement snapshot() and restore()); {self._words.stream} goes on",
        )
        return dict.fromkeys(indices, error)

    async def query(self, name: str, indices: Sequence[int]) -> tuple[BatchStates, int]:
        """Each env's answer to query ``name`` (``queries.py``) and their bytes, read no
        further than the message limit; LOST envs are told rather than read, envs found
        replaced lose their episodes. Raises BatchRefused: the whole call failed."""
        indices, told = self._tell(indices)  # empty only when every env named was told
        try:
            got = await self._states_within(name, indices) if indices else (BatchStates(), 0)
        except BaseException:
            self.book_lost(told)  # not told: the next call naming them is
            raise
        if told:  # the told ones first, in index order
            told.update(got[0].errors)
            got[0].errors = told
        for index, error in got[0].errors.items():
            if error.code in _REPLACED:  # (other failures of a read change no episode)
                self._forget(index)
        if self._lost:
            self._still_lost({})
        return got

    async def _states_within(self, name: str, indices: Sequence[int]) -> tuple[BatchStates, int]:
        """What query ``name`` answers for ``indices``, and its bytes, read no further than
        the message limit: the calls that can read within it themselves are given it;
        else a first call about a few envs measures their answers, each next one names
        as many as would fit in what is left (never more than were read so far), and
        none more is read once over the limit (the bytes are then a lower bound)."""
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
        size = self.size
        if outcome.autoreset is None and len(outcome.rows) == size:
            # Rows 0 .. size - 1: whole columns at once (a Session's without a call).
            terminated, truncated = outcome.terminated, outcome.truncated
            counts = self.step_counts
            self.step_counts = [counts[0] + 1] if size == 1 else [count + 1 for count in counts]
            if True in terminated or True in truncated:
                ended, cut, running = Phase.TERMINATED, Phase.TRUNCATED, Phase.RUNNING
                self.phases = [
                    ended if term else cut if trunc else running
                    for term, trunc in zip(terminated, truncated, strict=True)
                ]
            else:
                self.phases = [Phase.RUNNING] * size
            stepped = size
        else:
            stepped = self._book_rows(outcome)
        if outcome.errors:
            self._book_errors(outcome.errors, stepping=True)
        if self._lost:
            self._still_lost({})
        return stepped

    def _book_rows(self, outcome: BatchOutcome) -> int:
        phases, ids, counts = self.phases, self.episode_ids, self.step_counts
        rows, marks = outcome.rows, outcome.autoreset
        restart_ends = marks is not None and self._restart_ends()
        if marks is None:  # no row was autoreset
            marks = [False] * len(rows)
        same_step = self._mode is AutoresetMode.SAME_STEP
        ended, cut, running = Phase.TERMINATED, Phase.TRUNCATED, Phase.RUNNING
        new_ids = outcome.new_episode_ids
        stepped = 0
        for index, terminated, truncated, auto in zip(
            rows, outcome.terminated, outcome.truncated, marks, strict=True
        ):
            phase = ended if terminated else cut if truncated else running
            if auto:  # a new episode began: the row's observation is its first
                ids[index] = new_ids.get(index) or new_episode_id()
                counts[index] = 0
                phases[index] = phase if restart_ends else running
                stepped += same_step  # SAME_STEP's row also took the ending step
            else:
                counts[index] += 1
                phases[index] = phase
                stepped += 1
        return stepped

    def _restart_ends(self) -> bool:
        """A loop batch's NEXT_STEP autoreset row carries its reset's flags: an episode
        that ended as it began is ended (a native batch's rows start RUNNING)."""
        return self._mode is AutoresetMode.NEXT_STEP and not self._calls.native

    def _book_errors(self, errors: dict[int, RowError], stepping: bool = False) -> None:
        # An env may keep its episode after a step that raised (step_errors_end_episode).
        keep = stepping and not getattr(self.spec.env_class, "step_errors_end_episode", True)
        for index, error in errors.items():
            if error.code == _INTERNAL:
                if not keep:
                    self.phases[index] = Phase.BROKEN
            elif error.code in _REPLACED:  # a fresh env took its place
                self._forget(index)

    def _forget(self, index: int) -> None:
        self.phases[index] = Phase.NO_EPISODE
        self.episode_ids[index] = ""
        self.step_counts[index] = 0
        self._options.pop(index, None)
