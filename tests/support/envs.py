"""Environments for tests, loaded by real server processes through ``module:factory``.

Each instance records its life in a ledger directory (``OPENENV_TEST_LEDGER``): one file
per created env (``PID-ID.open``, PID the process it lives in), renamed when it closes, so
a test can count envs created and closed across processes without trusting the server's
own word.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from google.protobuf.empty_pb2 import Empty

from openenv_grpc import (
    AsyncEnvironment,
    AutoresetMode,
    BatchEnvironment,
    BatchTransition,
    Environment,
    InvalidAction,
    Transition,
)
from openenv_grpc_envs.echo import (
    EchoAction,
    EchoEnvironment,
    EchoObservation,
    EchoResetOptions,
    EchoState,
)


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


def _record_cancel() -> None:
    """Append this process's pid to ``<ledger>.cancelled`` (a tiny write, done inline)."""
    root = os.environ.get("OPENENV_TEST_LEDGER")
    if root:
        with open(f"{root}.cancelled", "a") as cancels:
            cancels.write(f"{os.getpid()}\n")


class AsyncEchoEnv(AsyncEnvironment[EchoAction, EchoObservation, EchoState, Empty]):
    """An asyncio env: echoes after yielding to the loop. ``sleep:S`` sleeps S seconds;
    a cancelled sleep appends the pid it ran in to ``<ledger>.cancelled``. ``block:S``
    holds the server's event loop S seconds (as a saturated loop would)."""

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
        if action.message.startswith("block:"):
            time.sleep(float(action.message.split(":", 1)[1]))  # noqa: ASYNC251 - the point
        if action.message.startswith("sleep:"):
            try:
                await asyncio.sleep(float(action.message.split(":", 1)[1]))
            except asyncio.CancelledError:
                _record_cancel()
                raise
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


def _meet(directory: str, count: str) -> None:
    """Mark this call in ``directory`` and wait until ``count`` calls have (see FaultyEnv)."""
    with open(os.path.join(directory, f"{os.getpid()}-{threading.get_ident()}"), "w"):
        pass
    deadline = time.monotonic() + 30
    while len(os.listdir(directory)) < int(count):
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(os.listdir(directory))} of {count} calls met")
        time.sleep(0.005)


def _wait_at_gate(path: str) -> None:
    """Say this call has started, then block until ``path`` exists (see FaultyEnv)."""
    with open(f"{path}.entered", "w"):
        pass
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gate {path} never opened")
        time.sleep(0.005)


class FaultyEnv(Environment[EchoAction, EchoObservation, EchoState, Empty]):
    """Misbehaves on command: the action's message says how.

    ``raise`` raises RuntimeError; ``invalid`` raises InvalidAction; ``wrong-type``
    returns a state as the observation; ``not-transition`` returns a bare observation;
    ``sleep:S`` blocks S seconds; ``info`` returns a rich info map; ``big:N`` returns an
    observation of N bytes; ``exit`` and ``segfault`` kill the process; ``pid`` echoes the
    id of the process the env lives in; ``slow-close:S`` makes ``close`` block S seconds;
    ``meet:DIR:N`` leaves a mark in DIR and waits (at most 30 s, then raises) until N envs
    have, so a test proves N steps ran at the same time by their meeting, not by a clock;
    ``gate:PATH`` creates ``PATH.entered`` and blocks until PATH exists (at most 30 s, then
    raises), so a test knows a call is running and ends it when it chooses;
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
        if command.startswith("meet:"):
            _meet(*command[5:].rsplit(":", 1))
        if command.startswith("gate:"):
            _wait_at_gate(command[5:])
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
    no longer exist to ``.reclaimed`` and then logs the call (the calling pid, one line)
    in ``<ledger>.reclaims``."""

    @classmethod
    def reclaim_orphans(cls) -> None:
        root = os.environ.get("OPENENV_TEST_LEDGER")
        if not root:
            return
        for entry in Path(root).glob("*.open"):
            if not _process_exists(int(entry.name.split("-", 1)[0])):
                entry.rename(entry.with_suffix(".reclaimed"))
        # Logged after the renames: a test that sees the call sees what it reclaimed.
        with open(f"{root}.reclaims", "a") as calls:
            calls.write(f"{os.getpid()}\n")


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


