"""``SessionEnvironment``: one TRL environment instance = one session on a served env.

TRL's ``environment_factory`` contract: the factory is called with no arguments; the
instance's ``reset(**row)`` starts an episode and returns text for the prompt; every
other public method is a tool the model may call; ``get_reward()`` is read once per
finished rollout. TRL pools instances, resets them for every batch and never closes
them. So this class:

- opens its session lazily (on the first reset) and reopens it when it was lost while
  the instance sat in TRL's pool (``reconnect``): the server's idle timeout may end a
  session between batches, and the next reset simply gets a fresh one;
- keeps a session alive *during* an episode with a ``state()`` call after ``keepalive``
  seconds without traffic, so a long generation between two turns does not let the
  server's idle timeout (``IDLE_TIMEOUT``, 600 s by default) end the game;
- closes its session when TRL drops the instance (a :func:`weakref.finalize`, also run
  at interpreter exit), or when the factory is closed;
- turns in-band refusals (an invalid guess: ``INVALID_ARGUMENT``) into text the model
  can read, and the episode goes on.

Tools are coroutines (``async def``): TRL runs them on its own event loop and they hop to
the runtime's loop, where the session lives. Subclasses define the tools and may render
observations differently (:meth:`_reset_text`, :meth:`_step_text`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import typing
import weakref
from collections.abc import Mapping
from typing import Any, ClassVar

import grpc
from google.protobuf.message import Message

from openenv_grpc import AsyncSession, EnvError, OpenRetry, SessionLost, StepResult
from openenv_grpc.integrations.json_view import from_json, to_json
from openenv_grpc.integrations.trl.runtime import Runtime

__all__ = ["SessionEnvironment"]

AnySession = AsyncSession[Any, Any, Any, Any]


class _Episode:
    """The session of one instance and its episode's bookkeeping; lives on the runtime's
    loop (the finalizer holds it, never the instance)."""

    def __init__(self, session: AnySession, keepalive: float | None) -> None:
        self.session = session
        self.keepalive = keepalive
        self.opened = False
        self.closed = False
        self.reward = 0.0
        self.done = False
        self.last_call = time.monotonic()
        self._lock: asyncio.Lock | None = None
        self._pinger: asyncio.Task[None] | None = None

    @property
    def lock(self) -> asyncio.Lock:
        if self._lock is None:  # made on the runtime's loop, where it is used
            self._lock = asyncio.Lock()
        return self._lock

    async def reset(self, seed: int | None, options: Message | None) -> StepResult[Any]:
        async with self.lock:
            if self.closed:
                raise RuntimeError("this environment was closed")
            if not self.opened:
                await self.session.open()
                self.opened = True
            try:
                result = await self.session.reset(seed=seed, options=options)
            except SessionLost:  # lost while pooled (idle timeout, restart): reconnect once
                result = await self.session.reset(seed=seed, options=options)
            self.reward, self.done = 0.0, result.done
            self.last_call = time.monotonic()
        if self.keepalive and self._pinger is None:
            self._pinger = asyncio.create_task(self._ping())
        return result

    async def step(self, action: Message) -> StepResult[Any]:
        """Raises EnvError (in-band refusal) and SessionLost (the episode is gone)."""
        async with self.lock:
            try:
                result = await self.session.step(action)
            except SessionLost:
                self.done = True
                raise
            finally:
                self.last_call = time.monotonic()
            self.reward += result.reward
            self.done = result.done
            return result

    async def _ping(self) -> None:
        """While an episode runs, call ``state()`` after ``keepalive`` idle seconds."""
        assert self.keepalive
        while not self.closed:
            await asyncio.sleep(max(0.0, self.last_call + self.keepalive - time.monotonic()))
            if self.closed or self.done or time.monotonic() - self.last_call < self.keepalive:
                continue
            async with self.lock:
                with contextlib.suppress(EnvError, SessionLost):  # the next tool call reports it
                    await self.session.state()
                self.last_call = time.monotonic()

    async def close(self) -> None:
        self.closed = True
        if self._pinger is not None:
            self._pinger.cancel()
        async with self.lock:
            if self.opened:
                try:
                    await self.session.close()
                except Exception:  # closing all the same: cancel the stream
                    await self.session.abort()


def _close(runtime: Runtime, episode: _Episode) -> None:
    """The finalizer: close the session on the runtime's loop (bounded wait)."""
    # At exit the loop may already be gone; the stream then ends with the process.
    if runtime.alive:
        with contextlib.suppress(Exception):
            runtime.run(episode.close(), timeout=10.0)


