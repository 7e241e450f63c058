"""Environments for tests, loaded by real server processes through ``module:factory``.

Each instance records its life in a ledger directory (``OPENENV_TEST_LEDGER``): one file
per created env (``PID-ID.open``, PID the process it lives in), renamed when it closes, so
a test can count envs created and closed across processes without trusting the server's
own word.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import ClassVar

from google.protobuf.empty_pb2 import Empty

from openenv_grpc import AsyncEnvironment, Environment, InvalidAction, Transition
from openenv_grpc_envs.echo import EchoAction, EchoEnvironment, EchoObservation, EchoState


class Ledger:
    """Records creation and close of one env instance."""

    def __init__(self) -> None:
        root = os.environ.get("OPENENV_TEST_LEDGER")
        # The pid tells reclaim_orphans (OrphanReclaimingEnv) a dead process's entries.
        self._path = Path(root) / f"{os.getpid()}-{uuid.uuid4().hex}.open" if root else None
        if self._path is not None:
            self._path.touch()

    def closed(self) -> None:
        if self._path is not None:
            if not self._path.exists():
                raise AssertionError("env closed twice")
            self._path.rename(self._path.with_suffix(".closed"))


class CountingEchoEnv(EchoEnvironment):
    """The echo env, with its creation and close recorded in the ledger."""

    def __init__(self) -> None:
        super().__init__()
        self._ledger = Ledger()

    def close(self) -> None:
        self._ledger.closed()


class PooledEchoEnv(CountingEchoEnv):
    """The echo env run on the shared thread pool (not declared cheap)."""

    runs_inline = False


class ThreadReportingEnv(PooledEchoEnv):
    """The pooled echo env; each step observes the id of the thread it ran on."""

    def step(self, action: EchoAction) -> Transition[EchoObservation]:
        transition = super().step(action)
        transition.observation.echoed_message = str(threading.get_ident())
        return transition


class AsyncEchoEnv(AsyncEnvironment[EchoAction, EchoObservation, EchoState, Empty]):
    """An asyncio env: echoes after yielding to the loop."""

    name = "async-echo"

    def __init__(self) -> None:
        self._ledger = Ledger()
        self._count = 0

    async def reset(
        self, *, seed: int | None, episode_id: str, options: Empty | None
    ) -> Transition[EchoObservation]:
        self._count = 0
        await asyncio.sleep(0)
        return Transition(EchoObservation(echoed_message="async ready"))

    async def step(self, action: EchoAction) -> Transition[EchoObservation]:
        if action.message.startswith("sleep:"):
            await asyncio.sleep(float(action.message.split(":", 1)[1]))
        await asyncio.sleep(0)
        self._count += 1
        return Transition(
            EchoObservation(echoed_message=action.message, message_length=len(action.message)),
            reward=float(self._count),
        )

    async def state(self) -> EchoState:
        return EchoState(total_length=self._count)

    async def close(self) -> None:
        self._ledger.closed()


class FaultyEnv(Environment[EchoAction, EchoObservation, EchoState, Empty]):
    """Misbehaves on command: the action's message says how.

    ``raise`` raises RuntimeError; ``invalid`` raises InvalidAction; ``wrong-type``
    returns a state as the observation; ``not-transition`` returns a bare observation;
    ``sleep:S`` blocks S seconds; ``info`` returns a rich info map; ``big:N`` returns an
    observation of N bytes; ``exit`` and ``segfault`` kill the process; ``pid`` echoes the
    id of the process the env lives in; ``slow-close:S`` makes ``close`` block S seconds;
    anything else echoes.
    ``state`` raises after a ``break-state`` step.
    """

    name = "faulty"
    runs_inline = False

    def __init__(self) -> None:
        self._ledger = Ledger()
        self._state_broken = False
        self._close_delay = 0.0

    def reset(
        self, *, seed: int | None, episode_id: str, options: Empty | None
    ) -> Transition[EchoObservation]:
        self._state_broken = False
        return Transition(EchoObservation(echoed_message=f"episode {episode_id}"))

    def step(self, action: EchoAction) -> Transition[EchoObservation]:
        command = action.message
        if command == "raise":
            raise RuntimeError("boom in step")
        if command == "invalid":
            raise InvalidAction("that move is not allowed here")
        if command == "wrong-type":
            return Transition(EchoState())  # type: ignore[arg-type]
        if command == "not-transition":
            return EchoObservation(echoed_message="bare")  # type: ignore[return-value]
        if command.startswith("sleep:"):
            time.sleep(float(command.split(":", 1)[1]))
        if command == "exit":
            os._exit(3)  # what a crashing native extension looks like from outside
        if command == "segfault":
            import ctypes

            ctypes.string_at(0)
        if command == "break-state":
            self._state_broken = True
        if command == "pid":
            return Transition(EchoObservation(echoed_message=str(os.getpid())))
        if command.startswith("slow-close:"):
            self._close_delay = float(command.split(":", 1)[1])
        if command.startswith("big:"):
            return Transition(EchoObservation(echoed_message="x" * int(command[4:])))
        if command == "info":
            return Transition(
                EchoObservation(echoed_message=command),
                info={"lives": 3, "name": "x", "nested": {"a": [1, 2]}, "obj": object()},
            )
        return Transition(EchoObservation(echoed_message=command))

    def state(self) -> EchoState:
        if self._state_broken:
            raise ValueError("state is unavailable")
        return EchoState()

    def close(self) -> None:
        time.sleep(self._close_delay)
        self._ledger.closed()


class RaisingCloseEnv(CountingEchoEnv):
    """Its close records itself, then raises."""

    def close(self) -> None:
        super().close()
        raise OSError("close failed on purpose")


def failing_factory() -> CountingEchoEnv:
    """A factory that never manages to build its env."""
    raise RuntimeError("no GPU left for this env")


class LeakyEchoEnv(EchoEnvironment):
    """Broken on purpose: every instance shares one history, so sessions see each other."""

    shared_history: ClassVar[deque[str]] = deque(maxlen=100)

    def __init__(self) -> None:
        super().__init__()
        self._history = self.shared_history

    def step(self, action: EchoAction) -> Transition[EchoObservation]:
        transition = super().step(action)
        # The leak shows in what the agent observes: the count of all messages ever seen.
        transition.observation.message_length = len(self._history)
        return transition


class UnseededEchoEnv(EchoEnvironment):
    """Broken on purpose: ignores the seed, so seeded episodes do not repeat."""

    def step(self, action: EchoAction) -> Transition[EchoObservation]:
        transition = super().step(action)
        transition.observation.message_length = random.randrange(1 << 30)
        return transition


class DeclaredTimeoutEnv(FaultyEnv):
    """A FaultyEnv that declares its own step timeout (no server flag needed)."""

    step_timeout = 0.3


class OneShotFactoryEnv(FaultyEnv):
    """Only the first instance per server process can be built (replacements fail)."""

    built: ClassVar[int] = 0

    def __init__(self) -> None:
        if OneShotFactoryEnv.built:
            raise RuntimeError("no second instance available")
        OneShotFactoryEnv.built += 1
        super().__init__()


class OrphanReclaimingEnv(FaultyEnv):
    """A FaultyEnv whose ``reclaim_orphans`` renames the ledger entries of processes that
    no longer exist to ``.reclaimed`` and logs each call (the calling pid, one line) in
    ``<ledger>.reclaims``."""

    @classmethod
    def reclaim_orphans(cls) -> None:
        root = os.environ.get("OPENENV_TEST_LEDGER")
        if not root:
            return
        with open(f"{root}.reclaims", "a") as calls:
            calls.write(f"{os.getpid()}\n")
        for entry in Path(root).glob("*.open"):
            if not _process_exists(int(entry.name.split("-", 1)[0])):
                entry.rename(entry.with_suffix(".reclaimed"))


def _process_exists(pid: int) -> bool:
    """True while ``pid`` exists, a zombie not yet reaped included (its parent has not
    seen it die, so its leftovers are not free yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class FlakyFactoryEnv(FaultyEnv):
    """A FaultyEnv whose factory raises while the file ``<ledger>.no-factory`` exists."""

    def __init__(self) -> None:
        if Path(f"{os.environ.get('OPENENV_TEST_LEDGER')}.no-factory").exists():
            raise RuntimeError("the factory is switched off")
        super().__init__()


class SlowStartEnv(CountingEchoEnv):
    """The counting echo env, taking a second to build."""

    def __init__(self) -> None:
        time.sleep(1.0)
        super().__init__()


class SlowFactoryEnv(FaultyEnv):
    """A FaultyEnv whose factory takes ``OPENENV_TEST_FACTORY_SECONDS`` (default 2) seconds;
    the ledger records it once built."""

    def __init__(self) -> None:
        time.sleep(float(os.environ.get("OPENENV_TEST_FACTORY_SECONDS", "2")))
        super().__init__()


class SlowFactoryEchoEnv(CountingEchoEnv):
    """The echo env, pooled, whose factory takes ``OPENENV_TEST_FACTORY_SECONDS`` seconds."""

    runs_inline = False

    def __init__(self) -> None:
        time.sleep(float(os.environ.get("OPENENV_TEST_FACTORY_SECONDS", "2")))
        super().__init__()
