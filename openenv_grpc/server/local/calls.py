"""A stream's envs, wherever they run, called once per request (:class:`BatchCalls`, the
driver's view): :class:`LocalBatchCalls` runs them here (or in an env process) as one
``VectorBatch`` through one runner; ``spread.py`` over env processes. An episode-changing
command is its args dataclass (:data:`PER_ENV`...) and the batch's method of its name.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import operator
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, ClassVar, NoReturn, Protocol, runtime_checkable

import grpc
from google.protobuf.message import Message

from openenv_grpc.environment import AutoresetMode, InvalidAction
from openenv_grpc.server.errors import EnvExit, RowError, describe, qualname
from openenv_grpc.server.local.batch import (
    NO_AUTORESETS,
    Autoresets,
    BatchOutcome,
    VectorBatch,
    batch_spec,
)
from openenv_grpc.server.local.env_threads import CloseAbandoned, Lifecycle
from openenv_grpc.server.local.runner import EnvRunner, Orphaned, PoolSaturated
from openenv_grpc.server.model.phases import VECTOR_WORDS, Words
from openenv_grpc.server.model.placement import CallPlacement
from openenv_grpc.server.model.queries import BatchStates
from openenv_grpc.server.model.snapshots import Captured
from openenv_grpc.server.model.spec import EnvSpec
from openenv_grpc.server.process.limiter import NoSlot
from openenv_grpc.v1 import snapshot_pb2

__all__ = [
    "BY_ENV",
    "FRONT",
    "PER_ENV",
    "BatchCalls",
    "BatchRefused",
    "Commands",
    "LocalBatchCalls",
    "LosesEnvs",
    "Losses",
    "ResetArgs",
    "RestoreArgs",
    "StepArgs",
    "batch_args",
    "local_calls",
    "part_args",
]

log = logging.getLogger(__name__)

_INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_INTERNAL = grpc.StatusCode.INTERNAL.value[0]
_DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
_FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


class BatchRefused(Exception):
    """A whole batch call failed. ``broken``: the envs it named must be reset;
    ``replaced``: every env is a fresh one (the batch hung); ``saturated``: it never ran;
    ``ends``: the stream ends after this answer."""

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
        self.indices: Sequence[int] = ()


#: Field metadata of a command's args. FRONT: stays in the front; PER_ENV: one item per
#: index; BY_ENV: keyed by env index (or a dataclass of such mappings). The others go to
#: the batch's method as they are, in declaration order.
FRONT: Mapping[str, str] = {"split": "front"}
PER_ENV: Mapping[str, str] = {"split": "per_env"}
BY_ENV: Mapping[str, str] = {"split": "by_env"}


@dataclass(slots=True)
class StepArgs:
    """One step: ``batch.step(indices, actions, batch_form, autoresets)``."""

    indices: Sequence[int]
    #: One action per index, or one batch-form message (a native batch: never split).
    actions: Any = field(metadata=PER_ENV)
    batch_form: bool = False
    #: Takes the outcome (and seconds) of a step completed after it was given up.
    orphaned: Callable[[BatchOutcome, float], None] | None = field(default=None, metadata=FRONT)
    autoresets: Autoresets = field(default=NO_AUTORESETS, metadata=BY_ENV)
    outcome: ClassVar[Callable[[], Any]] = BatchOutcome


@dataclass(slots=True)
class ResetArgs:
    """One reset: ``batch.reset(indices, seeds, episode_ids, options, batch_form)``."""

    indices: Sequence[int]
    seeds: Sequence[int | None] = field(metadata=PER_ENV)
    episode_ids: Sequence[str] = field(metadata=PER_ENV)
    options: Sequence[Message | None] = field(metadata=PER_ENV)
    batch_form: bool = False
    outcome: ClassVar[Callable[[], Any]] = BatchOutcome


@dataclass(slots=True)
class RestoreArgs:
    """``batch.restore(indices, states, ended)``, the per-env errors back: only each env's
    authenticated bytes and phase leave the front."""

    indices: Sequence[int]
    captured: Sequence[Captured] = field(metadata=FRONT)
    states: list[bytes] = field(init=False, metadata=PER_ENV)
    ended: list[bool] = field(init=False, metadata=PER_ENV)
    outcome: ClassVar[Callable[[], Any]] = dict

    def __post_init__(self) -> None:
        self.states = [one.env_state for one in self.captured]
        self.ended = [one.phase != snapshot_pb2.SNAPSHOT_PHASE_RUNNING for one in self.captured]


_Plan = tuple[Callable[[Any], tuple[Any, ...]], tuple[str, ...]]


class _Plans(dict[type, _Plan]):
    """Per args class: the getter of what the batch gets, and each field's split (read by
    subscript: no call on the hot path once made)."""

    def __missing__(self, kind: type) -> _Plan:
        sent = [f for f in dataclasses.fields(kind) if f.metadata.get("split") != "front"]
        plan = self[kind] = (
            _getter(f.name for f in sent),
            tuple("indices" if f.name == "indices" else f.metadata.get("split", "") for f in sent),
        )
        return plan


_PLANS = _Plans()


def _getter(names: Iterable[str]) -> Callable[[Any], tuple[Any, ...]]:
    names = tuple(names)
    get = operator.attrgetter(*names)
    if len(names) == 1:
        return lambda one: (get(one),)
    return get


def batch_args(args: Any) -> tuple[Any, ...]:
    """What the batch's method gets: the args' fields but FRONT ones."""
    return _PLANS[type(args)][0](args)


def part_args(args: Any, positions: Sequence[int], local: Sequence[int]) -> tuple[Any, ...]:
    """:func:`batch_args` for a sub-batch: the envs at ``positions`` of ``args.indices``,
    as the sub-batch's ``local`` indices."""
    get, splits = _PLANS[type(args)]
    return tuple(
        [
            local
            if split == "indices"
            else [value[k] for k in positions]
            if split == "per_env"
            else _rekey(value, args.indices, positions, local)
            if split == "by_env"
            else value
            for value, split in zip(get(args), splits, strict=True)
        ]
    )


