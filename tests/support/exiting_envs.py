"""Envs whose code raises what is no ``Exception``: ``SystemExit``, ``KeyboardInterrupt``
and a ``BaseException`` of its own, from ``step``, ``reset``, ``close`` or the factory.
Such an exception must fail that env's call (INTERNAL), never the server.

The action's message (or the reset seed) says what to raise: ``sysexit``, ``kbi`` or
``base`` (seeds 1, 2, 3); ``close:<kind>`` makes the env's ``close`` raise it; anything else
echoes. ``FACTORY_EXIT=<kind>`` in the server's environment makes every factory call
after the first raise it (so a server starts, and a fresh env cannot be made).
"""

from __future__ import annotations

import asyncio
import os

from google.protobuf.empty_pb2 import Empty

from openenv_grpc import AsyncEnvironment, Environment, Transition
from openenv_grpc_envs.echo import EchoAction, EchoObservation, EchoState
from support.envs import Ledger


class Custom(BaseException):
    """An env's own exception class that is no Exception."""


def _raise(kind: str) -> None:
    if kind == "sysexit":
        raise SystemExit(4)
    if kind == "kbi":
        raise KeyboardInterrupt("env code, not a signal")
    if kind == "base":
        raise Custom("an env's own BaseException")


_SEEDS = {1: "sysexit", 2: "kbi", 3: "base"}


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
