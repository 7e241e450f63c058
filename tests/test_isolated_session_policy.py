"""``--isolated``: the layers below a stream's view (the batch calls, the spread, the env
process pool) never ask whether they serve a Session or a VectorSession (issue 38 item
2). What a Session is promised differently comes down as a named policy
(``spread.BlockPolicy``) from ``service._SessionOpening``, and its view waits for a fresh
env itself; a VectorSession of one env is a vector like any other.
"""

from __future__ import annotations

import inspect

import grpc
import pytest

from openenv_grpc import VectorSession
from openenv_grpc.server.isolated.env_process_pool import EnvProcessPool
from openenv_grpc.server.isolated.spread import BlockPolicy, SpreadBatchCalls
from openenv_grpc.server.local.calls import BatchCalls, LocalBatchCalls
from support.echo_rows import echoed_pids, say

pytestmark = pytest.mark.timeout(60)


def test_no_session_flag_or_settle_below_the_view() -> None:
    for function in (
        SpreadBatchCalls.open, SpreadBatchCalls.__init__,
        EnvProcessPool.place_block, EnvProcessPool.create_block,
    ):  # fmt: skip
        assert "session" not in inspect.signature(function).parameters, function
    for calls in (BatchCalls, LocalBatchCalls, SpreadBatchCalls):
        assert not hasattr(calls, "settle") and not hasattr(calls, "unsettled"), calls
    assert "session" not in {field for field in BlockPolicy.__dataclass_fields__}


def test_a_vector_of_one_env_whose_process_dies_goes_on(start_server) -> None:  # type: ignore[no-untyped-def]
    """One env in one block, as a Session's, but a vector's policy: its process lost, the
    env answers UNAVAILABLE ("reset it") and the stream goes on, where a Session ends."""
    server = start_server("support.envs:FaultyEnv", "--isolated", "2")
    with VectorSession(server.target, 1) as envs:
        envs.reset()
        [before] = echoed_pids(envs.step(say("pid")))
        out = envs.step(say("exit"))
        assert out.indices == []
        error = out.errors[0]
        assert error.code is grpc.StatusCode.UNAVAILABLE
        assert error.message.endswith("a fresh environment took this one's place: reset it")
        envs.reset()
        [after] = echoed_pids(envs.step(say("pid")))
        assert after != before
    server.wait_until(lambda: server.active() == 0, what="slot released")
