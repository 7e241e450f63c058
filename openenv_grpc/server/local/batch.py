"""The envs of one stream answered in one call: a loop over N plain instances (a Session's
env is a loop of one), or the env's own native batch (:meth:`Environment.make_batch`).

The loop makes the autoresets the driver decides (:class:`Autoresets`); a native batch
makes its own. An env's exception (``BaseException``: env code's ``SystemExit`` too) is an
error for its index only; its neighbours answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

from google.protobuf.message import Message

from openenv_grpc.environment import (
    AutoresetMode,
    BatchEnvironment,
    BatchTransition,
    Environment,
    EnvironmentTypes,
    Transition,
)
from openenv_grpc.server.errors import BadTransition, RowError, contained, row_error
from openenv_grpc.server.model.phases import new_episode_id
from openenv_grpc.server.model.placement import CallPlacement
from openenv_grpc.server.model.queries import QUERIES, BatchStates, wrong_type
from openenv_grpc.server.model.spec import EnvSpec

__all__ = [
    "NO_AUTORESETS",
    "AsyncLoopBatch",
    "Autoresets",
    "BatchOutcome",
    "LoopBatch",
    "NativeBatch",
    "VectorBatch",
    "batch_spec",
    "build_batch",
    "natively_batched",
]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class BatchOutcome:
    """What one reset or step returned. Rows are env indices in call order, those in
    ``errors`` left out; observations are serialized, per row or as one batch message (a
    loop built with ``objects``: per row, as the env returned them)."""

    rows: list[int] = field(default_factory=list)
    observations: list[Any] = field(default_factory=list)
    batch_observation: bytes | None = None
    rewards: list[float] = field(default_factory=list)
    #: Rows whose env gave no reward (None): their reward above is 0.
    no_reward: set[int] = field(default_factory=set)
    terminated: list[bool] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    #: Env index -> info (a mapping, or a ``Struct`` already).
    infos: dict[int, Any] = field(default_factory=dict)
    #: None: no row was autoreset; else one mark per row.
    autoreset: list[bool] | None = None
    #: Env index -> the id of the episode a loop autoreset (a native batch's: the caller's).
    new_episode_ids: dict[int, str] = field(default_factory=dict)
    #: SAME_STEP: the ended episodes' last observations, one per autoreset row.
    final_observations: list[Any] = field(default_factory=list)
    batch_final_observation: bytes | None = None
    #: SAME_STEP: env index -> the ended episode's last info.
    final_infos: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, RowError] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Autoresets:
    """The autoresets one step of a loop batch makes, as the driver decided them.

    NEXT_STEP: the envs of ``episode_ids`` are reset instead of stepped (actions ignored).
    SAME_STEP: an env whose episode ends at this step starts the one ``episode_ids`` names.
    An autoreset is unseeded, with the env's ``options`` (of its last reset by the client).
    """

    episode_ids: Mapping[int, str] = field(default_factory=dict)
    #: Env index -> its autoreset's options (decoded).
    options: Mapping[int, Message] = field(default_factory=dict)


NO_AUTORESETS = Autoresets()


class VectorBatch:
    """The envs of one stream: ``reset``, ``step`` (a :class:`BatchOutcome`), ``query``
    (a :class:`BatchStates`), ``restore`` (the per-index errors) and ``close``; coroutines
    in :class:`AsyncLoopBatch`. Raising means the whole call failed: ``InvalidAction``
    refuses it, anything else breaks every named env."""

    #: The envs answer in a native batch form (batch_action, batch_observation).
    native: ClassVar[bool] = False
    #: The ``cost_class`` method a measured batch's calls are grouped by (None: "").
    _cost_class: Any = None

    def __init__(self, size: int, autoreset: AutoresetMode) -> None:
        self.size = size
        self.autoreset = autoreset

    def cost_class(self) -> str:
        return "" if self._cost_class is None else str(self._cost_class())

    def computes_in_threads(self) -> bool:
        """Its calls wait only on compute threads of its own."""
        return False

    def by_method_alone(self) -> bool:
        """Its calls' cost groups depend on the method alone: no ``cost_class``, no
        compute threads of its own (a runner may keep them)."""
        threads = type(self).computes_in_threads  # an override may answer per call
        return self._cost_class is None and threads is VectorBatch.computes_in_threads


class _Instances(VectorBatch):
    """N plain instances of one env class. ``objects``: observations stay the objects the
    envs returned, of any type (for a wire that reads them in process), not serialized."""

    def __init__(
        self, spec: EnvSpec, size: int, autoreset: AutoresetMode, objects: bool = False
    ) -> None:
        super().__init__(size, autoreset)
        self._objects = objects
        envs: list[Any] = []
        try:
            for _ in range(size):
                env = spec.factory()
                envs.append(env)
                if not isinstance(env, spec.env_class):
                    raise TypeError(
                        f"factory returned {type(env).__qualname__}, "
                        f"not {spec.env_class.__qualname__}"
                    )
        except BaseException:
            _closed(_called(lambda env: env.close(), envs), reraise=False)
            raise
        self._envs = envs
        self._observation = spec.types.observation
        self._types = spec.types
        self._same_step = autoreset is AutoresetMode.SAME_STEP
        self._next_step = autoreset is AutoresetMode.NEXT_STEP
        # A loop of one (a Session's env) is measured as that env: its own cost class.
        own = getattr(type(envs[0]), "cost_class", Environment.cost_class)
        if size == 1 and own is not Environment.cost_class:
            self._cost_class = envs[0].cost_class

    def _checked(self, transition: Any) -> Transition[Any]:
        if not isinstance(transition, Transition):
            raise BadTransition(
                f"environment returned a {type(transition).__qualname__}, not a Transition"
            )
        if not self._objects and not isinstance(transition.observation, self._observation):
            raise BadTransition(
                wrong_type("observation", transition.observation, self._observation)
            )
        return transition

    def _add(
        self, out: BatchOutcome, index: int, transition: Transition[Any], new_episode: str = ""
    ) -> None:
        """One row from a checked transition (``new_episode``: the id of an autoreset's)."""
        out.rows.append(index)
        observation = transition.observation
        out.observations.append(observation if self._objects else observation.SerializeToString())
        out.rewards.append(_reward(out, index, transition.reward))
        out.terminated.append(transition.terminated)
        out.truncated.append(transition.truncated)
        if transition.info:
            out.infos[index] = transition.info
        marks = out.autoreset
        if new_episode:
            out.new_episode_ids[index] = new_episode
            if marks is None:
                out.autoreset = marks = [False] * (len(out.rows) - 1)
            marks.append(True)
        elif marks is not None:
            marks.append(False)

    def _add_same_step(
        self,
        out: BatchOutcome,
        index: int,
        ended: Transition[Any],
        first: Transition[Any],
        episode_id: str,
    ) -> None:
        """SAME_STEP's row for an episode that just ended: the step's reward and flags,
        the new episode's first observation and info; the last ones go to the finals."""
        self._add(out, index, first, episode_id)
        out.no_reward.discard(index)  # the row's reward is the ended step's, not the reset's
        out.rewards[-1] = _reward(out, index, ended.reward)
        out.terminated[-1] = ended.terminated
        out.truncated[-1] = ended.truncated
        final = ended.observation
        out.final_observations.append(final if self._objects else final.SerializeToString())
        if ended.info:
            out.final_infos[index] = ended.info

    def _reset(self, index: int, seed: int | None, episode_id: str, options: Any) -> Any:
        """What env ``index``'s ``reset`` returned (a coroutine, for an asyncio env)."""
        return self._envs[index].reset(seed=seed, episode_id=episode_id, options=options)

    def _restart(self, index: int, autoresets: Autoresets) -> tuple[Any, str]:
        """Autoreset env ``index`` (the one place one is made): its :meth:`_reset` and the
        new episode's id."""
        episode_id = autoresets.episode_ids.get(index) or new_episode_id()
        return self._reset(index, None, episode_id, autoresets.options.get(index)), episode_id

    def _reset_rows(self, indices: Sequence[int], answers: Iterable[Any]) -> BatchOutcome:
        """Each env's row, or its error (``answers``: what each reset returned or raised)."""
        out = BatchOutcome()
        for index, answer in zip(indices, answers, strict=True):
            try:
                first = self._checked(_result(answer))
            except BaseException as exc:
                out.errors[index] = row_error(exc, "reset")
                continue
            self._add(out, index, first)
        return out


class LoopBatch(_Instances):
    """N instances of a sync env, called one after the other."""

    def reset(
        self,
        indices: Sequence[int],
        seeds: Sequence[int | None],
        episode_ids: Sequence[str],
        options: Sequence[Message | None],
        batch_form: bool = False,
    ) -> BatchOutcome:
        answers = _called(self._reset, indices, seeds, episode_ids, options)
        return self._reset_rows(indices, answers)

    def step(
        self,
        indices: Sequence[int],
        actions: Sequence[Message],
        batch_form: bool = False,
        autoresets: Autoresets = NO_AUTORESETS,
    ) -> BatchOutcome:
        out = BatchOutcome()
        envs = self._envs
        restarts = autoresets.episode_ids if self._next_step else {}  # NEXT_STEP's
        add, checked, same_step = self._add, self._checked, self._same_step
        # The common row (not ended, no autoreset yet in this call) is written here
        # without a call per row: it is most of a vector step.
        rows, observations = out.rows.append, out.observations.append
        rewards, terminated, truncated = (
            out.rewards.append, out.terminated.append, out.truncated.append,
        )  # fmt: skip
        observation_class, objects = self._observation, self._objects
        for index, action in zip(indices, actions, strict=True):
            env = envs[index]
            try:
                if index in restarts:  # NEXT_STEP: this step starts the next episode
                    first, episode_id = self._restart(index, autoresets)
                    add(out, index, checked(first), episode_id)
                    continue
                transition = env.step(action)
                if type(transition) is not Transition or (
                    type(transition.observation) is not observation_class and not objects
                ):
                    transition = checked(transition)  # raises unless a subclass
                ended = transition.terminated or transition.truncated
                if ended or transition.info or out.autoreset is not None:
                    if same_step and ended:
                        first, episode_id = self._restart(index, autoresets)
                        self._add_same_step(out, index, transition, checked(first), episode_id)
                    else:
                        add(out, index, transition)
                    continue
            except BaseException as exc:
                out.errors[index] = row_error(exc, "step")
                continue
            rows(index)
            observation = transition.observation
            observations(observation if objects else observation.SerializeToString())
            reward = transition.reward
            if reward is None:
                reward = _reward(out, index, reward)
            rewards(reward)
            terminated(False)
            truncated(False)
        return out

    def query(self, name: str, indices: Sequence[int]) -> BatchStates:
        envs = self._envs
        answers = _called(lambda index: getattr(envs[index], name)(), indices)
        return _states(name, indices, answers, self._types)

    def restore(
        self, indices: Sequence[int], states: Sequence[bytes], ended: Sequence[bool]
    ) -> dict[int, RowError]:
        envs = self._envs
        return _restored(indices, _called(lambda i, state: envs[i].restore(state), indices, states))

    def close(self) -> None:
        """Close every env, whatever the others do; then raise the first close's error."""
        _closed(_called(lambda env: env.close(), self._envs))


class AsyncLoopBatch(_Instances):
    """N instances of an asyncio env; each call awaits them all at once (gathered)."""

    async def reset(
        self,
        indices: Sequence[int],
        seeds: Sequence[int | None],
        episode_ids: Sequence[str],
        options: Sequence[Message | None],
        batch_form: bool = False,
    ) -> BatchOutcome:
        rows = zip(indices, seeds, episode_ids, options, strict=True)
        calls = itertools.starmap(self._reset, rows)
        return self._reset_rows(indices, await _gather(calls))

    async def step(
        self,
        indices: Sequence[int],
        actions: Sequence[Message],
        batch_form: bool = False,
        autoresets: Autoresets = NO_AUTORESETS,
    ) -> BatchOutcome:
        restarts = autoresets.episode_ids if self._next_step else {}
        answers = await _gather(
            self._one_step(index, action, index in restarts, autoresets)
            for index, action in zip(indices, actions, strict=True)
        )
        out = BatchOutcome()
        for index, answer in zip(indices, answers, strict=True):
            try:
                kind, transition, first, episode_id = _result(answer)
            except BaseException as exc:
                out.errors[index] = row_error(exc, "step")
                continue
            if kind == "same_step":
                self._add_same_step(out, index, transition, first, episode_id)
            else:  # a plain step's episode_id is ""
                self._add(out, index, transition, episode_id)
        return out

    async def _one_step(
        self, index: int, action: Message, restart: bool, autoresets: Autoresets
    ) -> tuple[str, Transition[Any], Any, str]:
        """One env's part of a step: (what happened, the transition, a SAME_STEP
        autoreset's first transition, the new episode's id)."""
        if restart:
            call, episode_id = self._restart(index, autoresets)
            return "next_step", self._checked(await call), None, episode_id
        transition = self._checked(await self._envs[index].step(action))
        if self._same_step and (transition.terminated or transition.truncated):
            call, episode_id = self._restart(index, autoresets)
            return "same_step", transition, self._checked(await call), episode_id
        return "step", transition, None, ""

    async def query(self, name: str, indices: Sequence[int]) -> BatchStates:
        envs = self._envs
        answers = await _gather(getattr(envs[index], name)() for index in indices)
        return _states(name, indices, answers, self._types)

    async def restore(
        self, indices: Sequence[int], states: Sequence[bytes], ended: Sequence[bool]
    ) -> dict[int, RowError]:
        envs = self._envs
        calls = (envs[index].restore(state) for index, state in zip(indices, states, strict=True))
        return _restored(indices, await _gather(calls))

    async def close(self) -> None:
        """Close every env at once (a hung close holds back no other); then raise the
        first close's error."""
        _closed(await _gather(env.close() for env in self._envs))


class NativeBatch(VectorBatch):
    """An env's own :class:`BatchEnvironment`, checked and put in the wire's shape; per-env
    actions are joined (``join_actions``), the batch observation split per row."""

    native = True

    def __init__(self, batch: BatchEnvironment[Any, Any, Any, Any], spec: EnvSpec) -> None:
        super().__init__(batch.size, batch.autoreset)
        self._batch = batch
        self._cost_class = getattr(batch, "cost_class", None)
        self._observation = spec.types.observation
        self._types = spec.types

    def reset(
        self,
        indices: Sequence[int],
        seeds: Sequence[int | None],
        episode_ids: Sequence[str],
        options: Sequence[Message | None],
        batch_form: bool = False,
    ) -> BatchOutcome:
        transition = self._batch.reset(indices, seeds, options)
        return self._outcome(indices, transition, batch_form, resets=False)

    def step(
        self,
        indices: Sequence[int],
        actions: Any,
        batch_form: bool = False,
        autoresets: Autoresets = NO_AUTORESETS,
    ) -> BatchOutcome:
        """A step (the native batch makes its own autoresets: ``autoresets`` is ignored)."""
        batch = self._batch
        action = actions if batch_form else batch.join_actions(actions)
        return self._outcome(indices, batch.step(indices, action), batch_form, resets=True)

    def query(self, name: str, indices: Sequence[int]) -> BatchStates:
        return _states(name, indices, _called(getattr(self._batch, name), indices), self._types)

    def restore(
        self, indices: Sequence[int], states: Sequence[bytes], ended: Sequence[bool]
    ) -> dict[int, RowError]:
        batch = self._batch
        calls = _called(lambda i, s, over: batch.restore(i, s, ended=over), indices, states, ended)
        return _restored(indices, calls)

    def close(self) -> None:
        self._batch.close()

    def computes_in_threads(self) -> bool:
        return bool(self._batch.computes_in_threads())

    def _outcome(
        self, indices: Sequence[int], transition: Any, batch_form: bool, *, resets: bool
    ) -> BatchOutcome:
        """The wire's rows from a :class:`BatchTransition`.

        Raises:
            BadTransition: the batch broke its contract (wrong type, wrong lengths).
        """
        if not isinstance(transition, BatchTransition):
            raise BadTransition(
                f"batch returned a {type(transition).__qualname__}, not a BatchTransition"
            )
        failed = transition.errors or {}
        rows = [index for index in indices if index not in failed]
        count = len(rows)
        out = BatchOutcome(rows=rows)
        out.rewards = _as_list(_column(transition.rewards, count, "rewards"), float, "f")
        out.terminated = _as_list(_column(transition.terminated, count, "terminated"), bool, "b")
        out.truncated = _as_list(_column(transition.truncated, count, "truncated"), bool, "b")
        if transition.infos is not None:
            for index, info in zip(rows, _column(transition.infos, count, "infos"), strict=True):
                if info:
                    out.infos[index] = info
        observation = self._observed(transition.observation, "observation")
        if batch_form:
            out.batch_observation = observation.SerializeToString()
        else:
            out.observations = self._split(observation, count, "observation")
        marks = transition.reset if resets else None
        if marks is not None and any(_as_list(_column(marks, count, "reset"), bool, "b")):
            out.autoreset = _as_list(marks, bool, "b")
            ended = [index for index, mark in zip(rows, out.autoreset, strict=True) if mark]
            final = transition.final_observation
            if final is not None:
                final = self._observed(final, "final observation")
                if batch_form:
                    out.batch_final_observation = final.SerializeToString()
                else:
                    out.final_observations = self._split(final, len(ended), "final observation")
            if transition.final_infos is not None:
                infos = _column(transition.final_infos, len(ended), "final_infos")
                for index, info in zip(ended, infos, strict=True):
                    if info:
                        out.final_infos[index] = info
        for index, exc in failed.items():
            out.errors[index] = row_error(exc, "step" if resets else "reset")
        return out

    def _observed(self, observation: Any, what: str) -> Message:
        if not isinstance(observation, self._observation):
            raise BadTransition(wrong_type(what, observation, self._observation))
        return observation

    def _split(self, observation: Message, count: int, what: str) -> list[bytes]:
        parts = self._batch.split_observation(observation, count)
        if len(parts) != count:
            raise BadTransition(f"split_observation gave {len(parts)} {what}s for {count} rows")
        return [self._observed(part, what).SerializeToString() for part in parts]


def natively_batched(env_class: type[Any]) -> bool:
    """The env class overrides :meth:`Environment.make_batch`."""
    if not (isinstance(env_class, type) and issubclass(env_class, Environment)):
        return False
    made = getattr(env_class.make_batch, "__func__", None)
    return made is not getattr(Environment.make_batch, "__func__", None)


def build_batch(
    spec: EnvSpec, size: int, autoreset: AutoresetMode, native: bool = True, objects: bool = False
) -> VectorBatch:
    """The env's native batch when ``native`` and its ``make_batch`` returns one, else a
    loop over ``size`` instances from the factory (``objects``: see ``_Instances``).

    Raises:
        InvalidAction: ``make_batch`` refused (the open is refused with INVALID_ARGUMENT).
        TypeError: ``make_batch`` returned something else than a BatchEnvironment.
    """
    env_class = spec.env_class
    if not issubclass(env_class, Environment):
        return AsyncLoopBatch(spec, size, autoreset, objects)
    made = env_class.make_batch(size, autoreset) if native and natively_batched(env_class) else None
    if made is None:
        return LoopBatch(spec, size, autoreset, objects)
    if not isinstance(made, BatchEnvironment):
        raise TypeError(
            f"{env_class.__qualname__}.make_batch returned "
            f"{type(made).__qualname__}, not a BatchEnvironment"
        )
    return NativeBatch(made, spec)


def batch_spec(
    spec: EnvSpec,
    size: int,
    autoreset: AutoresetMode,
    placement: CallPlacement | None = None,
    *,
    native: bool = True,
    objects: bool = False,
) -> EnvSpec:
    """``spec`` whose factory builds one stream's batch, in the env's execution mode, so a
    runner runs each batch call as a whole where one env call would run; ``placement``
    measures the batch calls (None: they go to the pool)."""
    batch_class: Any = VectorBatch
    factory: Any = functools.partial(build_batch, spec, size, autoreset, native, objects)
    return dataclasses.replace(spec, factory=factory, env_class=batch_class, placement=placement)


def _called(call: Callable[..., Any], *columns: Sequence[Any]) -> Iterator[Any]:
    """``call`` on each row of ``columns``, as it is consumed: what it returned or raised."""
    for row in zip(*columns, strict=True):
        try:
            answer = call(*row)
        except BaseException as exc:
            answer = exc
        yield answer


def _states(
    name: str, indices: Sequence[int], answers: Iterable[Any], types: EnvironmentTypes
) -> BatchStates:
    """Each env's encoded answer to query ``name``, or its error."""
    out = BatchStates()
    for index, answer in zip(indices, answers, strict=True):
        try:
            out.states.append(QUERIES[name](_result(answer), types))
        except BaseException as exc:
            out.errors[index] = row_error(exc, name)
            continue
        out.rows.append(index)
    return out


def _restored(indices: Sequence[int], answers: Iterable[Any]) -> dict[int, RowError]:
    """The restores that failed."""
    errors: dict[int, RowError] = {}
    for index, answer in zip(indices, answers, strict=True):
        try:
            _result(answer)
        except BaseException as exc:
            errors[index] = row_error(exc, "restore")
    return errors


async def _gather(calls: Iterable[Awaitable[Any]]) -> list[Any]:
    """What each call returned or raised, in order (each in a task of its own, so env
    code's SystemExit is contained there)."""
    return await asyncio.gather(*map(contained, calls), return_exceptions=True)


def _result(answer: Any) -> Any:
    """A gathered answer's result; raises what the call raised."""
    if isinstance(answer, BaseException):
        raise answer
    return answer


def _reward(out: BatchOutcome, index: int, reward: float | None) -> float:
    """A None reward is 0 on the wire, its index noted in ``out.no_reward``."""
    if reward is None:
        out.no_reward.add(index)
        return 0.0
    return reward


def _column(values: Any, count: int, what: str) -> Sequence[Any]:
    if values is None or len(values) != count:
        got = "none" if values is None else len(values)
        raise BadTransition(f"batch returned {got} {what} for {count} rows")
    return cast(Sequence[Any], values)


def _as_list(values: Sequence[Any], kind: type, dtype_kind: str) -> list[Any]:
    """A column as a list of ``kind``: a numpy array of that kind converts in C."""
    dtype = getattr(values, "dtype", None)
    if dtype is not None and dtype.kind == dtype_kind and getattr(values, "ndim", 0) == 1:
        listed: list[Any] = values.tolist()  # type: ignore[attr-defined]
        return listed
    return list(map(kind, values))


def _closed(answers: Iterable[Any], *, reraise: bool = True) -> None:
    """Log each close's error (``answers``: what each returned or raised); then raise
    the first."""
    failed = [answer for answer in answers if isinstance(answer, BaseException)]
    for exc in failed:
        log.error("environment close() raised", exc_info=exc)
    if reraise and failed:
        raise failed[0]
