"""``--isolated``: a stream's envs as contiguous blocks in the env processes (one
sub-batch per process, so a step runs on every core; a native batch or a Session's env is
one block). Each block gets its part of any call (``calls.part_args``), and the answers
are gathered in index order.

A lost env process costs only its block's envs: the call answers UNAVAILABLE
(DEADLINE_EXCEEDED for its own hung block) for those it named, the others go to the
driver's books (``calls.Losses``), and a fresh block is made on a live process
(:class:`BlockPolicy` says what a Session's stream does instead). A refusal that ends the
stream is the whole call's; a step given up still hands each block's answer to
``StepArgs.orphaned``, once.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import grpc

from openenv_grpc.environment import AutoresetMode
from openenv_grpc.server.errors import RowError, SessionLostError
from openenv_grpc.server.isolated.env_process import REFUSAL_FLAGS, VECTOR_BLOCK, Op, Status
from openenv_grpc.server.isolated.env_process_pool import (
    CallTimedOut,
    Charge,
    EnvProcessPool,
    Late,
    Payload,
    Worker,
)
from openenv_grpc.server.local.batch import BatchOutcome
from openenv_grpc.server.local.calls import (
    BatchRefused,
    Commands,
    Losses,
    batch_args,
    part_args,
)
from openenv_grpc.server.local.frames import ROOM, command_frame, read_answer
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
    """Where a stream's blocks go and what losing one's process means to the stream,
    chosen by ``service``; the defaults are a vector's."""

    #: CREATE's block kind (``env_process.BLOCK_OPEN``).
    kind: int = VECTOR_BLOCK
    #: New blocks go to env processes up already first; else to the least loaded.
    prefer_ready: bool = True
    #: A call past the step timeout is refused as a whole (DEADLINE_EXCEEDED,
    #: ``replaced``); should no fresh block be made, INTERNAL and the stream ends.
    refuse_timed_out_call: bool = False
    #: Losing an env process otherwise ends the stream (SessionLostError).
    lost_process_ends: bool = False
    words: Words = VECTOR_WORDS


VECTOR_BLOCKS = BlockPolicy()


@dataclass(slots=True)
class _Block:
    """Envs ``start .. start + size - 1`` of the stream: one sub-batch in one process."""

    worker: Worker
    env_id: int
    start: int
    size: int
    #: Its fresh sub-batch being made after its process was lost; its next call waits.
    rebuilding: asyncio.Task[None] | None = None


#: One block's part of a call: the block, its envs' positions in the call, their local
#: indices.
_Part = tuple[_Block, list[int], list[int]]

_Orphaned = Callable[[BatchOutcome, float], None]


