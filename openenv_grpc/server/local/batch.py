"""The envs of one stream, answered in one call: a loop over N plain instances, or the
env's own native batch (:meth:`Environment.make_batch`).

A stream's envs are one object, a :class:`VectorBatch`, with ``reset`` / ``step`` /
``query`` / ``restore`` / ``close`` over env indices; a reset or step returns a
:class:`BatchOutcome` (rows, observations already serialized, rewards, flags, infos,
autoreset marks, per-env errors, the rows whose env gave no reward). A Session's env is a
loop of one plain instance (never the native batch), autoreset disabled.
``calls.LocalBatchCalls`` runs each whole call where the env's execution mode says -- one
:class:`~openenv_grpc.server.local.runner.EnvRunner` holds the batch -- so inline envs are
stepped in one pass on the event loop, pooled ones in one thread hop for the whole batch
(not one per env), async ones gathered on the loop. In an env process (``--isolated``)
the same batch classes serve a block: a vector stream's sub-batch, or a Session's env.

The loop makes the autoresets of Gymnasium's vector envs that the driver decides (a
native batch does its own): each step carries them (:class:`Autoresets`). NEXT_STEP
resets the envs it names instead of stepping them (their episodes ended; their actions
ignored), SAME_STEP resets an env whose episode ends at this step at once and keeps the
last observation and info as the final ones. An autoreset starts the next episode
unseeded (the env's generators go on) with the episode id and the options the step
carries (the driver's: the options of the env's last reset by the client). The loop keeps
no autoreset state of its own.

An env's exception becomes an error for its index only (``InvalidAction``:
INVALID_ARGUMENT, the episode unchanged; anything else: INTERNAL); its neighbours answer.
That includes what is no ``Exception``: a ``SystemExit`` or ``KeyboardInterrupt`` raised
by env code is that env's failure, never the server's (a real Ctrl-C reaches the server
as a signal, see app.py), so the loops catch ``BaseException`` around env code.

Snapshots go per index too: ``query("snapshot", indices)`` returns each env's own bytes (the
driver seals them with the bookkeeping, as for one env), ``restore(indices, states,
ended)`` hands each env the bytes the driver authenticated; an env that cannot answers
UNIMPLEMENTED for its index (``NotImplementedError``, with its reason). Whether a restored
env whose episode had ended autoresets at its next step is the driver's (its phase).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
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
    """What one reset or step of a batch returned. Rows are env indices in call order,
    those in ``errors`` left out. Observations travel serialized (their type is the env's
    observation type), either one per row or as one batch-form message."""

    rows: list[int] = field(default_factory=list)
    observations: list[bytes] = field(default_factory=list)
    batch_observation: bytes | None = None
    rewards: list[float] = field(default_factory=list)
    #: Env indices of the rows whose env gave no reward (a transition's reward None, as an
    #: OpenEnv env may answer): their reward above is 0. A Session says so in
    #: ``StepResult.no_reward``, a vector stream in ``VectorResult.no_reward``.
    no_reward: set[int] = field(default_factory=set)
    terminated: list[bool] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    #: Env index -> info (a mapping, or a ``Struct`` already), for rows that have one.
    infos: dict[int, Any] = field(default_factory=dict)
    #: None: no row was autoreset; else one mark per row.
    autoreset: list[bool] | None = None
    #: Env index -> the episode id the batch gave an episode it autoreset (a loop knows
    #: them; for a native batch the caller makes them).
    new_episode_ids: dict[int, str] = field(default_factory=dict)
    #: SAME_STEP: the ended episodes' last observations, one per autoreset row, in order.
    final_observations: list[bytes] = field(default_factory=list)
    batch_final_observation: bytes | None = None
    #: SAME_STEP: env index -> the ended episode's last info (mapping or ``Struct``).
    final_infos: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, RowError] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Autoresets:
    """The autoresets one step of a loop batch makes, as the driver decided them (a native
    batch makes its own and ignores these).

    NEXT_STEP: the envs of ``episode_ids`` ended their episodes, so this step resets them
    instead of stepping them (their actions ignored). SAME_STEP: every env stepped has an
    id in ``episode_ids``, which its next episode takes should its episode end at this
    step. An autoreset uses the env's ``options`` (those of its last reset by the client;
    absent: none).
    """

    #: Env index -> the id of the episode its autoreset starts.
    episode_ids: Mapping[int, str] = field(default_factory=dict)
    #: Env index -> its autoreset's options (decoded), where it has some.
    options: Mapping[int, Message] = field(default_factory=dict)
    #: The same options as they came on the wire (what an env process is sent).
    wire_options: Mapping[int, Any] = field(default_factory=dict)


#: A step that autoresets nothing.
NO_AUTORESETS = Autoresets()


class VectorBatch:
    """The envs of one vector stream (the session calls its methods through one runner).

    ``reset(indices, seeds, episode_ids, options, batch_form)`` and ``step(indices,
    actions, batch_form, autoresets)`` return a :class:`BatchOutcome`; ``query(name,
    indices)`` (a per-env query, ``queries.py``) a :class:`BatchStates`; ``restore(indices,
    states, ended)`` the per-index errors (every other index was restored); ``close()``
    closes every env.
    Methods are coroutines in :class:`AsyncLoopBatch`. Raising (rather than answering per
    index) means the whole call failed: ``InvalidAction`` refuses it, anything else breaks
    every named env.
    """

    #: The envs answer in a native batch form (batch_action, batch_observation).
    native: ClassVar[bool] = False

    def __init__(self, size: int, autoreset: AutoresetMode) -> None:
        self.size = size
        self.autoreset = autoreset

    def cost_class(self) -> str:
        """What a measured env's placement groups this batch's calls by (see
        :meth:`Environment.cost_class`): "" unless the batch knows better."""
        return ""

    def computes_in_threads(self) -> bool:
        """Its calls wait only on compute threads of its own (see
        :meth:`BatchEnvironment.computes_in_threads`)."""
        return False


class _Instances(VectorBatch):
    """N plain instances of one env class."""

    def __init__(self, spec: EnvSpec, size: int, autoreset: AutoresetMode) -> None:
        super().__init__(size, autoreset)
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
            _close_all(envs)
            raise
        self._envs = envs
        self._observation = spec.types.observation
        self._types = spec.types
        self._same_step = autoreset is AutoresetMode.SAME_STEP
        self._next_step = autoreset is AutoresetMode.NEXT_STEP
        #: A loop of one (a Session's env) is measured as that env: its own cost class.
        own = getattr(type(envs[0]), "cost_class", Environment.cost_class)
        one = size == 1 and own is not Environment.cost_class
        self._cost_class: Any = envs[0].cost_class if one else None

    def cost_class(self) -> str:
        return "" if self._cost_class is None else str(self._cost_class())

    def _checked(self, transition: Any) -> Transition[Any]:
        if not isinstance(transition, Transition):
            raise BadTransition(
                f"environment returned a {type(transition).__qualname__}, not a Transition"
            )
        if not isinstance(transition.observation, self._observation):
            raise BadTransition(
                wrong_type("observation", transition.observation, self._observation)
            )
        return transition

    def _add(
        self, out: BatchOutcome, index: int, transition: Transition[Any], *, auto: bool = False
    ) -> None:
        """One row from a checked transition."""
        out.rows.append(index)
        out.observations.append(transition.observation.SerializeToString())
        out.rewards.append(_reward(out, index, transition.reward))
        out.terminated.append(transition.terminated)
        out.truncated.append(transition.truncated)
        if transition.info:
            out.infos[index] = transition.info
        marks = out.autoreset
        if auto:
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
        self._add(out, index, first, auto=True)
        out.no_reward.discard(index)  # the row's reward is the ended step's, not the reset's
        out.rewards[-1] = _reward(out, index, ended.reward)
        out.terminated[-1] = ended.terminated
        out.truncated[-1] = ended.truncated
        out.final_observations.append(ended.observation.SerializeToString())
        if ended.info:
            out.final_infos[index] = ended.info
        out.new_episode_ids[index] = episode_id

    def _restart(self, index: int, autoresets: Autoresets) -> tuple[Any, str]:
        """Autoreset env ``index``: start its next episode unseeded, with the id and the
        options ``autoresets`` give it (a fresh id if none). Returns what its ``reset``
        returned (a coroutine, for an asyncio env) and the id. The one place an autoreset
        is made."""
        episode_id = autoresets.episode_ids.get(index) or new_episode_id()
        options = autoresets.options.get(index)
        first = self._envs[index].reset(seed=None, episode_id=episode_id, options=options)
        return first, episode_id

    def _restarts(self, autoresets: Autoresets) -> Mapping[int, str]:
        """The envs this step resets instead of stepping (NEXT_STEP's), by index."""
        return autoresets.episode_ids if self._next_step else {}

    def _reset_row(self, out: BatchOutcome, index: int, answer: Any) -> None:
        """One env's part of a reset: its row, or its error (``answer`` is what its reset
        returned or raised)."""
        try:
            first = self._checked(_result(answer))
        except BaseException as exc:
            out.errors[index] = row_error(exc, "reset")
            return
        self._add(out, index, first)


class LoopBatch(_Instances):
    """N instances of a sync env, called one after the other in one call."""

    def reset(
        self,
        indices: Sequence[int],
        seeds: Sequence[int | None],
        episode_ids: Sequence[str],
        options: Sequence[Message | None],
        batch_form: bool = False,
    ) -> BatchOutcome:
        out = BatchOutcome()
        envs = self._envs
        for index, seed, episode_id, option in zip(
            indices, seeds, episode_ids, options, strict=True
        ):
            try:
                first: Any = envs[index].reset(seed=seed, episode_id=episode_id, options=option)
            except BaseException as exc:
                first = exc
            self._reset_row(out, index, first)
        return out

    def step(
        self,
        indices: Sequence[int],
        actions: Sequence[Message],
        batch_form: bool = False,
        autoresets: Autoresets = NO_AUTORESETS,
    ) -> BatchOutcome:
        out = BatchOutcome()
        envs, restarts = self._envs, self._restarts(autoresets)
        add, checked, same_step = self._add, self._checked, self._same_step
        # The common row (a step that does not end its episode, no autoreset yet in this
        # call) is written here, without a call per row: it is most of a vector step.
        rows, observations = out.rows.append, out.observations.append
        rewards, terminated, truncated = (
            out.rewards.append, out.terminated.append, out.truncated.append,
        )  # fmt: skip
        observation_class = self._observation
        for index, action in zip(indices, actions, strict=True):
            env = envs[index]
            try:
                if index in restarts:  # NEXT_STEP: this step starts the next episode
                    first, episode_id = self._restart(index, autoresets)
                    add(out, index, checked(first), auto=True)
                    out.new_episode_ids[index] = episode_id
                    continue
                transition = env.step(action)
                if (
                    type(transition) is not Transition
                    or type(transition.observation) is not observation_class
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
            observations(transition.observation.SerializeToString())
            reward = transition.reward
            if reward is None:
                reward = _reward(out, index, reward)
            rewards(reward)
            terminated(False)
            truncated(False)
        return out

    def query(self, name: str, indices: Sequence[int]) -> BatchStates:
        envs = self._envs
        return _queried(name, indices, lambda index: getattr(envs[index], name)(), self._types)

    def restore(
        self, indices: Sequence[int], states: Sequence[bytes], ended: Sequence[bool]
    ) -> dict[int, RowError]:
        envs = self._envs

        def put(index: int, state: bytes, over: bool) -> None:
            envs[index].restore(state)

        return _restores(indices, states, ended, put)

    def close(self) -> None:
        """Close every env (each once, whatever the others do).

        Raises:
            Exception: the first exception an env's close raised, after all were closed.
        """
        _close_all(self._envs, reraise=True)


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
        envs = self._envs
        calls = [
            envs[index].reset(seed=seed, episode_id=episode_id, options=option)
            for index, seed, episode_id, option in zip(
                indices, seeds, episode_ids, options, strict=True
            )
        ]
        answers = await _gather(calls)
        out = BatchOutcome()
        for index, answer in zip(indices, answers, strict=True):
            self._reset_row(out, index, answer)
        return out

    async def step(
        self,
        indices: Sequence[int],
        actions: Sequence[Message],
        batch_form: bool = False,
        autoresets: Autoresets = NO_AUTORESETS,
    ) -> BatchOutcome:
        restarts = self._restarts(autoresets)
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
            else:
                self._add(out, index, transition, auto=kind == "next_step")
                if kind == "next_step":
                    out.new_episode_ids[index] = episode_id
        return out

    async def _one_step(
        self, index: int, action: Message, restart: bool, autoresets: Autoresets
    ) -> tuple[str, Transition[Any], Any, str]:
        """One env's part of a step (``restart``: NEXT_STEP resets it instead): (what
        happened, the transition, the first transition of a SAME_STEP autoreset, the new
        episode's id)."""
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
        out = BatchStates()
        for index, answer in zip(indices, answers, strict=True):
            _query_row(out, name, index, answer, self._types)
        return out

    async def restore(
        self, indices: Sequence[int], states: Sequence[bytes], ended: Sequence[bool]
    ) -> dict[int, RowError]:
        envs = self._envs
        answers = await _gather(
            envs[index].restore(state) for index, state in zip(indices, states, strict=True)
        )
        errors: dict[int, RowError] = {}
        for index, answer in zip(indices, answers, strict=True):
            try:
                _result(answer)
            except BaseException as exc:
                errors[index] = row_error(exc, "restore")
        return errors

    async def close(self) -> None:
        """Close every env (each once), all at once: one close that hangs holds back no
        other (a timeout cancels only the ones still closing); see :meth:`LoopBatch.close`.
        """
        answers = await _gather(env.close() for env in self._envs)
        failed = [answer for answer in answers if isinstance(answer, BaseException)]
        for exc in failed:
            log.error("environment close() raised", exc_info=exc)
        if failed:
            raise failed[0]


class NativeBatch(VectorBatch):
    """An env's own :class:`BatchEnvironment`, checked and put in the wire's shape.

    Per-env clients are served too: their actions are joined into the batch form
    (``join_actions``) and the batch observation split per row (``split_observation``).
    """

    native = True

    def __init__(self, batch: BatchEnvironment[Any, Any, Any, Any], spec: EnvSpec) -> None:
        super().__init__(batch.size, batch.autoreset)
        self._batch = batch
        self._cost_class: Any = getattr(batch, "cost_class", None)
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
        """A step of the native batch (its autoresets are its own: ``autoresets`` is
        ignored)."""
        batch = self._batch
        action = actions if batch_form else batch.join_actions(actions)
        return self._outcome(indices, batch.step(indices, action), batch_form, resets=True)

    def query(self, name: str, indices: Sequence[int]) -> BatchStates:
        return _queried(name, indices, getattr(self._batch, name), self._types)

    def restore(
        self, indices: Sequence[int], states: Sequence[bytes], ended: Sequence[bool]
    ) -> dict[int, RowError]:
        batch = self._batch

        def put(index: int, state: bytes, over: bool) -> None:
            batch.restore(index, state, ended=over)

        return _restores(indices, states, ended, put)

    def close(self) -> None:
        self._batch.close()

    def cost_class(self) -> str:
        return "" if self._cost_class is None else str(self._cost_class())

    def computes_in_threads(self) -> bool:
        return bool(self._batch.computes_in_threads())

    def _outcome(
        self, indices: Sequence[int], transition: Any, batch_form: bool, *, resets: bool
    ) -> BatchOutcome:
        """The wire's rows from a native :class:`BatchTransition`.

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
    """The env class overrides :meth:`Environment.make_batch` (it may answer a vector
    stream as one native batch)."""
    if not (isinstance(env_class, type) and issubclass(env_class, Environment)):
        return False
    made = getattr(env_class.make_batch, "__func__", None)
    return made is not getattr(Environment.make_batch, "__func__", None)


def build_batch(
    spec: EnvSpec, size: int, autoreset: AutoresetMode, native: bool = True
) -> VectorBatch:
    """The batch of one stream: the env's native batch when ``native`` and its
    ``make_batch`` returns one, else a loop over ``size`` instances from the factory (a
    Session's one env is a loop of one: its env is the plain instance).

    Raises:
        InvalidAction: ``make_batch`` refused (the open is refused with INVALID_ARGUMENT).
        Exception: what the factory or ``make_batch`` raised.
        TypeError: ``make_batch`` returned something else than a BatchEnvironment.
    """
    env_class = spec.env_class
    if issubclass(env_class, Environment):
        made = (
            env_class.make_batch(size, autoreset)
            if native and natively_batched(env_class)
            else None
        )
        if made is not None:
            if not isinstance(made, BatchEnvironment):
                raise TypeError(
                    f"{env_class.__qualname__}.make_batch returned "
                    f"{type(made).__qualname__}, not a BatchEnvironment"
                )
            return NativeBatch(made, spec)
        return LoopBatch(spec, size, autoreset)
    return AsyncLoopBatch(spec, size, autoreset)


def batch_spec(
    spec: EnvSpec,
    size: int,
    autoreset: AutoresetMode,
    placement: CallPlacement | None = None,
    *,
    native: bool = True,
) -> EnvSpec:
    """``spec`` for one vector stream's batch: its factory builds the batch
    (:func:`build_batch`), and its execution mode is the env's, so an
    :class:`~openenv_grpc.server.local.runner.EnvRunner` runs each batch call as a whole where
    one env call would run. A measured env's batch calls are measured by ``placement``
    (their own: a batch call costs N env calls; None puts them on the pool)."""
    # EnvRunner calls whatever object the factory makes; a batch is one such object.
    batch_class: Any = VectorBatch
    factory: Any = functools.partial(build_batch, spec, size, autoreset, native)
    return dataclasses.replace(spec, factory=factory, env_class=batch_class, placement=placement)


def _queried(
    name: str, indices: Sequence[int], ask: Callable[[int], Any], types: EnvironmentTypes
) -> BatchStates:
    """``ask(index)`` (one env's answer to query ``name``) for each index, in turn."""
    out = BatchStates()
    for index in indices:
        try:
            answer: Any = ask(index)
        except BaseException as exc:
            answer = exc
        _query_row(out, name, index, answer, types)
    return out


def _restores(
    indices: Sequence[int],
    states: Sequence[bytes],
    ended: Sequence[bool],
    put: Callable[[int, bytes, bool], None],
) -> dict[int, RowError]:
    """``put(index, state, ended)`` (one env's restore) for each index; the failures."""
    errors: dict[int, RowError] = {}
    for index, state, over in zip(indices, states, ended, strict=True):
        try:
            put(index, state, over)
        except BaseException as exc:
            errors[index] = row_error(exc, "restore")
    return errors


def _query_row(
    out: BatchStates, name: str, index: int, answer: Any, types: EnvironmentTypes
) -> None:
    """One env's encoded answer, or its error (``answer``: what it returned or raised)."""
    try:
        out.states.append(QUERIES[name].encode(_result(answer), types))
    except BaseException as exc:
        out.errors[index] = row_error(exc, name)
        return
    out.rows.append(index)


async def _gather(calls: Iterable[Awaitable[Any]]) -> list[Any]:
    """Each env's call awaited at once: what each returned or raised, in order (each in a
    task of its own, so env code's SystemExit is contained there: ``errors.contained``)."""
    return await asyncio.gather(*map(contained, calls), return_exceptions=True)


def _result(answer: Any) -> Any:
    """A gathered answer: raises what the call raised (a cancellation goes on up: it is
    no Exception), else returns its result."""
    if isinstance(answer, BaseException):
        raise answer
    return answer


def _reward(out: BatchOutcome, index: int, reward: float | None) -> float:
    """Row ``index``'s reward as the wire holds it: a None (no reward) is 0, its index
    noted in ``out.no_reward``."""
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
    """A native batch's column as a list of ``kind`` (float or bool): a numpy array of
    that kind converts in C (``tolist``), ten times faster than a call per row."""
    dtype = getattr(values, "dtype", None)
    if dtype is not None and dtype.kind == dtype_kind and getattr(values, "ndim", 0) == 1:
        listed: list[Any] = values.tolist()  # type: ignore[attr-defined]
        return listed
    # map(): the same conversion as a comprehension, without a Python frame per row.
    return list(map(kind, values))


def _close_all(envs: Sequence[Any], *, reraise: bool = False) -> None:
    first: BaseException | None = None
    for env in envs:
        try:
            env.close()
        except BaseException as exc:
            log.exception("environment close() raised")
            first = first or exc
    if reraise and first is not None:
        raise first