class MeasuredEnv(FaultyEnv):
    """A FaultyEnv the server places by measurement (``runs_inline = None``). Two more
    commands: ``thread`` echoes the name of the thread the step ran on (``MainThread``:
    the event loop), ``class:NAME`` puts the instance in cost class NAME."""

    runs_inline = None

    def __init__(self) -> None:
        super().__init__()
        self._cost_class = ""

    def cost_class(self) -> str:
        return self._cost_class

    def step(self, action: EchoAction) -> Transition[EchoObservation]:
        command = action.message
        if command == "thread":
            return Transition(EchoObservation(echoed_message=threading.current_thread().name))
        if command.startswith("class:"):
            self._cost_class = command.split(":", 1)[1]
        return super().step(action)


#: 64-bit LCG (Knuth's MMIX constants): a random stream whose whole state is one integer.
_LCG_MULTIPLIER = 6364136223846793005
_LCG_INCREMENT = 1442695040888963407
_LCG_MASK = (1 << 64) - 1


class DeterministicEchoEnv(Environment[EchoAction, EchoObservation, EchoState, EchoResetOptions]):
    """A deterministic echo env without snapshots. Each step's reward is 0.1 per character
    plus a draw from a random stream seeded by reset, so a restored episode repeats only
    if the snapshot carried the stream; episodes end like echo's (``max_steps``,
    ``stop_word``).

    A step message ``environ:NAME`` echoes the variable NAME of the env's process
    environment, ``pid`` the process id (neither moves the random stream).
    """

    name = "deterministic-echo"
    version = "1.0.0"
    runs_inline = True

    def __init__(self) -> None:
        self._ledger = Ledger()
        self._rng = 0
        self._seed = 0
        self._steps = 0
        self._total = 0
        self._history: list[str] = []
        self._max_steps = 0
        self._stop_word = ""
        self._snapshot_mode = ""
        self._restore_mode = ""

    def reset(
        self, *, seed: int | None, episode_id: str, options: EchoResetOptions | None
    ) -> Transition[EchoObservation]:
        options = options or EchoResetOptions()
        self._seed = seed or 0
        self._rng = (self._seed * _LCG_MULTIPLIER + _LCG_INCREMENT) & _LCG_MASK
        self._steps = self._total = 0
        self._history = []
        self._max_steps, self._stop_word = options.max_steps, options.stop_word
        self._snapshot_mode = self._restore_mode = ""
        return Transition(EchoObservation(echoed_message="ready"))

    def step(self, action: EchoAction) -> Transition[EchoObservation]:
        message = action.message
        if message.startswith("environ:"):  # what env code finds in its environment
            value = os.environ.get(message.removeprefix("environ:"), "<unset>")
            return Transition(EchoObservation(echoed_message=value))
        if message == "pid":
            return Transition(EchoObservation(echoed_message=str(os.getpid())))
        if message.startswith("snapshot:"):
            self._snapshot_mode = message.removeprefix("snapshot:")
        elif message.startswith("restore:"):
            self._restore_mode = message.removeprefix("restore:")
        self._rng = (self._rng * _LCG_MULTIPLIER + _LCG_INCREMENT) & _LCG_MASK
        self._steps += 1
        self._total += len(message)
        self._history = [*self._history, message][-20:]
        return Transition(
            EchoObservation(echoed_message=message, message_length=len(message)),
            reward=0.1 * len(message) + (self._rng >> 11) / float(1 << 53),
            terminated=bool(self._stop_word) and message == self._stop_word,
            truncated=bool(self._max_steps) and self._steps >= self._max_steps,
        )

    def state(self) -> EchoState:
        return EchoState(total_length=self._total, seed=self._seed, history=self._history)

    def close(self) -> None:
        self._ledger.closed()


