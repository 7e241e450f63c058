"""A stream's envs, wherever they run, called once per request: the driver's view of them.

:class:`BatchCalls` is what the driver (``driver.py``) needs of the envs: one call per
request over env indices. :class:`LocalBatchCalls` runs the envs in this process (or in an
env process) as one :class:`~openenv_grpc.server.local.batch.VectorBatch` through one
runner; ``spread.py`` spreads them over env processes. A Session's env is a batch
of one here, so a hung call, a saturated pool and a raising batch are handled once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, runtime_checkable

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import Message

from openenv_grpc.environment import AutoresetMode, InvalidAction
from openenv_grpc.server.errors import RowError, describe, qualname
from openenv_grpc.server.local.batch import (
    NO_AUTORESETS,
    Autoresets,
    BatchOutcome,
    VectorBatch,
    batch_spec,
)
from openenv_grpc.server.local.runner import CloseAbandoned, EnvRunner, Orphaned, PoolSaturated
from openenv_grpc.server.model.phases import VECTOR_WORDS, Words
from openenv_grpc.server.model.placement import CallPlacement
from openenv_grpc.server.model.queries import BatchStates
from openenv_grpc.server.model.snapshots import Captured
from openenv_grpc.server.model.spec import EnvSpec
from openenv_grpc.server.process.limiter import NoSlot
from openenv_grpc.v1 import snapshot_pb2

__all__ = [
    "BatchCalls",
    "BatchRefused",
    "LocalBatchCalls",
    "LosesEnvs",
    "Losses",
    "ResetArgs",
    "RestoreArgs",
    "StepArgs",
    "local_calls",
]

log = logging.getLogger(__name__)

_INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_INTERNAL = grpc.StatusCode.INTERNAL.value[0]
_DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
_FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


class BatchRefused(Exception):
    """A whole batch call failed; nothing of it has a row.

    Attributes:
        code, message, exception_type: the error the request gets.
        broken: every env the call named must be reset (a native batch raised).
        replaced: every env of the stream is a fresh one (the batch hung and was replaced).
        saturated: the call never ran (no env thread in time): the episodes are unchanged.
        ends: nothing is left to serve; the stream ends after this answer.
    """

    def __init__(
        self,
        code: int,
        message: str,
        exception_type: str = "",
        *,
        broken: bool = False,
        replaced: bool = False,
        saturated: bool = False,
        ends: bool = False,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.exception_type = exception_type
        self.broken = broken
        self.replaced = replaced
        self.saturated = saturated
        self.ends = ends
        #: The envs the refused call named (set by the driver, which books the refusal:
        #: with several calls in flight, only its own envs are broken).
        self.indices: Sequence[int] = ()


@dataclass(slots=True)
class StepArgs:
    """One step's actions, decoded and as received (the spread forwards these)."""

    #: Env indices, strictly increasing.
    indices: Sequence[int]
    #: One decoded action per index, or one batch-form message.
    actions: Any
    #: The same actions as they came on the wire: Anys, or one Any in batch form.
    wire: Any
    batch_form: bool
    #: Takes the outcome (and seconds) of a step the envs completed after its request was
    #: given up (its stream ended meanwhile), so it is still booked and counted (the
    #: driver's).
    orphaned: Callable[[BatchOutcome, float], None] | None = None
    #: The autoresets this step makes, as the driver decided them (a loop batch's; a
    #: native batch makes its own).
    autoresets: Autoresets = NO_AUTORESETS


@dataclass(slots=True)
class ResetArgs:
    """One reset's per-env arguments (the episode ids are chosen already)."""

    indices: Sequence[int]
    seeds: Sequence[int | None]
    episode_ids: Sequence[str]
    options: Sequence[Message | None]
    #: The same options as they came on the wire (None where none was given).
    wire_options: Sequence[any_pb2.Any | None]
    batch_form: bool


@dataclass(slots=True)
class RestoreArgs:
    """One restore's snapshots, authenticated and opened (the envs get ``env_state``)."""

    indices: Sequence[int]
    captured: Sequence[Captured]

    @property
    def states(self) -> list[bytes]:
        """Each env's own bytes."""
        return [one.env_state for one in self.captured]

    @property
    def ended(self) -> list[bool]:
        """Per env: the captured episode had ended (terminated or truncated)."""
        return [one.phase != snapshot_pb2.SNAPSHOT_PHASE_RUNNING for one in self.captured]


