"""The front's reading of what an env process answers, on a real env process pool.

An env process answers a frame about a block it no longer holds (closed on its side
thread in a drain, while the frame waited in its queue) with a status of its own and a
plain-text payload, not a ``VectorSessionResponse``: every call of the spread reads it as
what it means (UNAVAILABLE, nothing was done, the stream ends), and a step whose caller
is gone hands nothing on.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from openenv_grpc.environment import AutoresetMode
from openenv_grpc.server.isolated.env_process import Op, Status
from openenv_grpc.server.isolated.env_process_pool import EnvProcessPool
from openenv_grpc.server.isolated.spread import SpreadBatchCalls, _read
from openenv_grpc.server.local.batch import BatchOutcome
from openenv_grpc.server.local.calls import BatchRefused, RestoreArgs, StepArgs
from openenv_grpc.server.local.frames import ROOM
from openenv_grpc.server.model.snapshots import Captured
from openenv_grpc.v1 import snapshot_pb2
from openenv_grpc_envs.echo import EchoAction, EchoEnvironment

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
INTERNAL = grpc.StatusCode.INTERNAL.value[0]
GONE = "the environment was closed; nothing was done"


def _step(orphaned: Any = None) -> StepArgs:
    return StepArgs([0, 1], [EchoAction(message="x")] * 2, False, orphaned)


async def _closed_under_it(pool: EnvProcessPool) -> SpreadBatchCalls:
    """A vector stream of two envs in one block, which its env process has closed (as
    its side thread does in a drain)."""
    calls = await SpreadBatchCalls.open(pool, 2, AutoresetMode.NEXT_STEP, batches=True)
    block = calls._blocks[0]
    await pool.call(block.worker, block.env_id, Op.CLOSE)
    return calls


CALLS = {
    "step": lambda calls: calls.step(_step()),
    "state": lambda calls: calls.query("state", [0, 1]),
    "state within room": lambda calls: calls.query_within("state", [0, 1], 1 << 16),
    "restore": lambda calls: calls.restore(
        RestoreArgs([0], [Captured("e", 0, snapshot_pb2.SNAPSHOT_PHASE_RUNNING, b"{}")])
    ),
}


@pytest.mark.parametrize("name", CALLS)
def test_a_frame_for_a_block_the_env_process_closed_is_unavailable(name: str) -> None:
    async def run() -> None:
        pool = EnvProcessPool(EchoEnvironment, 1, 10.0)
        pool.start()
        try:
            calls = await _closed_under_it(pool)
            with pytest.raises(BatchRefused) as refused:
                await CALLS[name](calls)
            assert (refused.value.code, refused.value.message) == (UNAVAILABLE, GONE)
            assert refused.value.ends
        finally:
            pool.stop()

    asyncio.run(run())


def test_a_step_given_up_whose_block_was_closed_hands_nothing_on() -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        raised: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _, context: raised.append(context))
        pool = EnvProcessPool(EchoEnvironment, 1, 10.0)
        pool.start()
        handed: list[BatchOutcome] = []
        try:
            calls = await _closed_under_it(pool)
            step = asyncio.ensure_future(calls.step(_step(lambda out, _: handed.append(out))))
            await asyncio.sleep(0)  # its frame is sent; its answer is still to come
            step.cancel()
            with pytest.raises(asyncio.CancelledError):
                await step
            # The answer comes after all: a round trip behind it makes sure it was read.
            await calls.query("state", [0])  # (refused likewise: the block is gone)
        except BatchRefused:
            pass
        finally:
            pool.stop()
        await asyncio.sleep(0)  # the late answer's callback has run
        assert handed == [] and raised == []

    asyncio.run(run())


@pytest.mark.parametrize(
    ("status", "payload"),
    [(Status.OK, b""), (Status.FAILED, b"ValueError: no"), (Status.REFUSED, b"no"),
     (Status.TOO_LARGE, ROOM.pack(1 << 20)), (Status.UNKEPT, b"")],
)  # fmt: skip
def test_a_status_no_request_is_answered_with_is_never_parsed_as_an_answer(
    status: int, payload: bytes
) -> None:
    """Only ANSWER and refusals carry a VectorSessionResponse: anything else a block's
    call got would be a bug of the frame protocol, said as one (the stream ends)."""
    refused = _read(status, payload)
    assert isinstance(refused, BatchRefused) and refused.ends
    assert (refused.code, refused.message) == (INTERNAL, f"env process answered status {status}")
