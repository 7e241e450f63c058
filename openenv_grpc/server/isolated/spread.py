"""``--isolated``: a stream's envs as blocks in the env processes; a vector stream's spread
over them, a Session's one env a block of one.

The stream's N envs are cut into contiguous blocks, one sub-batch per env process (the
least loaded first), so a step runs on every core at once: the front sends each process
the part of the request about its block (``frames.py``), awaits them together and
gathers the answers into one outcome, in index order. The vector driver in the front
keeps the books and checks every request before any of it is sent, so a refusal never
leaves some blocks stepped and others not.

An env's native batch is one unit: a stream of an env that overrides ``make_batch`` lives
in one env process (streams are still spread over the processes), since batch-form
observations of several processes could not be joined.

When an env process dies (a crash, or killed past the step timeout), only the envs of its
block are lost: the call that saw it answers UNAVAILABLE (DEADLINE_EXCEEDED when this
call's own block hung) for each of those indices, a fresh sub-batch replaces the block on
a live process (reset those envs to go on), and the other blocks' results come as usual.
The block's envs that call did not name are fresh ones too: they are reported, there and
then, to the driver's books (``calls.Losses``), which keep them LOST and say what a
request naming one gets (``driver.py``); this keeps only its blocks. If no fresh sub-batch
can be made, the stream ends (UNAVAILABLE).

A Session is the same path with one block of one env, opened with a policy of its own
(:class:`BlockPolicy`, chosen by ``service``; these calls never ask what kind of stream
they serve): its own call past the step timeout is refused DEADLINE_EXCEEDED and a fresh
env made meanwhile (the Session's view waits for it, :meth:`SpreadBatchCalls.replacing`,
before its next request; if none can be made, INTERNAL and the stream ends); losing its
process any other way ends the stream ("session lost"), as the client cannot tell which
of its requests took effect.

A call over several blocks whose env process refused it as a whole with the end of the
stream (a block closed under its frame) ends the stream as a call of one block does,
with that refusal; the blocks that stepped meanwhile are handed to ``StepArgs.orphaned``.

A vector stream's query is read within the message limit (:meth:`query_within`): each
block's frame carries the room, its env process stops reading its envs once their answers
pass it, and each part that comes back is held against the server's byte budget (taken
as it arrives, given back once the parts are one answer for the driver, or refused). The
sum of the parts passing the room refuses the answer as too large (``AnswerTooLarge``: the
driver answers the client as for envs in this process); the budget short refuses it
RESOURCE_EXHAUSTED. Either way nothing else changes, and no part is kept.

A step whose stream ends while its env processes step (its call is cancelled) is still
counted: each block's answer that comes after all -- or came before the cancellation
reached the call -- is read and handed to the driver's ``StepArgs.orphaned``, which books
it and counts its env steps, once per block, as it does for envs in this process.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import grpc

from openenv_grpc.environment import AutoresetMode
from openenv_grpc.server.errors import RowError, SessionLostError
from openenv_grpc.server.isolated.env_process import REFUSAL_FLAGS, VECTOR_BLOCK, Op, Status
from openenv_grpc.server.isolated.env_process_pool import (
    CallTimedOut,
    Charge,
    CloseFailed,
    EnvProcessPool,
    Late,
    Payload,
    Worker,
)
from openenv_grpc.server.local.batch import BatchOutcome
from openenv_grpc.server.local.calls import (
    BatchRefused,
    Losses,
    ResetArgs,
    RestoreArgs,
    StepArgs,
)
from openenv_grpc.server.local.frames import (
    ROOM,
    query_frame,
    read_errors,
    read_outcome,
    read_rows,
    reset_frame,
    restore_frame,
    room_frame,
    step_frame,
)
from openenv_grpc.server.model.phases import VECTOR_WORDS, Words
from openenv_grpc.server.model.queries import AnswerTooLarge, BatchStates
from openenv_grpc.server.process.budget import ByteBudget
from openenv_grpc.v1 import session_pb2 as pb

__all__ = ["BlockPolicy", "SpreadBatchCalls"]

log = logging.getLogger(__name__)

_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
_INTERNAL = grpc.StatusCode.INTERNAL.value[0]
_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


@dataclass(frozen=True, slots=True)
class BlockPolicy:
    """Where a stream's blocks go, what its env processes make of them and what losing
    one's process means to the stream: chosen by who opens it (``service``); the
    defaults are a vector's."""

    #: CREATE's block kind (``env_process.BLOCK_OPEN``), passed on as it is.
    kind: int = VECTOR_BLOCK
    #: New blocks go to the env processes up already first; else to the least loaded,
    #: even one still starting, so streams opened one after the other spread out.
    prefer_ready: bool = True
    #: A call that ran past the step timeout is refused as a whole (DEADLINE_EXCEEDED,
    #: ``replaced``) rather than per env; should the fresh block not be made, INTERNAL
    #: and the stream ends (a stream of one block).
    refuse_timed_out_call: bool = False
    #: Losing an env process other than by the call's own timeout ends the stream
    #: (SessionLostError) rather than a fresh block taking the lost one's place.
    lost_process_ends: bool = False
    #: The words of those refusals.
    words: Words = VECTOR_WORDS