class BatchCalls(Protocol):
    """A vector stream's envs, wherever they run: one call per request.

    Each method raises :class:`BatchRefused` when the whole call failed, and
    :class:`~openenv_grpc.server.errors.SessionLostError` when the envs are gone.
    """

    @property
    def native(self) -> bool:
        """The envs answer in a native batch form."""
        ...

    async def reset(self, args: ResetArgs) -> BatchOutcome: ...

    async def step(self, args: StepArgs) -> BatchOutcome: ...

    async def query(self, name: str, indices: Sequence[int]) -> BatchStates:
        """Each env's answer to query ``name`` (``queries.py``; a snapshot's bytes come
        unsealed), or its error."""
        ...

    async def restore(self, args: RestoreArgs) -> dict[int, RowError]:
        """Hand each env its authenticated bytes; the envs that failed, by index."""
        ...

    async def close(self) -> None:
        """Close every env, once; never raises for what the envs' ``close`` did (logged)."""
        ...

    async def close_strictly(self) -> None:
        """Close every env for a close command.

        Raises:
            Exception: what an env's ``close`` raised (closed all the same).
            BatchRefused: DEADLINE_EXCEEDED, the close ran past its timeout and was given
                up on (the stream ends), wherever the envs live.
        """
        ...


class Losses(Protocol):
    """Who books the envs that batch calls lost with their env process (the driver): the
    calls report each loss as they learn of it, the books say what a request naming such
    an env gets."""

    def book_lost(self, errors: Mapping[int, RowError]) -> None:
        """These envs are fresh ones since their process was lost, and nobody told them
        yet: each is told its error by the next request that asks about it."""
        ...

    def book_told(self, indices: Iterable[int]) -> None:
        """These envs are told of their loss by the answer of the call under way."""
        ...


@runtime_checkable
class LosesEnvs(Protocol):
    """Batch calls that can lose envs a call did not name, with their process
    (``--isolated``): they report those to :meth:`report_losses`'s books."""

    def report_losses(self, losses: Losses) -> None: ...