class SnapshotEchoEnv(DeterministicEchoEnv):
    """The deterministic echo env with snapshots (JSON: plain data, never pickle), so a
    restored episode repeats only if the snapshot carried the random stream.

    Misbehaves on command: a step message ``snapshot:raise``, ``snapshot:invalid``,
    ``snapshot:unsupported``, ``snapshot:not-bytes`` or ``snapshot:big:N`` (N bytes of
    padding) makes the next snapshots fail that way; ``restore:raise`` or
    ``restore:invalid`` is written into the snapshots taken after it, whose restore then
    fails that way.
    """

    name = "snapshot-echo"

    def snapshot(self) -> bytes:
        mode = self._snapshot_mode
        if mode == "raise":
            raise RuntimeError("snapshot failed on purpose")
        if mode == "invalid":
            raise InvalidAction("cannot snapshot now, on purpose")
        if mode == "not-bytes":
            return "a str, not bytes"  # type: ignore[return-value]
        if mode == "unsupported":
            raise NotImplementedError("not in this configuration, on purpose")
        captured = {
            "rng": self._rng, "seed": self._seed, "steps": self._steps, "total": self._total,
            "history": self._history, "max_steps": self._max_steps,
            "stop_word": self._stop_word, "restore_mode": self._restore_mode,
            "padding": "x" * int(mode.removeprefix("big:")) if mode.startswith("big:") else "",
        }  # fmt: skip
        return json.dumps(captured).encode()

    def restore(self, snapshot: bytes) -> None:
        captured = json.loads(snapshot)
        if captured["restore_mode"] == "raise":
            raise RuntimeError("restore failed on purpose")
        if captured["restore_mode"] == "invalid":
            raise InvalidAction("this snapshot is refused, on purpose")
        self._rng, self._seed = captured["rng"], captured["seed"]
        self._steps, self._total = captured["steps"], captured["total"]
        self._history = captured["history"]
        self._max_steps, self._stop_word = captured["max_steps"], captured["stop_word"]
        self._snapshot_mode, self._restore_mode = "", captured["restore_mode"]


class PooledSnapshotEchoEnv(SnapshotEchoEnv):
    """The snapshot echo env on the shared thread pool."""

    runs_inline = False


class SnapshotEchoEnvV2(SnapshotEchoEnv):
    """The same env at another version: its snapshots are not the first one's."""

    version = "2.0.0"


class OtherSnapshotEnv(SnapshotEchoEnv):
    """Another env (by name) with the same types and snapshot format."""

    name = "other-snapshot-echo"


class HalfSnapshotEnv(FaultyEnv):
    """Broken on purpose: overrides snapshot() but not restore()."""

    def snapshot(self) -> bytes:
        return b""


class RandomRewardEnv(AsyncEchoEnv):
    """Broken on purpose: rewards ignore the seed, so a replayed episode diverges."""

    async def step(self, action: EchoAction) -> Transition[EchoObservation]:
        transition = await super().step(action)
        transition.reward = random.random()
        return transition


class StrictAsyncEchoEnv(AsyncEchoEnv):
    """The async echo env (same name), refusing the message ``alpha``: a server of it
    cannot replay an episode another server's env accepted."""

    async def step(self, action: EchoAction) -> Transition[EchoObservation]:
        if action.message == "alpha":
            raise InvalidAction("alpha is not allowed here")
        return await super().step(action)


class ForgetfulSnapshotEnv(SnapshotEchoEnv):
    """Broken on purpose: its snapshot leaves out the random stream, so a restored
    episode draws other rewards."""

    def snapshot(self) -> bytes:
        captured = json.loads(super().snapshot())
        del captured["rng"]
        return json.dumps(captured).encode()

    def restore(self, snapshot: bytes) -> None:
        super().restore(json.dumps({**json.loads(snapshot), "rng": 0}).encode())


class ProcessLocalSnapshotEnv(SnapshotEchoEnv):
    """Broken on purpose: its snapshot is a key into this process's memory, so it
    restores in the server that made it and nowhere else."""

    kept: ClassVar[dict[str, bytes]] = {}

    def snapshot(self) -> bytes:
        key = uuid.uuid4().hex
        ProcessLocalSnapshotEnv.kept[key] = super().snapshot()
        return key.encode()

    def restore(self, snapshot: bytes) -> None:
        super().restore(ProcessLocalSnapshotEnv.kept[snapshot.decode()])


class BatchingEchoEnv(CountingEchoEnv):
    """The counting echo env, which also answers a vector stream natively (up to 8 envs;
    a larger stream gets the server's loop; 13 is refused) with :class:`EchoBatch`."""

    @classmethod
    def make_batch(cls, size: int, autoreset: AutoresetMode) -> EchoBatch | None:
        if size == 13:
            raise InvalidAction("13 envs bring bad luck")
        return EchoBatch(size, autoreset) if size <= 8 else None


