"""An async OpenEnv env whose ``reset_async`` blocks the event loop it runs on
(``time.sleep`` instead of ``await asyncio.sleep``): the bridge must keep the server's
own loop (health, other sessions, the drain) free of it. ``mark=PATH`` (a reset option)
creates ``PATH`` just before the call blocks. A step of ``exit`` raises ``SystemExit(3)``
on the env's loop; ``task-exit`` starts a task there that does."""

import asyncio
import os
import time
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


async def _exit() -> None:
    raise SystemExit(3)


class PingAction(Action):
    text: str = ""


class PingObservation(Observation):
    text: str = ""


class BlockingEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs: Any) -> PingObservation:
        raise NotImplementedError  # reset_async is what OpenEnv (and the bridge) call

    async def reset_async(
        self, seed=None, episode_id=None, block: float = 0.0, mark: str = "", **kwargs: Any
    ) -> PingObservation:
        if mark:  # a test waits for this file: the call is about to block its loop
            with open(mark, "w"):  # noqa: ASYNC230 -- blocking is this env's point
                pass
        time.sleep(block)  # noqa: ASYNC251 -- the bug under test: blocks whatever loop runs it
        await asyncio.sleep(0)
        return PingObservation(text=f"ready in {os.getpid()}")

    def step(self, action: PingAction) -> PingObservation:  # type: ignore[override]
        return PingObservation(text=action.text)

    async def step_async(self, action: PingAction) -> PingObservation:  # type: ignore[override]
        if action.text == "exit":
            raise SystemExit(3)
        if action.text == "task-exit":
            asyncio.get_running_loop().create_task(_exit())
        return PingObservation(text=action.text)

    @property
    def state(self) -> State:
        return self._state