class LocalBatchCalls:
    """A batch in this process (or in an env process), called through one runner: the
    whole call runs where one env call of this env would run.

    A call gets ``call_timeout`` seconds per env it names. Past that the batch is
    abandoned (closed once its call returns) and replaced by a fresh one made by
    ``replace``: every env of the stream starts over (a Session's one env, too).
    """

    __slots__ = (
        "_batch", "_generation", "_lock", "_make", "_queued", "_runner", "_timeout", "_words",
    )  # fmt: skip

    def __init__(
        self,
        runner: EnvRunner,
        replace: Callable[[], Awaitable[EnvRunner]],
        call_timeout: float | None,
        words: Words = VECTOR_WORDS,
    ) -> None:
        self._runner = runner
        self._batch: Any = runner.env  # a VectorBatch (see batch.batch_spec)
        self._make = replace
        self._timeout = call_timeout
        self._words = words
        #: One batch call at a time, whatever the requests in flight: a batch (a native
        #: one above all) is not made to be called from two threads at once.
        self._lock = asyncio.Lock()
        #: Calls waiting for the lock (while any do, none may skip it).
        self._queued = 0
        #: Bumped when a hung batch is replaced: a call that waited behind the hung one
        #: must not run on the fresh envs it was never checked against.
        self._generation = 0

    @property
    def native(self) -> bool:
        batch: VectorBatch = self._batch
        return batch.native

    async def reset(self, args: ResetArgs) -> BatchOutcome:
        batch = self._batch
        result: BatchOutcome = await self._call(
            "reset", len(args.indices), batch.reset, args.indices, args.seeds,
            args.episode_ids, args.options, args.batch_form,
        )  # fmt: skip
        return result

    async def step(self, args: StepArgs) -> BatchOutcome:
        result: BatchOutcome = await self._call(
            "step", len(args.indices), self._batch.step, args.indices, args.actions,
            args.batch_form, args.autoresets, orphaned=args.orphaned,
        )  # fmt: skip
        return result

    async def query(self, name: str, indices: Sequence[int]) -> BatchStates:
        batch = self._batch
        result: BatchStates = await self._call(name, len(indices), batch.query, name, indices)
        return result

    async def restore(self, args: RestoreArgs) -> dict[int, RowError]:
        result: dict[int, RowError] = await self._call(
            "restore", len(args.indices), self._batch.restore, args.indices, args.states,
            args.ended,
        )  # fmt: skip
        return result

    async def close(self) -> None:
        await self._runner.close_quietly()

    async def close_strictly(self) -> None:
        try:
            await self._runner.close()
        except CloseAbandoned as exc:  # answered as an isolated hung close is
            raise BatchRefused(_DEADLINE_EXCEEDED, str(exc), ends=True) from None

    async def _call(
        self, what: str, envs: int, method: Any, *args: Any, orphaned: Orphaned | None = None
    ) -> Any:
        runner = self._runner
        if runner.inline and not self._queued and not self._lock.locked():
            # Nothing holds the lock or waits for it, and an inline call never yields:
            # taking the lock would change nothing, so a step's hot path skips it.
            try:
                return runner.call_inline(method, *args)
            except Exception as exc:
                async with self._lock:  # a hung call's replacement holds it
                    await self._refuse(what, self._call_timeout(envs), exc)
        timeout = self._call_timeout(envs)
        generation = self._generation
        self._queued += 1
        try:
            await self._lock.acquire()
        finally:
            self._queued -= 1
        try:
            if generation != self._generation:
                raise BatchRefused(
                    _FAILED_PRECONDITION,
                    f"{what} not done: a call before it on this stream did not finish in "
                    f"time and {self._words.replaced}",
                )
            runner = self._runner  # a replacement made while this call waited
            try:
                if runner.inline:  # on the loop and untimed: no coroutine to await
                    return runner.call_inline(method, *args)
                return await runner.call_within(timeout, method, *args, orphaned=orphaned)
            except Exception as exc:
                await self._refuse(what, timeout, exc)
        finally:
            self._lock.release()

    def _call_timeout(self, envs: int) -> float | None:
        """The seconds a call naming ``envs`` envs may take (None: no limit)."""
        return None if self._timeout is None else self._timeout * max(envs, 1)

    async def _refuse(self, what: str, timeout: float | None, exc: Exception) -> NoReturn:
        """Refuse the call that raised ``exc`` (call it in the ``except`` block).

        Raises:
            BatchRefused: always; DEADLINE_EXCEEDED after a timeout, once the hung batch
                is replaced (see :meth:`_replace`).
        """
        if isinstance(exc, TimeoutError):
            await self._replace(what, timeout or 0.0)
        if isinstance(exc, PoolSaturated):
            raise BatchRefused(_RESOURCE_EXHAUSTED, str(exc), saturated=True) from None
        if isinstance(exc, InvalidAction):
            raise BatchRefused(_INVALID_ARGUMENT, str(exc), qualname(exc)) from None
        log.exception("the batch's %s() raised", what)
        raise BatchRefused(
            _INTERNAL, f"{what} failed: {describe(exc)}", qualname(exc), broken=True
        ) from None

    async def _replace(self, what: str, timeout: float) -> None:
        """Abandon the hung batch, make a fresh one, and refuse the call.

        Raises:
            BatchRefused: always (DEADLINE_EXCEEDED; or the end of the stream when no
                fresh batch can be made).
        """
        words = self._words
        self._runner.abandon()
        self._generation += 1
        try:
            self._runner = await self._make()
        except NoSlot as exc:
            # The hung instance keeps its slot until its call returns: the cap is on envs.
            raise BatchRefused(
                _RESOURCE_EXHAUSTED,
                f"{what} did not finish within {timeout:g}s and {words.no_fresh}: {exc}; "
                "the session ends",
                ends=True,
            ) from None
        except Exception as exc:
            log.exception("building a batch to replace a hung one raised")
            raise BatchRefused(
                _INTERNAL,
                f"{words.not_replaced}: {describe(exc)}",
                qualname(exc),
                ends=True,
            ) from None
        self._batch = self._runner.env
        raise BatchRefused(
            _DEADLINE_EXCEEDED,
            f"{what} did not finish within {timeout:g}s; {words.replaced}",
            replaced=True,
        )


def _nothing(count: int = 1) -> None:
    pass


async def local_calls(
    spec: EnvSpec,
    size: int,
    autoreset: AutoresetMode,
    pool: Executor,
    *,
    words: Words = VECTOR_WORDS,
    call_timeout: float | None = None,
    placement: CallPlacement | None = None,
    native: bool = True,
    lifecycle: Executor | None = None,
    release: Callable[[int], None] = _nothing,
    reserve: Callable[[int], None] = _nothing,
) -> LocalBatchCalls:
    """The ``size`` envs of one stream built here as one batch (``native``: the env's own
    batch if it has one; a Session's env is a loop of one), run through one runner on
    ``pool`` / ``lifecycle`` as the env's execution mode says (``placement`` measures a
    measured env's batch calls). The runner calls ``release(size)`` when the batch is
    closed or could not be made; a hung batch's replacement first calls ``reserve(size)``
    (a limiter's ``acquire_for_replacement``, which may raise NoSlot).

    Raises:
        Exception: what building the envs raised.
    """
    batched = batch_spec(spec, size, autoreset, placement, native=native)

    def freed() -> None:
        release(size)

    async def make() -> EnvRunner:
        return await EnvRunner.create(batched, pool, lifecycle=lifecycle, release=freed)

    async def replacement() -> EnvRunner:
        reserve(size)
        return await make()

    return LocalBatchCalls(await make(), replacement, call_timeout, words)