class EchoBatch(BatchEnvironment[EchoAction, EchoObservation, EchoState, EchoResetOptions]):
    """N echo envs in one object. The batch form of an action or an observation is one
    message whose ``message`` / ``echoed_message`` holds the rows joined by newlines (the
    observation's ``message_length`` is then the number of rows). A row ``raise`` raises
    for that env, ``invalid`` refuses its action; the autoreset is the batch's own."""

    def __init__(self, size: int, autoreset: AutoresetMode) -> None:
        super().__init__(size, autoreset)
        self._ledgers = [Ledger() for _ in range(size)]
        self._options = [EchoResetOptions() for _ in range(size)]
        self._seeds = [0] * size
        self._steps = [0] * size
        self._lengths = [0] * size
        self._ended = [False] * size

    def reset(
        self,
        indices: Sequence[int],
        seeds: Sequence[int | None],
        options: Sequence[EchoResetOptions | None],
    ) -> BatchTransition[EchoObservation]:
        for index, seed, option in zip(indices, seeds, options, strict=True):
            self._start(index, seed, option or EchoResetOptions())
        greetings = [self._options[i].greeting or "ready" for i in indices]
        return BatchTransition(
            self._rows(greetings), [0.0] * len(indices), [False] * len(indices),
            [False] * len(indices),
        )  # fmt: skip

    def _start(self, index: int, seed: int | None, options: EchoResetOptions) -> None:
        self._options[index] = options
        self._seeds[index] = seed or 0
        self._steps[index] = self._lengths[index] = 0
        self._ended[index] = False

    def step(self, indices: Sequence[int], actions: EchoAction) -> BatchTransition[EchoObservation]:
        messages = actions.message.split("\n")
        if len(messages) != len(indices):
            raise InvalidAction(f"{len(messages)} rows for {len(indices)} envs")
        rows: list[str] = []
        rewards: list[float] = []
        terminated: list[bool] = []
        truncated: list[bool] = []
        reset: list[bool] = []
        finals: list[str] = []
        errors: dict[int, Exception] = {}
        for index, message in zip(indices, messages, strict=True):
            if message == "raise":
                errors[index] = RuntimeError("boom in the batch")
                continue
            if message == "invalid":
                errors[index] = InvalidAction("not this row")
                continue
            if self._ended[index] and self.autoreset is AutoresetMode.NEXT_STEP:
                self._start(index, None, self._options[index])
                rows.append(self._options[index].greeting or "ready")
                rewards.append(0.0)
                terminated.append(False)
                truncated.append(False)
                reset.append(True)
                continue
            self._steps[index] += 1
            self._lengths[index] += len(message)
            limit = self._options[index].max_steps
            ended = bool(limit) and self._steps[index] >= limit
            rewards.append(0.1 * len(message))
            terminated.append(False)
            truncated.append(ended)
            if ended and self.autoreset is AutoresetMode.SAME_STEP:
                finals.append(message)
                self._start(index, None, self._options[index])
                rows.append(self._options[index].greeting or "ready")
                reset.append(True)
                continue
            self._ended[index] = ended
            rows.append(message)
            reset.append(False)
        return BatchTransition(
            self._rows(rows), rewards, terminated, truncated, reset=reset,
            final_observation=self._rows(finals) if finals else None,
            final_infos=[{"last": m} for m in finals] if finals else None,
            errors=errors or None,
        )  # fmt: skip

    def state(self, index: int) -> EchoState:
        return EchoState(total_length=self._lengths[index], seed=self._seeds[index])

    def join_actions(self, actions: Sequence[EchoAction]) -> EchoAction:
        if any("\n" in action.message for action in actions):
            raise InvalidAction("a row may not hold a newline")
        return EchoAction(message="\n".join(action.message for action in actions))

    def split_observation(self, observation: EchoObservation, rows: int) -> list[EchoObservation]:
        if rows == 0:
            return []
        return [
            EchoObservation(echoed_message=m, message_length=len(m))
            for m in observation.echoed_message.split("\n")
        ]

    @staticmethod
    def _rows(messages: Sequence[str]) -> EchoObservation:
        return EchoObservation(echoed_message="\n".join(messages), message_length=len(messages))

    def close(self) -> None:
        for ledger in self._ledgers:
            ledger.closed()
