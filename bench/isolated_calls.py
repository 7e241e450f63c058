"""Python calls per vector step under ``--isolated``, counted (cProfile): the front's side
(``SpreadBatchCalls.step`` over 2 env processes of N/2 echo envs each) and the env
processes' side (an env process's REQUEST handler run in this process on the frame the
front builds for one block, times two). A count, not a time: it moves far less with the
machine's load than CPU per step does.

    python -m bench.isolated_calls --envs 4 64 --steps 300
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import pstats
from typing import Any

from openenv_grpc.environment import AutoresetMode
from openenv_grpc.server.isolated import env_process, spread
from openenv_grpc.server.isolated.env_process_pool import EnvProcessPool
from openenv_grpc.server.local.calls import ResetArgs, StepArgs
from openenv_grpc.server.model.spec import EnvSpec
from openenv_grpc_envs.echo import EchoAction, EchoEnvironment


def _step(indices: list[int]) -> StepArgs:
    return StepArgs(indices, [EchoAction(message="x") for _ in indices], False)


def _per_step(profile: cProfile.Profile, steps: int) -> float:
    return pstats.Stats(profile).total_calls / steps  # type: ignore[attr-defined,no-any-return]


async def front(envs: int, steps: int) -> float:
    """The front's calls per vector step of ``envs`` envs over two env processes."""
    pool = EnvProcessPool(EchoEnvironment, 2, 10.0)
    pool.start()
    try:
        calls = await spread.SpreadBatchCalls.open(
            pool, envs, AutoresetMode.NEXT_STEP, batches=False
        )
        every = list(range(envs))
        await calls.reset(ResetArgs(every, [None] * envs, ["e"] * envs, [None] * envs, False))
        for _ in range(50):  # first-call work
            await calls.step(_step(every))
        steps_args = [_step(every) for _ in range(steps)]
        profile = cProfile.Profile()
        profile.enable()
        for args in steps_args:
            await calls.step(args)
        profile.disable()
        return _per_step(profile, steps)
    finally:
        pool.stop()


async def env_processes(envs: int, steps: int) -> float:
    """The env processes' calls per vector step: one block's frame handled, times two."""
    worker = env_process._Worker(EnvSpec.from_factory(EchoEnvironment), None, 0)
    half = envs // 2
    await worker.create(1, env_process.BLOCK_OPEN.pack(half, 0, 0))
    frames: list[tuple[int, bytes]] = []

    class _Capture:  # the front's pool, keeping the frame instead of sending it
        budget = None

        async def call(self, _worker: Any, _env_id: int, op: int, frame: bytes, **_: Any) -> Any:
            frames.append((op, frame))
            raise RuntimeError("captured")

    block = spread._Block(None, 1, 0, half)  # type: ignore[arg-type]
    fake = spread.SpreadBatchCalls(
        _Capture(),  # type: ignore[arg-type]
        [block],
        AutoresetMode.NEXT_STEP,
        False,
        spread.VECTOR_BLOCKS,
    )
    with contextlib.suppress(RuntimeError):
        await fake.step(_step(list(range(half))))
    op, frame = frames[0]
    handle = env_process._OPS[op]
    for _ in range(50):
        await handle(worker, 1, frame)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        await handle(worker, 1, frame)
    profile.disable()
    return 2 * _per_step(profile, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", type=int, nargs="+", default=[4, 64])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    for envs in args.envs:
        row = {
            "envs": envs,
            "front_calls_per_step": round(asyncio.run(front(envs, args.steps)), 1),
            "env_process_calls_per_step": round(asyncio.run(env_processes(envs, args.steps)), 1),
        }
        print(json.dumps(row))


if __name__ == "__main__":
    main()
