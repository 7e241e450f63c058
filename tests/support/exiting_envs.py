"""Envs whose code raises what is no ``Exception``: ``SystemExit``, ``KeyboardInterrupt``
and a ``BaseException`` of its own, from ``step``, ``reset``, ``close`` or the factory.
Such an exception must fail that env's call (INTERNAL), never the server.

The action's message (or the reset seed) says what to raise: ``sysexit``, ``kbi`` or
``base`` (seeds 1, 2, 3; seed 5 refuses the reset with InvalidAction); ``close:<kind>``
makes the env's ``close`` raise it; ``pid`` echoes the env's process id, ``exit`` ends
that process; anything else echoes. ``FACTORY_EXIT=<kind>`` in the server's environment
makes every factory call after the first raise it (so a server starts, and a fresh env
cannot be made).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from google.protobuf.empty_pb2 import Empty

from openenv_grpc import AsyncEnvironment, Environment, InvalidAction, Transition
from openenv_grpc_envs.echo import EchoAction, EchoObservation, EchoState
from support.envs import EchoBatch, Ledger


class Custom(BaseException):
    """An env's own exception class that is no Exception."""


def _raise(kind: str) -> None:
    if kind == "sysexit":
        raise SystemExit(4)
    if kind == "kbi":
        raise KeyboardInterrupt("env code, not a signal")
    if kind == "base":
        raise Custom("an env's own BaseException")
    if kind == "invalid":
        raise InvalidAction("refused on purpose")


_SEEDS = {1: "sysexit", 2: "kbi", 3: "base", 5: "invalid"}


class _Made:
    """Counts factory calls in this process (FACTORY_EXIT spares the first)."""

    count = 0


def _made() -> None:
    _Made.count += 1
    kind = os.environ.get("FACTORY_EXIT", "")
    if kind and _Made.count > 1:
        _raise(kind)


class InlineExitEnv(Environment[EchoAction, EchoObservation, EchoState, Empty]):
    """Runs on the event loop (inline)."""

    name = "exiting"
    runs_inline = True

    def __init__(self) -> None:
        _made()
        self._ledger = Ledger()
        self._close = ""

    def reset(
        self, *, seed: int | None, episode_id: str, options: Empty | None
    ) -> Transition[EchoObservation]:
        _raise(_SEEDS.get(seed or 0, ""))
        return Transition(EchoObservation(echoed_message="ready"))

    def step(self, action: EchoAction) -> Transition[EchoObservation]:
        message = action.message
        if message.startswith("close:"):
            self._close = message[6:]
        if message == "pid":
            return Transition(EchoObservation(echoed_message=str(os.getpid())))
        if message == "exit":
            os._exit(3)  # the env process dies (under --isolated)
        _raise(message)
        return Transition(EchoObservation(echoed_message=message))

    def state(self) -> EchoState:
        return EchoState()

    def close(self) -> None:
        self._ledger.closed()
        _raise(self._close)


class PooledExitEnv(InlineExitEnv):
    """Runs on the shared thread pool."""

    runs_inline = False


class AsyncExitEnv(AsyncEnvironment[EchoAction, EchoObservation, EchoState, Empty]):
    """An asyncio env: raises after yielding to the loop."""

    name = "exiting-async"

    def __init__(self) -> None:
        _made()
        self._ledger = Ledger()
        self._close = ""

    async def reset(
        self, *, seed: int | None, episode_id: str, options: Empty | None
    ) -> Transition[EchoObservation]:
        await asyncio.sleep(0)
        _raise(_SEEDS.get(seed or 0, ""))
        return Transition(EchoObservation(echoed_message="ready"))

    async def step(self, action: EchoAction) -> Transition[EchoObservation]:
        await asyncio.sleep(0)
        message = action.message
        if message.startswith("close:"):
            self._close = message[6:]
        _raise(message)
        return Transition(EchoObservation(echoed_message=message))

    async def state(self) -> EchoState:
        return EchoState()

    async def close(self) -> None:
        self._ledger.closed()
        await asyncio.sleep(0)
        _raise(self._close)


