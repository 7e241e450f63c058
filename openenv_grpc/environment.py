"""The environment contract: the base classes environment builders subclass.

An environment is generic over four protobuf message types, declared once in its base
class::

    class EchoEnvironment(Environment[EchoAction, EchoObservation, EchoState, EchoResetOptions]):
        runs_inline = True  # every method returns in microseconds: always on the loop

        def reset(self, *, seed, episode_id, options): ...
        def step(self, action): ...
        def state(self): ...

The server reads those types at start-up (:func:`message_types`), checks them, advertises
them in the Info RPC, and decodes every action into the declared type before calling
``step``. An environment never sees the transport: it gets messages and returns messages.
Use ``google.protobuf.Empty`` for the reset options of an environment that takes none.

Optional, for envs that can: :meth:`Environment.snapshot` / :meth:`Environment.restore`
(branch an episode, resume it elsewhere), :meth:`Environment.make_batch` (answer a vector
stream's N envs natively, as a :class:`BatchEnvironment`, itself with an optional
:meth:`BatchEnvironment.snapshot` / :meth:`BatchEnvironment.restore` per index), and
:meth:`Environment.reclaim_orphans` (release what dead processes left behind).
"""

from __future__ import annotations

import enum
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from google.protobuf.message import Message

from openenv_grpc.v1.session_pb2 import Frame

__all__ = [
    "AsyncEnvironment",
    "AutoresetMode",
    "BatchEnvironment",
    "BatchTransition",
    "Environment",
    "EnvironmentTypes",
    "ImageArray",
    "InvalidAction",
    "Rendering",
    "Transition",
    "message_types",
]

ActionT = TypeVar("ActionT", bound=Message)
ObservationT = TypeVar("ObservationT", bound=Message)
StateT = TypeVar("StateT", bound=Message)
ResetOptionsT = TypeVar("ResetOptionsT", bound=Message)


