"""A VectorSession spread over several env processes (``--isolated``) whose step or reset
finds one block closed under its frame (BLOCK_GONE: the env process closed it on its side
thread, as in a drain): the whole call is refused and the stream ends, with the code and
message a stream of one block gets, and the blocks that stepped meanwhile are still
counted. On a real env process pool; the driver and view are the server's own.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2

from openenv_grpc.environment import AutoresetMode
from openenv_grpc.server.isolated.env_process import Op
from openenv_grpc.server.isolated.env_process_pool import EnvProcessPool
from openenv_grpc.server.isolated.spread import SpreadBatchCalls
from openenv_grpc.server.local.batch import BatchOutcome
from openenv_grpc.server.local.calls import BatchRefused, ResetArgs, StepArgs
from openenv_grpc.server.model.phases import VECTOR_WORDS
from openenv_grpc.server.model.spec import EnvSpec
from openenv_grpc.server.stream.backend import Answer
from openenv_grpc.server.stream.driver import Driver
from openenv_grpc.server.stream.vector_view import VectorView
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc_envs.echo import EchoAction, EchoEnvironment

pytestmark = pytest.mark.timeout(60)

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
GONE = "the environment was closed; nothing was done"


def _wire(message: str) -> any_pb2.Any:
    wire = any_pb2.Any()
    wire.Pack(EchoAction(message=message))
    return wire


async def _open(pool: EnvProcessPool, blocks: int) -> SpreadBatchCalls:
    """Four envs: in one block (``blocks`` 1), or two blocks on the pool's two processes."""
    calls = await SpreadBatchCalls.open(pool, 4, AutoresetMode.NEXT_STEP, batches=blocks == 1)
    assert [(block.start, block.size) for block in calls._blocks] == (
        [(0, 4)] if blocks == 1 else [(0, 2), (2, 2)]
    )
    if blocks == 2:
        assert calls._blocks[0].worker is not calls._blocks[1].worker
    return calls


async def _close_last_block(pool: EnvProcessPool, calls: SpreadBatchCalls) -> None:
    """The env process of the last block closes it, as its side thread does in a drain."""
    block = calls._blocks[-1]
    await pool.call(block.worker, block.env_id, Op.CLOSE)


def _pool_run(test: Any) -> None:
    async def run() -> None:
        pool = EnvProcessPool(EchoEnvironment, 2, 10.0)
        pool.start()
        try:
            await test(pool)
        finally:
            pool.stop()

    asyncio.run(run())


def test_a_step_over_two_blocks_one_gone_is_refused_as_a_whole_and_ends() -> None:
    """The gone block's refusal is the call's (not its rows'), ``ends`` kept; the block
    that stepped is handed on to be booked and counted."""

    async def test(pool: EnvProcessPool) -> None:
        calls = await _open(pool, 2)
        count = 4
        await calls.reset(
            ResetArgs(range(count), [None] * count, ["e"] * count, [None] * count, False)
        )
        await _close_last_block(pool, calls)
        handed: list[BatchOutcome] = []
        args = StepArgs(
            [0, 1, 2, 3], [EchoAction(message="x")] * 4, False,
            lambda outcome, _: handed.append(outcome),
        )  # fmt: skip
        with pytest.raises(BatchRefused) as refused:
            await calls.step(args)
        assert (refused.value.code, refused.value.message) == (UNAVAILABLE, GONE)
        assert refused.value.ends
        assert [outcome.rows for outcome in handed] == [[0, 1]]  # block 0 did step
        with pytest.raises(BatchRefused) as again:  # a reset likewise
            await calls.reset(ResetArgs([1, 2], [None] * 2, ["f"] * 2, [None] * 2, False))
        assert (again.value.code, again.value.message, again.value.ends) == (
            UNAVAILABLE, GONE, True,
        )  # fmt: skip
        await calls.close()

    _pool_run(test)


async def _stream_answer(pool: EnvProcessPool, blocks: int) -> tuple[Answer, pb.Error]:
    """A VectorSession's step over its four envs, one block gone: the view's answer."""
    calls = await _open(pool, blocks)
    driver = Driver(
        EnvSpec.from_factory(EchoEnvironment), 4, AutoresetMode.NEXT_STEP, calls, VECTOR_WORDS
    )
    view = VectorView(driver)
    reset = await view.handle(
        pb.VectorSessionRequest(request_id=1, reset=pb.VectorReset()).SerializeToString()
    )
    assert pb.VectorSessionResponse.FromString(reset.response).WhichOneof("outcome") != "error"
    await _close_last_block(pool, calls)
    step = pb.VectorSessionRequest(
        request_id=2, step=pb.VectorStep(actions=[_wire(w) for w in "abcd"])
    )
    answer = await view.handle(step.SerializeToString())
    response = pb.VectorSessionResponse.FromString(answer.response)
    assert response.WhichOneof("outcome") == "error", response
    await view.close()
    return answer, response.error


def test_a_vector_over_two_env_processes_ends_as_one_of_one_block_does() -> None:
    async def test(pool: EnvProcessPool) -> None:
        one, one_error = await _stream_answer(pool, 1)
        two, two_error = await _stream_answer(pool, 2)
        assert (one_error.code, one_error.message, one.ends) == (UNAVAILABLE, GONE, True)
        assert (two_error.code, two_error.message, two.ends) == (UNAVAILABLE, GONE, True)
        assert (two.outcome, two.error) == (one.outcome, one.error)

    _pool_run(test)