#: Per BY_ENV type: the getter of a dataclass's mappings (None: a mapping).
_MAPS: dict[type, Callable[[Any], tuple[Any, ...]] | None] = {}


def _rekey(value: Any, indices: Sequence[int], positions: Sequence[int], local: Any) -> Any:
    kind = type(value)
    if kind in _MAPS:
        get = _MAPS[kind]
    else:
        fields = dataclasses.fields(kind) if dataclasses.is_dataclass(kind) else ()
        get = _MAPS[kind] = _getter(f.name for f in fields) if fields else None
    maps = (value,) if get is None else get(value)
    if not any(maps):
        return value  # nothing keyed: as it is
    to_local = {indices[k]: at for k, at in zip(positions, local, strict=True)}
    maps = tuple([{to_local[i]: v for i, v in one.items() if i in to_local} for one in maps])
    return maps[0] if get is None else kind(*maps)


class BatchCalls(Protocol):
    """A stream's envs: one call per request, raising :class:`BatchRefused` when it failed
    as a whole, ``SessionLostError`` when the envs are gone."""

    @property
    def native(self) -> bool: ...

    async def command(self, name: str, args: Any) -> Any:
        """The batch's method ``name`` on ``args`` (as :class:`StepArgs`)."""
        ...

    async def reset(self, args: ResetArgs) -> BatchOutcome: ...

    async def step(self, args: StepArgs) -> BatchOutcome: ...

    async def restore(self, args: RestoreArgs) -> dict[int, RowError]: ...

    async def query(self, name: str, indices: Sequence[int]) -> BatchStates: ...

    async def close(self) -> None: ...

    async def close_strictly(self) -> None:
        """Close every env for a close command; raises what a ``close`` raised, or
        BatchRefused (DEADLINE_EXCEEDED, the stream ends) past its timeout."""
        ...


class Commands:
    """The driver's names for :meth:`command` (plain functions: no coroutine of their
    own)."""

    __slots__ = ()

    async def command(self, name: str, args: Any) -> Any:
        raise NotImplementedError

    def reset(self, args: ResetArgs) -> Coroutine[Any, Any, BatchOutcome]:
        return self.command("reset", args)

    def step(self, args: StepArgs) -> Coroutine[Any, Any, BatchOutcome]:
        return self.command("step", args)

    def restore(self, args: RestoreArgs) -> Coroutine[Any, Any, dict[int, RowError]]:
        return self.command("restore", args)