class ExitingBatchEnv(InlineExitEnv):
    """Pooled; a vector stream is one native batch (support.envs.EchoBatch) whose whole
    step raises the kind its batch action's message names (``sysexit``, ``kbi``, ``base``
    or ``genexit``)."""

    runs_inline = False

    @classmethod
    def make_batch(cls, size: int, autoreset: Any) -> Any:
        return _ExitingBatch(size, autoreset)


class _ExitingBatch(EchoBatch):
    def step(self, indices: Any, actions: Any) -> Any:
        kind = actions.message
        if kind == "genexit":
            raise GeneratorExit("an env's GeneratorExit")
        _raise(kind)
        return super().step(indices, actions)


class TaskExitEnv(AsyncExitEnv):
    """An asyncio env whose step ``task:<kind>`` starts a task of its own that raises
    ``kind`` a moment later, after the step has answered; ``thread:<kind>``, a task of
    ``asyncio.to_thread`` whose thread raises it (asyncio's own coroutine, env code's)."""

    async def step(self, action: EchoAction) -> Transition[EchoObservation]:
        message = action.message
        if message.startswith("thread:"):
            thread = asyncio.get_running_loop().create_task(asyncio.to_thread(_raise, message[7:]))
            _TASKS.add(thread)
            thread.add_done_callback(_TASKS.discard)
            return Transition(EchoObservation(echoed_message="spawned"))
        if message.startswith("task:"):
            kind = message[5:]

            async def later() -> None:
                await asyncio.sleep(0.05)
                _raise(kind)

            task = asyncio.get_running_loop().create_task(later())
            _TASKS.add(task)  # until it is done; then asyncio logs its exception
            task.add_done_callback(_TASKS.discard)
            return Transition(EchoObservation(echoed_message="spawned"))
        return await super().step(action)


#: The tasks TaskExitEnv started (kept so that they are not collected early).
_TASKS: set[asyncio.Task[None]] = set()


class CostClassExitEnv(InlineExitEnv):
    """Measured (``runs_inline`` unset): a step ``cost:<kind>`` makes the next
    ``cost_class()`` -- env code the server calls before each call -- raise ``kind``."""

    runs_inline = None
    _cost = ""

    def cost_class(self) -> str:
        kind, self._cost = self._cost, ""
        _raise(kind)
        return "one"

    def step(self, action: EchoAction) -> Transition[EchoObservation]:
        if action.message.startswith("cost:"):
            self._cost = action.message[5:]
            return Transition(EchoObservation(echoed_message="armed"))
        return super().step(action)


class HangingCloseAsyncEnv(AsyncExitEnv):
    """An asyncio env whose close awaits ``CLOSE_SECONDS`` (60) after a ``hang-close``
    step; a cancelled close records ``<ledger>.cancelled``. A ``hang-step`` step arms
    the same and awaits 60 s itself."""

    async def step(self, action: EchoAction) -> Transition[EchoObservation]:
        if action.message in ("hang-close", "hang-step"):
            self._hang = True
            if action.message == "hang-step":
                await asyncio.sleep(60)
            return Transition(EchoObservation(echoed_message="armed"))
        return await super().step(action)

    async def close(self) -> None:
        if getattr(self, "_hang", False):
            try:
                await asyncio.sleep(float(os.environ.get("CLOSE_SECONDS", "60")))
            except asyncio.CancelledError:
                _mark(os.environ.get("OPENENV_TEST_LEDGER", "") + ".cancelled")
                raise
        await super().close()


class ExitingReclaimEnv(PooledExitEnv):
    """``reclaim_orphans`` records each call in ``<ledger>.reclaims``, then raises
    SystemExit: the server must go on calling it after each env process dies."""

    @classmethod
    def reclaim_orphans(cls) -> None:
        root = os.environ.get("OPENENV_TEST_LEDGER", "")
        with open(f"{root}.reclaims", "a") as calls:
            calls.write(f"{os.getpid()}\n")
        raise SystemExit(5)


def _mark(path: str) -> None:
    """Leave a file at ``path`` (a test reads it)."""
    Path(path).touch()
