"""Envs whose observations say the episode id and the options their last reset got, so a
test sees which autoresets the driver decided and what it sent down with them
(``tests/test_driver_autoresets.py``)."""

from __future__ import annotations

import asyncio
import json

from openenv_grpc import AsyncEnvironment, Environment, Transition
from openenv_grpc_envs.echo import EchoAction, EchoObservation, EchoResetOptions, EchoState


class _Episode:
    """One env's episode: its id, its reset's ``max_steps`` (0: none), its steps; a reset
    whose ``stop_word`` is ``at-reset`` ends the episode it starts."""

    def __init__(self) -> None:
        self.episode_id = ""
        self.max_steps = 0
        self.steps = 0

    def reset(
        self, episode_id: str, options: EchoResetOptions | None
    ) -> Transition[EchoObservation]:
        self.episode_id = episode_id
        self.max_steps = (options or EchoResetOptions()).max_steps
        self.steps = 0
        # stop_word "at-reset": the episode ends as it begins
        ends = (options or EchoResetOptions()).stop_word == "at-reset"
        observation = EchoObservation(echoed_message=f"reset {episode_id} {self.max_steps}")
        return Transition(observation, truncated=ends)

    def step(self, action: EchoAction) -> Transition[EchoObservation]:
        self.steps += 1
        ended = bool(self.max_steps) and self.steps >= self.max_steps
        message = f"step {self.episode_id} {action.message}"
        return Transition(EchoObservation(echoed_message=message), truncated=ended)

    def snapshot(self) -> bytes:
        return json.dumps([self.episode_id, self.max_steps, self.steps]).encode()

    def restore(self, data: bytes) -> None:
        self.episode_id, self.max_steps, self.steps = json.loads(data)


class IdEchoEnv(Environment[EchoAction, EchoObservation, EchoState, EchoResetOptions]):
    """Observations: ``reset <episode id> <max_steps>``, ``step <episode id> <message>``."""

    name = "id-echo"
    version = "1.0.0"
    runs_inline = True

    def __init__(self) -> None:
        self._episode = _Episode()

    def reset(
        self, *, seed: int | None, episode_id: str, options: EchoResetOptions | None
    ) -> Transition[EchoObservation]:
        return self._episode.reset(episode_id, options)

    def step(self, action: EchoAction) -> Transition[EchoObservation]:
        return self._episode.step(action)

    def state(self) -> EchoState:
        return EchoState(total_length=self._episode.steps)

    def snapshot(self) -> bytes:
        return self._episode.snapshot()

    def restore(self, snapshot: bytes) -> None:
        self._episode.restore(snapshot)


class AsyncIdEchoEnv(AsyncEnvironment[EchoAction, EchoObservation, EchoState, EchoResetOptions]):
    """:class:`IdEchoEnv` as an asyncio env (the loop batch's other kind)."""

    name = "async-id-echo"
    version = "1.0.0"

    def __init__(self) -> None:
        self._episode = _Episode()

    async def reset(
        self, *, seed: int | None, episode_id: str, options: EchoResetOptions | None
    ) -> Transition[EchoObservation]:
        await asyncio.sleep(0)
        return self._episode.reset(episode_id, options)

    async def step(self, action: EchoAction) -> Transition[EchoObservation]:
        await asyncio.sleep(0)
        return self._episode.step(action)

    async def state(self) -> EchoState:
        return EchoState(total_length=self._episode.steps)

    async def snapshot(self) -> bytes:
        return self._episode.snapshot()

    async def restore(self, snapshot: bytes) -> None:
        self._episode.restore(snapshot)