class ImageArray(Protocol):
    """An image as an array: a numpy array of dtype uint8 and shape (height, width) or
    (height, width, channels), channels 1, 3 or 4 -- what Gymnasium's ``rgb_array``
    render mode returns."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> Any: ...

    def tobytes(self) -> bytes: ...


#: What :meth:`Environment.render` returns: text, an image array, or a ready Frame.
Rendering = str | ImageArray | Frame


@dataclass(slots=True)
class Transition(Generic[ObservationT]):
    """What ``reset`` and ``step`` return.

    Attributes:
        observation: The observation, of the environment's observation type.
        reward: The reward for the step that led here (0 after a reset); None: no reward
            for this step (as OpenEnv envs may answer). A Session's client then reads
            ``StepResult.no_reward`` set and reward 0; a vector stream's row reads 0 and
            its index is in ``VectorResult.no_reward``.
        terminated: The episode reached a terminal state of the task.
        truncated: The episode was cut short by a limit outside the task.
        info: Extra diagnostic data; JSON-like values (str, number, bool, None,
            lists, dicts). Sent to the client as-is.
    """

    observation: ObservationT
    reward: float | None = 0.0
    terminated: bool = False
    truncated: bool = False
    info: Mapping[str, Any] | None = None


class InvalidAction(Exception):
    """Raise from ``step`` (or ``reset``) when the request is well-typed but not allowed.

    The client gets an in-band ``INVALID_ARGUMENT`` error with this message and the
    episode goes on unchanged, so the environment must raise it before mutating state.
    Any other exception is reported as ``INTERNAL`` and the episode must be reset.
    """


class _EnvironmentBase(Generic[ActionT, ObservationT, StateT, ResetOptionsT]):
    """What sync and async environments share: identity and execution hints."""

    #: Name shown by the Info RPC; defaults to the class name.
    name: ClassVar[str] = ""
    #: Version shown by the Info RPC.
    version: ClassVar[str] = "0.0.0"
    #: One line shown by the Info RPC.
    description: ClassVar[str] = ""
    #: Seconds reset, step or state may take before the session gets DEADLINE_EXCEEDED and
    #: a fresh instance (None: no limit; the server's ``--step-timeout`` overrides it).
    step_timeout: ClassVar[float | None] = None
    #: False: an exception raised by ``step`` is an in-band INTERNAL error and the episode
    #: goes on (OpenEnv's rule); True: the episode is over and only a reset may follow.
    step_errors_end_episode: ClassVar[bool] = True
    #: The most sessions one server process may hold at once (None: the server's setting);
    #: the server's capacity is never above it.
    max_sessions: ClassVar[int | None] = None

    @classmethod
    def check_settings(cls) -> None:
        """Fail fast on a server this env cannot run in: called when the server starts,
        before it listens (and before any instance is made). An env configured
        from environment variables parses them here, so a bad value stops the server with
        its message instead of failing every session. Does nothing by default.

        Raises:
            ValueError: a setting is invalid (the server exits with its message, code 2).
        """

    @classmethod
    def reclaim_orphans(cls) -> None:
        """Release what instances of this class left behind in processes that died without
        closing them: called by the server once at start (leftovers of a previous run) and
        after an isolated worker process dies. Must be safe to call at any time from the
        server process; must not touch resources of live instances.

        Runs in a thread of its own and may block. Does nothing by default; what it raises
        is logged and otherwise ignored.
        """


class Environment(_EnvironmentBase[ActionT, ObservationT, StateT, ResetOptionsT]):
    """A synchronous environment; one instance serves exactly one session.

    The server creates an instance when a session opens (by calling the factory with no
    arguments) and calls :meth:`close` exactly once when the session ends. Calls on one
    instance never overlap. Where they run is :attr:`runs_inline`'s business: by default
    the server measures them, and runs them on its event loop while they are cheap and
    on a shared thread pool when they are not.
    """

    #: Where the server runs ``reset``, ``step``, ``state`` (and the other instance methods
    #: it calls during a session):
    #:
    #: - ``None`` (the default): **measured**. The server times the calls, grouped by
    #:   method and by :meth:`cost_class`, across all sessions. A group starts on the
    #:   thread pool; after 32 calls in a row that each took under half the server's
    #:   ``--inline-threshold-ms`` (1 ms by default) it runs on the event loop, which
    #:   saves a thread hop per call (for a microsecond step, most of the server's CPU
    #:   per step). A call on the loop cannot be interrupted, only timed once it returns:
    #:   a second call over the threshold within 64 calls, or one over 50 times it, sends
    #:   the group back to the pool (only the call's own time counts: it computed or
    #:   blocked; time the OS gave other processes does not), and each move back doubles
    #:   the run of cheap calls the next move needs, so an env near the threshold settles
    #:   on the pool. Every move is logged (INFO to the loop; WARNING back, with how long
    #:   the loop was blocked). A vector stream's batch calls of N envs are measured
    #:   apart, per N, against N times the threshold, at most the interpreter's switch
    #:   interval (5 ms): a pooled call that holds the GIL delays the loop that long anyway.
    #:   When a step timeout applies (the server's ``--step-timeout`` or
    #:   :attr:`step_timeout`), measured calls always run on the pool, where a call past
    #:   it can be given up on. The factory and :meth:`close` always run on the pool.
    #: - ``True``: always on the event loop, factory and ``close`` included. Fastest; for
    #:   envs whose every call returns in microseconds and never blocks. A slow or hung
    #:   call stalls every session (and health checks) for as long as it takes, and no
    #:   step timeout can interrupt it (``--isolated`` can: it kills the env's process).
    #: - ``False``: always on the thread pool. For envs whose calls block (I/O, a
    #:   subprocess, a sleep), may hang, or run native code that releases the GIL (the
    #:   pool then runs it beside the loop); the price is a thread hop per call.
    #:
    #: Override it when the measurement would be wrong or too late: ``False`` when even
    #: one blocking call on the loop is unacceptable (the first one is what moves a
    #: measured group back), ``True`` when every call is known to be cheap.
    runs_inline: ClassVar[bool | None] = None

    def cost_class(self) -> str:
        """Optional, for a measured env (``runs_inline = None``) whose cost depends on what
        an instance is configured to run: a short name for the current configuration's
        cost, e.g. the gymnasium env's env id (``"CartPole-v1"`` steps take a few
        microseconds, ``"ALE/Pong-v5"`` steps a few hundred). The server places and
        measures the calls of each (method, cost class) apart, so one slow class never
        moves the others off the event loop, and a new class starts on the pool.

        Called on the event loop before each ``reset``, ``step`` and ``state``; it must
        return at once (read an attribute) and should name few classes (the server
        measures up to 1024 groups; calls of groups beyond stay on the pool). The class
        is read before the call: a ``reset`` that switches configuration is measured in
        the old one's group. What it raises fails that call like an exception in it.

        Returns:
            The cost class; ``""`` (the default) puts every instance in one class.
        """
        return ""

    def reset(
        self, *, seed: int | None, episode_id: str, options: ResetOptionsT | None
    ) -> Transition[ObservationT]:
        """Start a new episode and return its first observation.

        Args:
            seed: Seed for the environment's random generators, or None if unseeded.
            episode_id: The id of the new episode (the client's, or one the server made).
            options: The client's reset options, or None when it sent none.

        Returns:
            The first transition; its reward is usually 0 and its flags False.

        Raises:
            InvalidAction: The options are not acceptable; the previous episode stands.
        """
        raise NotImplementedError

    def step(self, action: ActionT) -> Transition[ObservationT]:
        """Apply one action to the current episode.

        Only called after a successful ``reset`` and before the episode ends; the server
        answers out-of-order calls itself.

        Returns:
            The resulting transition.

        Raises:
            InvalidAction: The action is not allowed now; the episode is unchanged.
        """
        raise NotImplementedError

    def state(self) -> StateT:
        """Return the environment's current state (also valid before the first reset)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the instance holds. Called exactly once, even after errors."""

    def snapshot(self) -> bytes:
        """Optional: the current episode as bytes, from which :meth:`restore` on a fresh
        instance of this class (same ``name`` and ``version``, any server) continues
        exactly from here -- the env's RNGs included, so the same actions then give the
        same transitions.

        An env that overrides this (and :meth:`restore`) supports snapshots, and Info says
        so. The server adds the episode's bookkeeping (episode id, step count, phase),
        signs the whole with its key (HMAC) and hands it to the client; only bytes it has
        authenticated as its own ever reach :meth:`restore`. Put plain data in it
        (protobuf bytes, JSON, an engine's own serialization): never pickle, and nothing
        that is executed when read.

        Returns:
            The snapshot; at most the server's snapshot size limit.

        Raises:
            NotImplementedError: the default: this env cannot snapshot (the client gets
                UNIMPLEMENTED in-band and the session goes on). An env that can snapshot
                some configurations only raises it for the others, with the reason as its
                message (UNIMPLEMENTED, saying why).
            InvalidAction: a snapshot cannot be taken now (say why; INVALID_ARGUMENT).
        """
        raise NotImplementedError

    def restore(self, snapshot: bytes) -> None:
        """Optional: continue from ``snapshot``, bytes an earlier :meth:`snapshot` of this
        class and version returned (authenticated by the server before this is called).
        Also called on a fresh instance that has never been reset.

        Raises:
            InvalidAction: the bytes are not acceptable after all (INVALID_ARGUMENT; the
                previous episode, if any, stands).
        """
        raise NotImplementedError

    def render(self) -> Rendering:
        """Optional: a picture of the environment as it is now, for people and video
        recorders (the client's ``render()``; Gymnasium's ``rgb_array`` and ``ansi``
        render modes): an image array (uint8, height x width [x channels]) or text. It
        must change nothing in the episode.

        Raises:
            NotImplementedError: the default: this env does not render (UNIMPLEMENTED
                in-band, the session goes on); raise it with the reason when only some
                configurations render.
        """
        raise NotImplementedError(f"{type(self).__qualname__} does not render")

    @classmethod
    def make_batch(
        cls, size: int, autoreset: AutoresetMode
    ) -> BatchEnvironment[ActionT, ObservationT, StateT, ResetOptionsT] | None:
        """Optional: ``size`` instances of this env answered together, for a vector
        stream (``EnvService.VectorSession``), as a :class:`BatchEnvironment`.

        By default (None) the server makes ``size`` instances with the factory and loops
        over them, one payload per env; an env that can answer a whole batch natively
        (one action message and one observation message for all its envs, e.g. arrays
        stacked into one tensor, or a C++ batch simulator) returns a batch instead. Called
        where the env would be made (on the thread pool, or in an env process), and the
        batch's calls run where this env's calls run (inline, on the pool: one call per
        vector request either way). None for some sizes is fine: those streams get the
        loop. With ``--isolated`` the loop's instances are spread over the env processes,
        but a native batch is one unit and lives in one of them.

        Raises:
            InvalidAction: this batch cannot be made (e.g. ``size`` too large; the open is
                refused with INVALID_ARGUMENT).
        """
        return None


class AsyncEnvironment(_EnvironmentBase[ActionT, ObservationT, StateT, ResetOptionsT]):
    """An asyncio environment: the same contract as :class:`Environment`, with coroutines.

    Its methods run on the server's event loop and must not block it; await I/O instead.
    """

    async def reset(
        self, *, seed: int | None, episode_id: str, options: ResetOptionsT | None
    ) -> Transition[ObservationT]:
        """See :meth:`Environment.reset`."""
        raise NotImplementedError

    async def step(self, action: ActionT) -> Transition[ObservationT]:
        """See :meth:`Environment.step`."""
        raise NotImplementedError

    async def state(self) -> StateT:
        """See :meth:`Environment.state`."""
        raise NotImplementedError

    async def close(self) -> None:
        """See :meth:`Environment.close`."""

    async def snapshot(self) -> bytes:
        """See :meth:`Environment.snapshot`."""
        raise NotImplementedError

    async def restore(self, snapshot: bytes) -> None:
        """See :meth:`Environment.restore`."""
        raise NotImplementedError

    async def render(self) -> Rendering:
        """See :meth:`Environment.render`."""
        raise NotImplementedError(f"{type(self).__qualname__} does not render")


class AutoresetMode(enum.Enum):
    """How a vector stream starts a new episode in an env whose episode ended (the modes
    of Gymnasium 1.x's vector envs, same names and meaning)."""

    #: The step after the one that ended the episode resets that env instead (its action
    #: is ignored) and returns the first observation, reward 0 and both flags False.
    NEXT_STEP = "next_step"
    #: The step that ends an episode resets at once and returns the new first observation;
    #: the ended episode's last observation and info come as the final ones.
    SAME_STEP = "same_step"
    #: No autoreset: an ended env must be reset by the client before it steps again.
    DISABLED = "disabled"


@dataclass(slots=True)
class BatchTransition(Generic[ObservationT]):
    """What a :class:`BatchEnvironment` returns for the indices of one call.

    Rows are the call's indices, in order, minus those in ``errors``.

    Attributes:
        observation: One message of the observation type holding every row (its batch
            form, e.g. a tensor whose leading dimension is the number of rows).
        rewards, terminated, truncated: One per row.
        infos: One info map (or None) per row, or None when no row has one.
        reset: Per row, True when the row is the first observation of a new episode that
            autoreset started in this call (None: no row was).
        final_observation: With SAME_STEP: one message holding, for every row whose
            ``reset`` is True, the last observation of the episode that just ended, in row
            order (None: no episode ended).
        final_infos: With SAME_STEP: the info of each of those ended episodes' last step.
        errors: Indices whose env raised, and what it raised; they have no row. Raise
            :class:`InvalidAction` for a refused action (INVALID_ARGUMENT for that index,
            its episode unchanged); anything else is INTERNAL and breaks that episode.
    """

    observation: ObservationT
    rewards: Sequence[float]
    terminated: Sequence[bool]
    truncated: Sequence[bool]
    infos: Sequence[Mapping[str, Any] | None] | None = None
    reset: Sequence[bool] | None = None
    final_observation: ObservationT | None = None
    final_infos: Sequence[Mapping[str, Any] | None] | None = None
    errors: Mapping[int, Exception] | None = None


class BatchEnvironment(Generic[ActionT, ObservationT, StateT, ResetOptionsT]):
    """``size`` instances of one environment answered together (see
    :meth:`Environment.make_batch`); one instance serves exactly one vector stream.

    Env indices are ``0 .. size - 1``. Each call names the indices it is about, in
    increasing order, without repeats, and never overlaps another call. The server keeps
    the bookkeeping (episode ids, step counts, which envs may step); the batch keeps the
    envs and does the autoreset its ``autoreset`` mode asks for.
    """

    def __init__(self, size: int, autoreset: AutoresetMode) -> None:
        #: How many envs the batch holds.
        self.size = size
        #: What :meth:`step` does when an episode ends.
        self.autoreset = autoreset

    def reset(
        self,
        indices: Sequence[int],
        seeds: Sequence[int | None],
        options: Sequence[ResetOptionsT | None],
    ) -> BatchTransition[ObservationT]:
        """Start a new episode in each env of ``indices`` (one seed and options each).

        Raises:
            InvalidAction: the options are refused (every named env keeps its episode).
        """
        raise NotImplementedError

    def step(self, indices: Sequence[int], actions: ActionT) -> BatchTransition[ObservationT]:
        """Apply one action to each env of ``indices``: ``actions`` is one message of the
        action type in its batch form (a row per index, in order).

        With NEXT_STEP, an env whose episode ended at its previous step is reset instead
        and its row marked in ``reset``; with SAME_STEP, an env whose episode ends now is
        reset at once and its last observation goes to ``final_observation``; with
        DISABLED the server never steps an ended env.

        Raises:
            InvalidAction: ``actions`` does not fit (wrong shape; INVALID_ARGUMENT for the
                request, nothing stepped).
        """
        raise NotImplementedError

    def state(self, index: int) -> StateT:
        """The state of one env of the batch."""
        raise NotImplementedError

    def snapshot(self, index: int) -> bytes:
        """Optional: env ``index``'s episode as bytes, in the format of
        :meth:`Environment.snapshot` of this env class and version -- so that a snapshot
        taken here restores into a one-env session, and one taken there into this batch.
        Called only for an env with an episode (reset and not failed since); the server
        adds the bookkeeping and signs, as for one env.

        Raises:
            NotImplementedError: the default: this batch cannot capture one env (UNIMPLEMENTED
                for that index, with the message as the reason; the other indices answer).
            InvalidAction: a snapshot cannot be taken now (INVALID_ARGUMENT for that index).
        """
        raise NotImplementedError("this environment's native batch cannot snapshot one env")

    def restore(self, index: int, snapshot: bytes, *, ended: bool) -> None:
        """Optional: env ``index`` continues from ``snapshot`` (bytes of
        :meth:`Environment.snapshot` or :meth:`snapshot` of this class and version,
        authenticated by the server first). ``ended``: the captured episode had
        terminated or been truncated; with NEXT_STEP the next step of ``index`` must then
        reset it (as after a step that ended it), otherwise steps go on from the restored
        state. The env's step and return counters are the snapshot's.

        Raises:
            NotImplementedError: the default (UNIMPLEMENTED for that index, saying why).
            InvalidAction: the bytes are not acceptable after all, or do not fit this
                batch (e.g. another configuration than the one its envs run); the env's
                episode is unchanged (INVALID_ARGUMENT for that index).
        """
        raise NotImplementedError("this environment's native batch cannot restore one env")

    def computes_in_threads(self) -> bool:
        """Optional: True while this batch's calls wait only on compute threads of its own
        (a C++ pool's workers, as EnvPool's), never on I/O, sleep or other processes.
        Such a call blocks its thread on every step, so the server's measured placement
        judges a slow one by the process's CPU during it, not by the waits: on a loaded
        machine a call slowed by other processes then does not move the batch off the
        event loop. Read before each call; return at once. Default False.
        """
        return False

    def render(self, index: int) -> Rendering:
        """Optional: a picture of env ``index`` (see :meth:`Environment.render`).

        Raises:
            NotImplementedError: the default (UNIMPLEMENTED for that index, saying why).
        """
        raise NotImplementedError(f"{type(self).__qualname__} does not render")

    def join_actions(self, actions: Sequence[ActionT]) -> ActionT:
        """One batch-form action from one action per env (a client that sent one payload
        per env, e.g. in another language, is served through this).

        Raises:
            InvalidAction: an action does not fit.
        """
        raise NotImplementedError

    def split_observation(self, observation: ObservationT, rows: int) -> list[ObservationT]:
        """One observation per row from a batch-form observation (for such clients)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release every env of the batch. Called exactly once, even after errors."""


AnyEnvironment = Environment[Any, Any, Any, Any] | AsyncEnvironment[Any, Any, Any, Any]


@dataclass(frozen=True, slots=True)
class EnvironmentTypes:
    """The four message classes an environment class declared in its generic base."""

    action: type[Message]
    observation: type[Message]
    state: type[Message]
    reset_options: type[Message]


def message_types(env_class: type[Any]) -> EnvironmentTypes:
    """Read the message types ``env_class`` declared as ``Environment[A, O, S, R]``.

    Raises:
        TypeError: ``env_class`` is not an environment, or a declared type is not a
            concrete protobuf message class.
    """
    if not (isinstance(env_class, type) and issubclass(env_class, _EnvironmentBase)):
        raise TypeError(f"{env_class!r} is not a subclass of Environment or AsyncEnvironment")
    for klass in env_class.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            origin = typing.get_origin(base)
            if origin in (Environment, AsyncEnvironment):
                args = typing.get_args(base)
                for role, arg in zip(
                    ("action", "observation", "state", "reset options"), args, strict=True
                ):
                    if not (isinstance(arg, type) and issubclass(arg, Message)):
                        raise TypeError(
                            f"{env_class.__qualname__}: the {role} type must be a protobuf "
                            f"message class, got {arg!r}"
                        )
                return EnvironmentTypes(*args)
    raise TypeError(
        f"{env_class.__qualname__} does not declare its message types: subclass "
        "Environment[Action, Observation, State, ResetOptions]"
    )