class Losses(Protocol):
    """The driver's books of envs lost with their env process."""

    def book_lost(self, errors: Mapping[int, RowError]) -> None:
        """These envs are fresh ones, told by the next request naming one."""
        ...

    def book_told(self, indices: Iterable[int]) -> None:
        """These envs are told of their loss by the answer under way."""
        ...


@runtime_checkable
class LosesEnvs(Protocol):
    """Batch calls that can lose envs a call did not name (``--isolated``)."""

    def report_losses(self, losses: Losses) -> None: ...


class LocalBatchCalls(Commands):
    """A batch called through one runner; a call past ``call_timeout`` s per env it names
    has the batch replaced by a fresh one from ``replace``."""

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
        self._batch: Any = runner.env  # a VectorBatch
        self._make = replace
        self._timeout = call_timeout
        self._words = words
        self._lock = asyncio.Lock()
        #: Calls waiting for the lock (while any do, none may skip it).
        self._queued = 0
        #: Bumped when a hung batch is replaced: a call queued behind it must not run on
        #: fresh envs it was never checked against.
        self._generation = 0

    @property
    def native(self) -> bool:
        batch: VectorBatch = self._batch
        return batch.native

    def command(self, name: str, args: Any) -> Coroutine[Any, Any, Any]:
        sent = _PLANS[type(args)][0](args)  # batch_args, inline: a Session's step is hot
        return self.call(name, name, len(args.indices), sent, getattr(args, "orphaned", None))

    async def query(self, name: str, indices: Sequence[int]) -> BatchStates:
        states: BatchStates = await self.call(name, "query", len(indices), (name, indices))
        return states

    async def call(
        self,
        what: str,
        method: str,
        envs: int,
        args: tuple[Any, ...],
        orphaned: Orphaned | None = None,
    ) -> Any:
        """The batch's ``method`` on ``args``, for ``envs`` envs (``what``: its name)."""
        call = getattr(self._batch, method)
        runner = self._runner
        if not self._queued and not self._lock.locked():
            # Nothing holds or waits for the lock and a call on the loop never yields: an
            # inline env's, or a measured one's while its group is on the loop (and no
            # timeout applies: one that does sends a measured call to the pool).
            try:
                try:  # the group is env code's too (its cost_class())
                    if runner.inline:
                        return call(*args)
                    if self._timeout is None and (group := runner.group_on_loop(call)) is not None:
                        return group.call_inline(call, *args)
                except (Exception, asyncio.CancelledError):
                    raise
                except BaseException as exc:  # runner.call_inline's, a call less
                    raise EnvExit(exc) from exc
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
            call = getattr(self._batch, method)
            try:
                if runner.inline:
                    return runner.call_inline(call, *args)
                return await runner.call_within(timeout, call, *args, orphaned=orphaned)
            except Exception as exc:
                await self._refuse(what, timeout, exc)
        finally:
            self._lock.release()

    async def close(self) -> None:
        await self._runner.close_quietly()

    async def close_strictly(self) -> None:
        try:
            await self._runner.close()
        except CloseAbandoned as exc:  # answered as an isolated hung close is
            raise BatchRefused(_DEADLINE_EXCEEDED, str(exc), ends=True) from None

    def _call_timeout(self, envs: int) -> float | None:
        return None if self._timeout is None else self._timeout * max(envs, 1)

    async def _refuse(self, what: str, timeout: float | None, exc: Exception) -> NoReturn:
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

    async def _replace(self, what: str, timeout: float) -> NoReturn:
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
                _INTERNAL, f"{words.not_replaced}: {describe(exc)}", qualname(exc), ends=True
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
    objects: bool = False,
    lifecycle: Lifecycle | None = None,
    release: Callable[[int], None] = _nothing,
    reserve: Callable[[int], None] = _nothing,
) -> LocalBatchCalls:
    """The ``size`` envs of one stream built here as one batch (``native``: the env's own
    if it has one; ``objects``: observations not serialized). ``release(size)`` is called
    once it is closed or failed; a replacement first calls ``reserve(size)`` (which may
    raise NoSlot)."""
    batched = batch_spec(spec, size, autoreset, placement, native=native, objects=objects)

    def freed() -> None:
        release(size)

    async def make() -> EnvRunner:
        return await EnvRunner.create(batched, pool, lifecycle=lifecycle, release=freed)

    async def replacement() -> EnvRunner:
        reserve(size)
        return await make()

    return LocalBatchCalls(await make(), replacement, call_timeout, words)