class SpreadBatchCalls(Commands):
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
        self._losses: Losses | None = None  # no driver reads the books

    @classmethod
    async def open(
        cls,
        pool: EnvProcessPool,
        size: int,
        autoreset: AutoresetMode,
        batches: bool,
        policy: BlockPolicy = VECTOR_BLOCKS,
    ) -> SpreadBatchCalls:
        """Build the stream's blocks at once: over every live env process, or one block
        when the env ``batches`` natively or ``size`` is one.

        Raises:
            EnvFactoryError, InvalidAction: building a block failed (the others are closed).
            SessionLostError: no env process is running, or one died meanwhile.
        """
        if batches or size == 1:
            worker, env_id, native = await pool.place_block(
                size, autoreset, kind=policy.kind, prefer_ready=policy.prefer_ready
            )
            return cls(pool, [_Block(worker, env_id, 0, size)], autoreset, native, policy)
        workers = pool.for_new_envs(prefer_ready=policy.prefer_ready)
        count = min(len(workers), size)
        sizes = [size // count + (k < size % count) for k in range(count)]
        made = await asyncio.gather(
            *(
                pool.create_block(workers[k], sizes[k], autoreset, kind=policy.kind)
                for k in range(count)
            ),
            return_exceptions=True,
        )
        blocks = [
            _Block(workers[k], answer[0], sum(sizes[:k]), sizes[k])
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
        """The wait for lost blocks' fresh ones still being made (None: none is), raising
        what making one raised: for a Session's view, whose client learns of it next."""
        if any(block.rebuilding is not None for block in self._blocks):
            return self._replaced()
        return None

    async def _replaced(self) -> None:
        for block in self._blocks:
            await _rebuilt(block)

    async def command(self, name: str, args: Any) -> Any:
        def frame(part: _Part) -> bytes:
            # One block from index 0 (a Session's, a native batch's): the args as they are.
            whole = part[0].start == 0 and len(part[1]) == len(args.indices)
            sub = batch_args(args) if whole else part_args(args, part[1], part[2])
            return command_frame(name, name, len(part[1]), sub)

        orphaned = getattr(args, "orphaned", None)
        return await self._gather(name, args.indices, frame, args.outcome(), orphaned)

    async def query(self, name: str, indices: Sequence[int]) -> BatchStates:
        def frame(part: _Part) -> bytes:
            return command_frame(name, "query", len(part[2]), (name, part[2]))

        return cast(BatchStates, await self._gather(name, indices, frame, BatchStates()))

    async def query_within(self, name: str, indices: Sequence[int], room: int) -> BatchStates:
        """:meth:`query` within ``room`` bytes: each block is told the room, and each
        part is held against the byte budget until the parts are one answer.

        Raises:
            AnswerTooLarge: the parts passed ``room`` bytes (with the envs found lost).
            BatchRefused: the budget could not hold a part (RESOURCE_EXHAUSTED), or a
                block's call failed as a whole.
        """
        lost: dict[int, RowError] = {}
        parts = self._split(indices)
        gathered = _Gathered(room, self._pool.budget)
        got: list[BatchStates | None] = [None] * len(parts)
        refused: BatchRefused | None = None

        async def one(k: int, part: _Part) -> None:
            nonlocal refused
            frame = ROOM.pack(room) + command_frame(name, "query", len(part[2]), (name, part[2]))
            status, payload = await self._call(name, part, frame, Op.QUERY, charge=gathered)
            if status is None:  # the block was lost: its envs are fresh ones now
                lost.update(_rows(part, indices, payload))
            elif status == Status.TOO_LARGE:
                gathered.seen += ROOM.unpack(payload)[0]
            elif status == Status.UNKEPT:
                pass  # not read: past the room, or the budget short (gathered knows)
            elif isinstance(response := _read(status, payload), BatchRefused):
                refused = refused or response
            elif not gathered.over:
                del payload  # the rows are copied out of the parsed answer
                got[k] = read_answer(response, part[0].start)

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
            if lost and self._losses is not None:  # not told: the next call naming them is
                self._losses.book_lost(lost)
            raise error
        if gathered.over:
            raise AnswerTooLarge(gathered.seen, lost)
        out = BatchStates(errors=lost)
        for rows in got:
            if rows is not None:
                _merge(out, rows)
        return out

    async def close(self) -> None:
        await self._close_all()

    async def close_strictly(self) -> None:
        """Close every block for a close command (one being rebuilt quietly).

        Raises:
            BatchRefused: a close hung (its worker was stopped), or an env's ``close``
                raised (INTERNAL); the stream ends.
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
            # A vector block that died is closed with its process.
            lost = isinstance(answer, SessionLostError) and not self._policy.lost_process_ends
            if isinstance(answer, BaseException) and not lost:
                raise answer

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

    async def _gather(
        self,
        what: str,
        indices: Sequence[int],
        frame: Callable[[_Part], bytes],
        out: Any,
        orphaned: _Orphaned | None = None,
    ) -> Any:
        """Send each block its ``frame``, together, and merge the answers into ``out`` in
        index order (handed to ``orphaned`` should this be cancelled)."""
        started = time.perf_counter()
        parts = self._split(indices)
        lates = [None if orphaned is None else _late(orphaned, started, part) for part in parts]
        answers = await self._gather_or_hand_on(what, parts, frame, lates)
        read = [None if status is None else _read(status, payload) for status, payload in answers]
        refused = [response for response in read if isinstance(response, BatchRefused)]
        if refused:
            ending = next((one for one in refused if one.ends), None)
            if ending is not None or len(parts) == 1:
                for late, (status, payload) in zip(lates, answers, strict=True):
                    if late is not None and status is not None:
                        late(status, payload)  # what stepped is booked and counted all the same
                raise ending or refused[0]
        errors = out if isinstance(out, dict) else out.errors
        for part, (_, payload), response in zip(parts, answers, read, strict=True):
            if response is None:  # the block was lost: its envs are fresh ones now
                errors.update(_rows(part, indices, payload))
            elif isinstance(response, BatchRefused):
                # Only a whole block failed (e.g. no env thread in time): its envs say so.
                error = RowError(response.code, response.message, response.exception_type)
                errors.update(_rows(part, indices, error))
            else:
                _merge(out, read_answer(response, part[0].start))
        return out

    async def _gather_or_hand_on(
        self, what: str, parts: list[_Part], frame: Any, lates: list[Late | None]
    ) -> list[tuple[int | None, Any]]:
        """Each part's answer; should this be cancelled, each block's answer is handed to
        its ``late`` exactly once: by the pool when still to come, else here."""
        if len(parts) == 1:  # no task to gather
            return [await self._call(what, parts[0], frame(parts[0]), late=lates[0])]
        calls = [
            asyncio.ensure_future(self._call(what, part, frame(part), late=late))
            for part, late in zip(parts, lates, strict=True)
        ]
        try:
            return await asyncio.gather(*calls)
        except asyncio.CancelledError:
            # A call that returned before the cancellation reached it: its answer is
            # here only (handed on in a callback, so it never replaces the cancellation).
            loop = asyncio.get_running_loop()
            for late, call in zip(lates, calls, strict=True):
                answered = call.done() and not call.cancelled() and call.exception() is None
                if late is not None and answered:
                    status, payload = call.result()
                    if status is not None:  # None: its block was lost, nothing stepped
                        loop.call_soon(late, status, payload)
            raise

    def _split(self, indices: Sequence[int]) -> list[_Part]:
        """The call's indices, block by block."""
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
        """One block's call: its status and payload, or (None, its envs' error) when its
        env process died or was stopped under it (the block is rebuilt).

        Raises:
            SessionLostError: the block could not be rebuilt, or ``lost_process_ends``.
            BatchRefused: ``refuse_timed_out_call`` and the call ran past the timeout.
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
        named = {block.start + local for local in part[2]}
        if block.rebuilding is not None or block.worker is not worker or block.env_id != env_id:
            # Another call saw the loss first (one rebuild); this call's envs are told here.
            if self._losses is not None:
                self._losses.book_told(named)
            return None, RowError(code, message)
        # Answered now, not once the fresh block is made (that may take seconds); its
        # other envs learn it when next named.
        gone = RowError(
            _UNAVAILABLE,
            f"its env process was lost during a {what} of other envs ({why}); a fresh "
            "environment took this one's place: reset it",
        )
        unnamed = {i: gone for i in range(block.start, block.start + block.size) if i not in named}
        if unnamed and self._losses is not None:
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
        """A fresh block for a lost one, on a live env process.

        Raises:
            SessionLostError: none could be made (``hung``, a call refused past the
                timeout: BatchRefused, INTERNAL, and the stream ends).
        """
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


@dataclass(slots=True, eq=False)
class _Gathered:
    """The charge of a query's parts: each is read only while the parts stay within the
    room and the byte budget takes its bytes, held until they are one answer."""

    room: int
    budget: ByteBudget | None
    seen: int = 0  # bytes the parts answered, read or not
    held: int = 0  # bytes taken from the budget
    #: The budget could not take a part: the bytes it held then, and the part's.
    short: tuple[int, int] | None = None

    @property
    def over(self) -> bool:
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


async def _rebuilt(block: _Block) -> None:
    """Wait for ``block``'s fresh sub-batch; raises what making it raised."""
    rebuilding = block.rebuilding
    if rebuilding is None:
        return
    try:
        await rebuilding
    finally:
        if block.rebuilding is rebuilding:
            block.rebuilding = None


def _late(orphaned: _Orphaned, started: float, part: _Part) -> Late:
    """Hands a block's answer, whose caller stopped waiting, to ``orphaned``."""

    def late(status: int, payload: Payload) -> None:
        response = _read(status, payload)
        if not isinstance(response, BatchRefused):  # a refusal stepped nothing
            orphaned(read_answer(response, part[0].start), time.perf_counter() - started)

    return late


def _rows(part: _Part, indices: Sequence[int], error: RowError) -> dict[int, RowError]:
    return {indices[k]: error for k in part[1]}


def _read(status: int, payload: Payload) -> pb.VectorSessionResponse | BatchRefused:
    """A block's answer, or its whole-call refusal, by its status (a block closed under
    its frame is said in plain text: the stream cannot go on)."""
    if status == Status.BLOCK_GONE:
        why = payload.decode(errors="replace")
        return BatchRefused(_UNAVAILABLE, f"{why}; nothing was done", ends=True)
    flags = status - Status.CALL_REFUSED
    if status != Status.ANSWER and not 0 <= flags < REFUSAL_FLAGS:
        # No request is answered so: a bug of the frame protocol, said as one.
        return BatchRefused(_INTERNAL, f"env process answered status {status}", ends=True)
    # The stubs say bytes; protobuf reads any buffer where it lies.
    response = pb.VectorSessionResponse.FromString(cast(bytes, payload))
    if status == Status.ANSWER:
        return response
    error = response.error
    return BatchRefused(
        error.code, error.message, error.exception_type,
        broken=bool(flags & 1), replaced=bool(flags & 2), saturated=bool(flags & 4),
        ends=bool(flags & 8),
    )  # fmt: skip


def _unkept(name: str, budget: ByteBudget | None, held: int, part: int) -> BatchRefused:
    total = 0 if budget is None else budget.total
    return BatchRefused(
        _RESOURCE_EXHAUSTED,
        f"the {name} answers could not be held: the server held {held} of its {total} "
        f"bytes for clients (--max-held-bytes) when {part} more came; nothing changed, "
        "the session goes on: try again shortly, or name fewer envs",
    )


def _merge(out: Any, part: Any) -> None:
    """Append one block's answer (its rows follow those already in ``out``)."""
    if isinstance(out, dict):  # per-env errors
        out.update(part)
        return
    before = len(out.rows)
    out.rows.extend(part.rows)
    out.errors.update(part.errors)
    if not isinstance(out, BatchOutcome):  # a query's BatchStates
        out.states.extend(part.states)
        return
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
