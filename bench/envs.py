"""Environments for the side-by-side benchmark (`bench.run`), served as ``module:factory``.

Both reuse the echo env's messages, so the typed ``AsyncEchoEnv`` client drives them:

* ``bench.envs:SleepEnvironment``: an ``AsyncEnvironment`` whose step awaits 1 s (the
  admission test: N sessions at once, each connect, reset, one sleeping step, close).
* ``bench.envs:CpuEnvironment``: a plain sync ``Environment`` whose step burns
  ``BENCH_CPU_LOOPS`` iterations of a pure-Python loop (~1 ms), written as users would:
  not ``runs_inline``, so the server runs it on its thread pool.
"""

from __future__ import annotations

import asyncio
import os

from openenv_grpc import AsyncEnvironment, Environment, Transition
from openenv_grpc_envs.echo import EchoAction, EchoObservation, EchoResetOptions, EchoState

__all__ = ["CpuEnvironment", "SleepEnvironment", "burn"]


def burn(loops: int) -> int:
    """Pure-Python CPU work; the same loop the bare and OpenEnv servers run."""
    x = 0
    for i in range(loops):
        x += i * i % 7
    return x


def _echo(action: EchoAction) -> Transition[EchoObservation]:
    message = action.message
    observation = EchoObservation(echoed_message=message, message_length=len(message))
    return Transition(observation, reward=0.1 * len(message))


class SleepEnvironment(AsyncEnvironment[EchoAction, EchoObservation, EchoState, EchoResetOptions]):
    """Each step takes 1 s of wall time without blocking the server."""

    name = "bench-sleep"

    async def reset(
        self, *, seed: int | None, episode_id: str, options: EchoResetOptions | None
    ) -> Transition[EchoObservation]:
        return Transition(EchoObservation(echoed_message="ready", message_length=5))

    async def step(self, action: EchoAction) -> Transition[EchoObservation]:
        await asyncio.sleep(1.0)
        return _echo(action)

    async def state(self) -> EchoState:
        return EchoState()


class CpuEnvironment(Environment[EchoAction, EchoObservation, EchoState, EchoResetOptions]):
    """Each step burns ~1 ms of CPU (``BENCH_CPU_LOOPS`` loop iterations)."""

    name = "bench-cpu"

    def __init__(self) -> None:
        self._loops = int(os.environ.get("BENCH_CPU_LOOPS", "20000"))

    def reset(
        self, *, seed: int | None, episode_id: str, options: EchoResetOptions | None
    ) -> Transition[EchoObservation]:
        return Transition(EchoObservation(echoed_message="ready", message_length=5))

    def step(self, action: EchoAction) -> Transition[EchoObservation]:
        burn(self._loops)
        return _echo(action)

    def state(self) -> EchoState:
        return EchoState()