class SessionEnvironment:
    """Base class of TRL environments backed by one openenv-grpc session.

    Not used directly: :func:`~openenv_grpc.integrations.trl.environment_factory` makes a
    subclass bound to a server (``_runtime``) and a session class, with the env's tools.
    Only ``reset``, ``get_reward`` and the tools are public: TRL turns every other public
    method into a tool.
    """

    _runtime: ClassVar[Runtime]
    _session_class: ClassVar[type[AnySession]]
    _reset_options_class: ClassVar[type[Message] | None] = None
    _keepalive: ClassVar[float | None] = 120.0
    _retry: ClassVar[OpenRetry | None] = None
    _token: ClassVar[str | None] = None
    _call_timeout: ClassVar[float | None] = 300.0
    _instances: ClassVar[weakref.WeakSet[SessionEnvironment]]

    def __init__(self) -> None:
        session = self._session_class(
            self._runtime.channel, retry=self._retry, token=self._token, reconnect=True
        )
        self._episode = _Episode(session, self._keepalive)
        self._finalizer = weakref.finalize(self, _close, self._runtime, self._episode)
        self._instances.add(self)

    # -- TRL's contract -------------------------------------------------------------

    def reset(self, **row: Any) -> str | None:
        """Start a new episode on the server; returns its first observation as text.

        ``row`` is the dataset row: its ``seed`` (an int) seeds the env, so the G
        rollouts of one prompt play the same game; its ``options`` (a dict or a JSON
        string) become the env's reset options. Other columns are ignored.

        Raises:
            CapacityError, SessionRefused: the session could not be opened.
            ValueError: the options name a field the env's options lack, or a value
                does not fit (the message names the field).
            EnvError: the server refused the options.
        """
        seed = row.get("seed")
        options = self._options(row.get("options"))
        result = self._runtime.run(
            self._episode.reset(None if seed is None else int(seed), options),
            self._call_timeout,
        )
        return self._reset_text(result)

    def get_reward(self) -> float:
        """The sum of the rewards of this episode's steps (TRL reads it once per rollout)."""
        return self._episode.reward

    # -- for tools ------------------------------------------------------------------

    async def _act(self, action: Message) -> str:
        """Step the episode with ``action`` and describe what happened, as text.

        Never raises for what the model did: a refused action, a finished episode or a
        lost session come back as text the model can read.
        """
        if self._episode.done:
            return "The episode is over: no more actions are accepted."
        try:
            result = await self._runtime.run_async(self._episode.step(action))
        except EnvError as exc:
            if exc.code is grpc.StatusCode.INVALID_ARGUMENT:
                return f"Refused: {exc.message}. Nothing changed; try again."
            self._episode.done = True
            return f"The environment failed ({exc.code.name}: {exc.message}); the episode is over."
        except SessionLost as exc:
            return f"The environment session was lost ({exc.message}); the episode is over."
        return self._step_text(result)

    # -- rendering (override per env) -------------------------------------------------

    def _reset_text(self, result: StepResult[Any]) -> str | None:
        return _describe(result.observation)

    def _step_text(self, result: StepResult[Any]) -> str:
        text = _describe(result.observation)
        if result.done:
            text += "\nThe episode is over."
        return text

    def _options(self, raw: Any) -> Message | None:
        if raw is None or self._reset_options_class is None:
            return None
        if isinstance(raw, str):
            raw = json.loads(raw) if raw.strip() else {}
        if isinstance(raw, Message):
            return raw
        if not isinstance(raw, Mapping):
            raise TypeError(f"the row's options must be a dict or JSON text, got {raw!r}")
        # Arrow fills absent struct fields with None: from_json leaves those unset.
        return from_json(raw, self._reset_options_class, "options")


def _describe(message: Message) -> str:
    """A message as the JSON object of its fields (ints as ints, a bridged OpenEnv env's
    JSON fields as their values): what OpenEnv's own JSON shows, and what a model reads
    best. Never protobuf's text format."""
    return json.dumps(to_json(message), ensure_ascii=False)


def message_types(session_class: type[Any]) -> tuple[type[Message], ...]:
    """The (action, observation, state, reset options) classes a typed client declared in
    its generic base (``WordleEnv(Session[A, O, S, R])``).

    Raises:
        TypeError: ``session_class`` declares no message types.
    """
    for klass in session_class.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if len(args) == 4 and all(isinstance(a, type) and issubclass(a, Message) for a in args):
                return args
    raise TypeError(
        f"{session_class!r} is not a typed client: pass a class like WordleEnv, declared as "
        "Session[Action, Observation, State, ResetOptions]"
    )