#: A vector stream's blocks (see the module's docstring).
VECTOR_BLOCKS = BlockPolicy()


@dataclass(slots=True)
class _Block:
    """Envs ``start .. start + size - 1`` of the stream: one sub-batch in one process."""

    worker: Worker
    env_id: int
    start: int
    size: int
    #: Its fresh sub-batch being made after its process was lost (the answer that said
    #: so did not wait for it); the block's next call waits for it.
    rebuilding: asyncio.Task[None] | None = None


#: One block's part of a call: the block, the positions of its envs in the call's index
#: list, and their indices in the sub-batch.
_Part = tuple[_Block, list[int], list[int]]

#: Takes the outcome (and seconds) of a step its caller gave up (``StepArgs.orphaned``).
_Orphaned = Callable[[BatchOutcome, float], None]


class SpreadBatchCalls:
    """A stream's envs as blocks in the env processes (``BatchCalls``)."""

    __slots__ = ("_autoreset", "_blocks", "_losses", "_native", "_policy", "_pool", "_starts")

    def __init__(
        self,
        pool: EnvProcessPool,
        blocks: list[_Block],
        autoreset: AutoresetMode,
        native: bool,
        policy: BlockPolicy,
    ) -> None:
        self._pool = pool
        self._blocks = blocks
        self._starts = [block.start for block in blocks]
        self._autoreset = autoreset
        self._native = native
        self._policy = policy
        #: Where the envs of a lost block that the call which lost it did not name are
        #: reported (the driver's books; see the module's docstring).
        self._losses: Losses = _UNBOOKED

    @classmethod
    async def open(
        cls,
        pool: EnvProcessPool,
        size: int,
        autoreset: AutoresetMode,
        batches: bool,
        policy: BlockPolicy = VECTOR_BLOCKS,
    ) -> SpreadBatchCalls:
        """Build the stream's blocks, all at once, as ``policy`` says: over every live env
        process, or in one when the env ``batches`` natively or ``size`` is one.

        Raises:
            EnvFactoryError, InvalidAction: building a block failed (the others made are
                closed).
            SessionLostError: no env process is running, or one died meanwhile (one block:
                every one tried died).
        """
        if batches or size == 1:
            # One block: made on another process should the one picked die meanwhile.
            worker, env_id, native = await pool.place_block(
                size, autoreset, kind=policy.kind, prefer_ready=policy.prefer_ready
            )
            return cls(pool, [_Block(worker, env_id, 0, size)], autoreset, native, policy)
        # Never behind another stream's call if it can be helped (see for_new_envs).
        workers = pool.for_new_envs(prefer_ready=policy.prefer_ready)
        count = min(len(workers), size)
        sizes = [size // count + (k < size % count) for k in range(count)]
        starts = [sum(sizes[:k]) for k in range(count)]
        made = await asyncio.gather(
            *(
                pool.create_block(workers[k], sizes[k], autoreset, kind=policy.kind)
                for k in range(count)
            ),
            return_exceptions=True,
        )
        blocks = [
            _Block(workers[k], answer[0], starts[k], sizes[k])
            for k, answer in enumerate(made)
            if not isinstance(answer, BaseException)
        ]
        failed = [answer for answer in made if isinstance(answer, BaseException)]
        if failed:
            for block in blocks:
                pool.close_env(block.worker, block.env_id)
            raise failed[0]
        native = all(not isinstance(a, BaseException) and a[1] for a in made)
        return cls(pool, blocks, autoreset, native, policy)

    @property
    def native(self) -> bool:
        return self._native

    def report_losses(self, losses: Losses) -> None:
        self._losses = losses

    def replacing(self) -> Awaitable[None] | None:
        """The wait for the fresh blocks of lost ones still being made (None: none is);
        awaiting it raises what making one raised (see :meth:`_rebuild`). A block's own
        next call waits for it anyway: this is for a stream whose client must learn of a
        failed replacement at its next request, whatever it is (a Session's view)."""
        for block in self._blocks:
            if block.rebuilding is not None:
                return self._replaced()
        return None

    async def _replaced(self) -> None:
        for block in self._blocks:
            await _rebuilt(block)

    async def reset(self, args: ResetArgs) -> BatchOutcome:
        seeds, ids, options = args.seeds, args.episode_ids, args.wire_options

        def frame(positions: list[int], local: list[int]) -> bytes:
            return reset_frame(
                local, [seeds[k] for k in positions], [ids[k] for k in positions],
                [options[k] for k in positions], args.batch_form,
            )  # fmt: skip

        return await self._outcomes("reset", args.indices, frame)

    async def step(self, args: StepArgs) -> BatchOutcome:
        wire, indices = args.wire, args.indices
        ids, options = args.autoresets.episode_ids, args.autoresets.wire_options

        def frame(positions: list[int], local: list[int]) -> bytes:
            if args.batch_form:  # one block: a native batch is never spread
                return step_frame(local, wire, True)
            # The driver's autoresets of this block's envs, by their local indices.
            autoresets = [
                (at, ids[index], options.get(index))
                for k, at in zip(positions, local, strict=True)
                if (index := indices[k]) in ids
            ]
            return step_frame(local, [wire[k] for k in positions], False, autoresets)

        return await self._outcomes("step", args.indices, frame, args.orphaned)

    async def query(self, name: str, indices: Sequence[int]) -> BatchStates:
        """Each block's part of the query, together; the answers in index order (the
        env processes answer a snapshot's own bytes: the front seals them)."""
        out = BatchStates()
        parts = self._split(indices)
        answers = await asyncio.gather(
            *(self._call(name, part, query_frame(name, part[2])) for part in parts)
        )
        for part, (status, payload) in zip(parts, answers, strict=True):
            if status is None:  # the block was lost: its envs are fresh ones now
                out.errors.update(_rows(part, indices, payload))
                continue
            response = _read(status, payload)
            if isinstance(response, BatchRefused):
                raise response
            got = read_rows(response.snapshots, part[0].start)
            out.rows.extend(got.rows)
            out.states.extend(got.states)
            out.errors.update(got.errors)
        return out

    async def query_within(self, name: str, indices: Sequence[int], room: int) -> BatchStates:
        """:meth:`query`, its answers within ``room`` bytes (see the module's docstring):
        every block at once, each told the room; the answers in index order.

        Raises:
            AnswerTooLarge: the parts passed ``room`` bytes (with the envs found lost).
            BatchRefused: the byte budget could not hold a part (RESOURCE_EXHAUSTED), or a
                block's call failed as a whole.
            SessionLostError: as :meth:`_call`.
        """
        lost: dict[int, RowError] = {}
        parts = self._split(indices)
        gathered = _Gathered(room, self._pool.budget)
        got: list[BatchStates | None] = [None] * len(parts)
        refused: BatchRefused | None = None

        async def one(k: int, part: _Part) -> None:
            nonlocal refused
            frame = room_frame(name, part[2], room)
            status, payload = await self._call(name, part, frame, Op.QUERY, charge=gathered)
            if status is None:  # the block was lost: its envs are fresh ones now
                lost.update(_rows(part, indices, payload))
            elif status == Status.TOO_LARGE:
                gathered.seen += ROOM.unpack(payload)[0]
            elif status == Status.UNKEPT:
                pass  # not read: past the room, or the budget was short (gathered knows)
            elif isinstance(response := _read(status, payload), BatchRefused):
                refused = refused or response
            elif not gathered.over:
                del payload  # the rows are copied out of the parsed answer
                got[k] = read_rows(response.snapshots, part[0].start)

        try:
            answers = await asyncio.gather(
                *(one(k, part) for k, part in enumerate(parts)), return_exceptions=True
            )
        finally:
            gathered.give(gathered.held)  # the parts are one answer now, or none
        error: BaseException | None = next(
            (a for a in answers if isinstance(a, BaseException)), refused
        )
        if error is None and gathered.short is not None:
            error = _unkept(name, gathered.budget, *gathered.short)
        if error is not None:
            if lost:  # not told: the next call naming them is
                self._losses.book_lost(lost)
            raise error
        if gathered.over:
            raise AnswerTooLarge(gathered.seen, lost)
        out = BatchStates(errors=lost)
        for rows in got:
            if rows is not None:
                out.rows.extend(rows.rows)
                out.states.extend(rows.states)
                out.errors.update(rows.errors)
        return out

    async def restore(self, args: RestoreArgs) -> dict[int, RowError]:
        captured = args.captured

        def frame(positions: list[int], local: list[int]) -> bytes:
            return restore_frame(local, [captured[k] for k in positions])

        parts = self._split(args.indices)
        answers = await asyncio.gather(
            *(self._call("restore", part, frame(part[1], part[2])) for part in parts)
        )
        errors: dict[int, RowError] = {}
        for part, (status, payload) in zip(parts, answers, strict=True):
            if status is None:  # the block was lost: its envs are fresh ones now
                errors.update(_rows(part, args.indices, payload))
                continue
            response = _read(status, payload)
            if isinstance(response, BatchRefused):
                raise response
            errors.update(read_errors(response.restored.errors, part[0].start))
        return errors

    async def close(self) -> None:
        await self._close_all()

    async def close_strictly(self) -> None:
        """Close every block for a close command, each in its worker, and wait for them
        (a block still being rebuilt is closed quietly).

        Raises:
            BatchRefused: a close hung past the step timeout (its worker was stopped), or
                an env's ``close`` raised (INTERNAL, what it raised); the stream ends.
            SessionLostError: a Session's env process died before its close.
        """
        strict = [block for block in self._blocks if block.rebuilding is None]
        self._blocks = [block for block in self._blocks if block.rebuilding is not None]
        await self._close_all()
        answers = await asyncio.gather(
            *(self._pool.close_strictly(block.worker, block.env_id) for block in strict),
            return_exceptions=True,
        )
        for answer in answers:
            if isinstance(answer, CallTimedOut):
                raise BatchRefused(
                    _DEADLINE_EXCEEDED,
                    f"close did not finish within {self._pool.call_timeout:g}s; the "
                    "environment's worker process was stopped",
                    ends=True,
                )
            if isinstance(answer, CloseFailed):
                raise BatchRefused(
                    _INTERNAL, f"close failed: {answer.message}", answer.exception_type,
                    ends=True,
                )  # fmt: skip
            if isinstance(answer, SessionLostError) and self._policy.lost_process_ends:
                raise answer
            if isinstance(answer, BaseException) and not isinstance(answer, SessionLostError):
                raise answer  # a vector block that died is closed with its process

    async def _close_all(self) -> None:
        closing = []
        for block in self._blocks:
            rebuilding, block.rebuilding = block.rebuilding, None
            if rebuilding is not None:
                if not rebuilding.done():
                    rebuilding.cancel()  # the create's cancel closes what it makes
                    continue
                if rebuilding.cancelled() or rebuilding.exception() is not None:
                    continue
            worker = block.worker
            if worker.envs.pop(block.env_id, None) is not None and worker.alive:
                closing.append(self._pool.close_env(worker, block.env_id))
        if closing:
            # Shielded: a server stopping must not skip the closes.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(asyncio.gather(*closing))

    # -- one call over the blocks ---------------------------------------------------------

    async def _outcomes(
        self, what: str, indices: Sequence[int], frame: Any, orphaned: _Orphaned | None = None
    ) -> BatchOutcome:
        """Send each block its part (``frame(positions, local indices)``), together, and
        gather the answers in index order. Cancelled meanwhile, each block's answer is
        handed to ``orphaned`` as it comes (see :meth:`_gather_or_hand_on`)."""
        out = BatchOutcome()
        parts = self._split(indices)
        started = time.perf_counter()
        if orphaned is None:
            answers = await asyncio.gather(
                *(self._call(what, part, frame(part[1], part[2])) for part in parts)
            )
        else:
            answers = await self._gather_or_hand_on(what, parts, frame, orphaned, started)
        read = [None if status is None else _read(status, payload) for status, payload in answers]
        refused = [response for response in read if isinstance(response, BatchRefused)]
        if refused:
            # A refusal that ends the stream is the whole call's, whatever the other blocks
            # answered (as a refusal of a call of one block is).
            ending = next((one for one in refused if one.ends), None)
            if ending is not None or len(parts) == 1:
                if orphaned is not None:  # what stepped is booked and counted all the same
                    seconds = time.perf_counter() - started
                    for part, response in zip(parts, read, strict=True):
                        if isinstance(response, pb.VectorSessionResponse):
                            orphaned(read_outcome(response.result, part[0].start), seconds)
                raise ending or refused[0]
        for part, (_, payload), response in zip(parts, answers, read, strict=True):
            if response is None:  # the block was lost: its envs are fresh ones now
                out.errors.update(_rows(part, indices, payload))
            elif isinstance(response, BatchRefused):
                # Only a whole block failed (e.g. no env thread in time): its envs say so.
                error = RowError(response.code, response.message, response.exception_type)
                out.errors.update({indices[k]: error for k in part[1]})
            else:
                _merge(out, read_outcome(response.result, part[0].start))
        return out

    async def _gather_or_hand_on(
        self, what: str, parts: list[_Part], frame: Any, orphaned: _Orphaned, started: float
    ) -> list[tuple[int | None, Any]]:
        """Each part's answer, as :meth:`_outcomes` gathers them; should this be cancelled
        (the stream ended), every block's step that the env process completes is handed
        to ``orphaned`` exactly once (with the seconds since ``started``): an answer still
        to come by the pool (``late``), one its part's call got already here."""

        def late_of(part: _Part) -> Late:
            def late(status: int, payload: Payload) -> None:
                _hand_on(part, status, payload, orphaned, time.perf_counter() - started)

            return late

        if len(parts) == 1:  # one block's (one env's, a native batch's): no task to gather
            part = parts[0]
            return [await self._call(what, part, frame(part[1], part[2]), late=late_of(part))]
        calls = [
            asyncio.ensure_future(
                self._call(what, part, frame(part[1], part[2]), late=late_of(part))
            )
            for part in parts
        ]
        try:
            return await asyncio.gather(*calls)
        except asyncio.CancelledError:
            # A part whose call returned before the cancellation reached it: its answer
            # is here, and nobody else has it (in a callback, as the pool's: what that
            # raises never replaces the cancellation). A part's call cancelled itself
            # hands on through the pool.
            loop = asyncio.get_running_loop()
            for part, call in zip(parts, calls, strict=True):
                if call.done() and not call.cancelled() and call.exception() is None:
                    status, payload = call.result()
                    if status is not None:  # None: its block was lost, nothing stepped
                        loop.call_soon(late_of(part), status, payload)
            raise

    def _split(self, indices: Sequence[int]) -> list[_Part]:
        """The call's indices, block by block (only blocks with envs in the call)."""
        parts: list[_Part] = []
        starts, blocks = self._starts, self._blocks
        current: _Part | None = None
        for position, index in enumerate(indices):
            block = blocks[bisect.bisect_right(starts, index) - 1]
            if current is None or current[0] is not block:
                current = (block, [], [])
                parts.append(current)
            current[1].append(position)
            current[2].append(index - block.start)
        return parts

    async def _call(
        self,
        what: str,
        part: _Part,
        frame: bytes,
        op: int = Op.REQUEST,
        *,
        charge: Charge | None = None,
        late: Late | None = None,
    ) -> tuple[int | None, Any]:
        """One block's call (``what``: its command; ``op``: its frame's operation): its
        status and payload, or (None, the error of its envs) when its env process died or
        was stopped under it (the block is rebuilt). With ``charge``, the answer is held,
        and with ``late`` handed on once its caller is cancelled, as
        :meth:`EnvProcessPool.call` says.

        Raises:
            SessionLostError: the block could not be rebuilt; or its process was lost other
                than by this call's own timeout (``BlockPolicy.lost_process_ends``).
            BatchRefused: the call ran past the step timeout (the block is being replaced)
                or that replacement could not be made (the stream ends), as
                ``BlockPolicy.refuse_timed_out_call`` says.
        """
        block = part[0]
        if block.rebuilding is not None:
            await _rebuilt(block)
        worker, env_id = block.worker, block.env_id
        policy = self._policy
        try:
            return await self._pool.call(
                worker, env_id, op, frame, envs=len(part[1]), charge=charge, late=late
            )
        except CallTimedOut as exc:  # this call's own block hung
            code, why = _DEADLINE_EXCEEDED, str(exc)
        except SessionLostError as exc:
            if policy.lost_process_ends:
                raise
            code, why = _UNAVAILABLE, str(exc)
        message = f"{why}; a fresh environment took this one's place: reset it"
        if block.rebuilding is not None or block.worker is not worker or block.env_id != env_id:
            # Another request in flight on this block saw the loss first: one rebuild.
            # This call's envs are told here, so they are not told again later.
            self._losses.book_told(block.start + local for local in part[2])
            return None, RowError(code, message)
        # Answered now, not once the fresh block is made: with the process killed past
        # the step timeout, its replacement may take seconds to start.
        # Its other envs are fresh ones too; they learn it when next named.
        named = {block.start + local for local in part[2]}
        gone = RowError(
            _UNAVAILABLE,
            f"its env process was lost during a {what} of other envs ({why}); a fresh "
            "environment took this one's place: reset it",
        )
        unnamed = {i: gone for i in range(block.start, block.start + block.size) if i not in named}
        if unnamed:
            self._losses.book_lost(unnamed)
        block.worker.envs.pop(block.env_id, None)
        refused = code == _DEADLINE_EXCEEDED and policy.refuse_timed_out_call
        block.rebuilding = asyncio.get_running_loop().create_task(self._rebuild(block, refused))
        if refused:
            raise BatchRefused(
                _DEADLINE_EXCEEDED,
                f"{what} did not finish within {self._pool.call_timeout:g}s; "
                f"{policy.words.replaced}",
                replaced=True,
            )
        return None, RowError(code, message)

    async def _rebuild(self, block: _Block, hung: bool) -> None:
        """A fresh block for a lost one, on a live env process (``hung``: for a call
        refused as a whole past the step timeout).

        Raises:
            SessionLostError: none could be made (after ``hung``: BatchRefused, INTERNAL,
                and the stream ends).
        """
        block.worker.envs.pop(block.env_id, None)
        try:
            worker, block.env_id, _ = await self._pool.place_block(
                block.size, self._autoreset, kind=self._policy.kind, prefer_ready=True
            )
        except Exception as exc:  # a factory error, make_batch refusing, no live process
            log.error("could not replace the envs of a lost env process: %s", exc)
            if hung:
                raise BatchRefused(
                    _INTERNAL, f"{self._policy.words.not_replaced}: {exc}", ends=True
                ) from None
            raise SessionLostError(
                f"the envs of an env process that died could not be replaced: {exc}"
            ) from None
        block.worker = worker
        log.warning(
            "envs %d..%d replaced on env worker pid %s",
            block.start, block.start + block.size - 1, worker.process.pid,
        )  # fmt: skip


class _Gathered:
    """The parts of one query as they arrive (the charge of each part's call): an answer
    is read only while the parts stay within the room and the byte budget takes its
    bytes, held until the parts are one answer (:meth:`give`)."""

    __slots__ = ("budget", "held", "room", "seen", "short")

    def __init__(self, room: int, budget: ByteBudget | None) -> None:
        self.room = room
        self.budget = budget
        #: Bytes the parts answered so far (read or not): a lower bound of the answer.
        self.seen = 0
        #: Bytes taken from the budget for the parts read.
        self.held = 0
        #: The budget could not take a part: the bytes it held then, and the part's.
        self.short: tuple[int, int] | None = None

    @property
    def over(self) -> bool:
        """The answer cannot be sent: past the room, or a part could not be held."""
        return self.seen > self.room or self.short is not None

    def admit(self, status: int, length: int) -> bool:
        if status == Status.ANSWER:  # a refusal or "too large" is read whatever happened
            self.seen += length
            if self.over:
                return False
        if self.budget is not None and not self.budget.try_take(length):
            self.short = (self.budget.used, length)
            return False
        self.held += length
        return True

    def give(self, length: int) -> None:
        self.held -= length
        if self.budget is not None and length:
            self.budget.give(length)


class _Unbooked:
    """The books of calls no driver reads (losses are reported to nobody)."""

    def book_lost(self, errors: Mapping[int, RowError]) -> None:
        pass

    def book_told(self, indices: Iterable[int]) -> None:
        pass


_UNBOOKED = _Unbooked()


async def _rebuilt(block: _Block) -> None:
    """Wait for ``block``'s fresh sub-batch being made; raises what making it raised."""
    rebuilding = block.rebuilding
    if rebuilding is None:
        return
    try:
        await rebuilding
    finally:
        if block.rebuilding is rebuilding:
            block.rebuilding = None


def _rows(part: _Part, indices: Sequence[int], error: RowError) -> dict[int, RowError]:
    """``error`` for each env of ``part`` (of a call over ``indices``)."""
    return {indices[k]: error for k in part[1]}


def _read(status: int, payload: Payload) -> pb.VectorSessionResponse | BatchRefused:
    """A block's answer, or the whole-call refusal its env process answered, read by its
    status: only ANSWER and ``CALL_REFUSED + flags`` carry a VectorSessionResponse. A block
    closed under a queued frame answers that in plain text: the stream cannot go on."""
    if status == Status.BLOCK_GONE:
        why = payload.decode(errors="replace")
        return BatchRefused(_UNAVAILABLE, f"{why}; nothing was done", ends=True)
    flags = status - Status.CALL_REFUSED
    if status != Status.ANSWER and not 0 <= flags < REFUSAL_FLAGS:
        # No request is answered so (a create's, a close's or a room's status): a bug of
        # the frame protocol, said as one rather than parsed as what it is not.
        return BatchRefused(_INTERNAL, f"env process answered status {status}", ends=True)
    # Parsed where it lies: the stubs say bytes, protobuf reads any buffer.
    response = pb.VectorSessionResponse.FromString(cast(bytes, payload))
    if status == Status.ANSWER:
        return response
    error = response.error
    return BatchRefused(
        error.code, error.message, error.exception_type,
        broken=bool(flags & 1), replaced=bool(flags & 2), saturated=bool(flags & 4),
        ends=bool(flags & 8),
    )  # fmt: skip


def _hand_on(
    part: _Part, status: int, payload: Payload, orphaned: _Orphaned, seconds: float
) -> None:
    """Hand the step answer of ``part``'s block, which its caller gave up, to ``orphaned``
    (with the ``seconds`` since the step was sent); a refusal stepped nothing."""
    response = _read(status, payload)
    if not isinstance(response, BatchRefused):
        orphaned(read_outcome(response.result, part[0].start), seconds)


def _unkept(name: str, budget: ByteBudget | None, held: int, part: int) -> BatchRefused:
    """The refusal of a query whose answer the server's byte budget could not hold
    (``held`` bytes were held for the server's clients when a ``part`` came)."""
    total = 0 if budget is None else budget.total
    return BatchRefused(
        _RESOURCE_EXHAUSTED,
        f"the {name} answers could not be held: the server held {held} of its {total} "
        f"bytes for clients (--max-held-bytes) when {part} more came; nothing changed, "
        "the session goes on: try again shortly, or name fewer envs",
    )


def _merge(out: BatchOutcome, part: BatchOutcome) -> None:
    """Append one block's outcome (its rows follow those already in ``out``)."""
    before = len(out.rows)
    out.rows.extend(part.rows)
    if part.batch_observation is not None:  # one block only
        out.batch_observation = part.batch_observation
        out.batch_final_observation = part.batch_final_observation
    out.observations.extend(part.observations)
    out.rewards.extend(part.rewards)
    out.no_reward.update(part.no_reward)
    out.terminated.extend(part.terminated)
    out.truncated.extend(part.truncated)
    out.infos.update(part.infos)
    if part.autoreset is not None or out.autoreset is not None:
        marks = out.autoreset if out.autoreset is not None else [False] * before
        marks.extend(part.autoreset if part.autoreset is not None else [False] * len(part.rows))
        out.autoreset = marks
    out.new_episode_ids.update(part.new_episode_ids)
    out.final_observations.extend(part.final_observations)
    out.final_infos.update(part.final_infos)
    out.errors.update(part.errors)
