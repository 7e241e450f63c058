"""The rows whose env gave no reward (``BatchOutcome.no_reward``, issue 37) in a
``VectorResult``: ``no_reward`` lists them, as a vector client reads it and on the hop from
an env process to its front (``--isolated``), read back with the block's offset and merged
over blocks. (Served end to end in test_openenv_no_reward.py.)"""

from __future__ import annotations

from openenv_grpc.server.isolated.spread import _merge
from openenv_grpc.server.local.batch import BatchOutcome
from openenv_grpc.server.local.frames import fill_result, read_outcome
from openenv_grpc.v1 import session_pb2 as pb

URL = "type.googleapis.com/test.Observation"


def _outcome(rows: list[int], rewards: list[float], no_reward: set[int]) -> BatchOutcome:
    count = len(rows)
    return BatchOutcome(
        rows=rows,
        observations=[b""] * count,
        rewards=rewards,
        terminated=[False] * count,
        truncated=[False] * count,
        no_reward=no_reward,
    )


def _hop(outcome: BatchOutcome, offset: int) -> BatchOutcome:
    """What the front reads of an env process's answer (serialized, as on the socket)."""
    response = pb.VectorSessionResponse(request_id=1)
    fill_result(response.result, outcome, URL, (), (), info_json=True)
    return read_outcome(
        pb.VectorSessionResponse.FromString(response.SerializeToString()).result, offset
    )


def test_the_rows_without_reward_cross_the_hop_moved_by_the_offset() -> None:
    read = _hop(_outcome([0, 1, 300], [0.0, 1.0, 0.0], {300, 0}), offset=4)
    assert read.rows == [4, 5, 304]
    assert read.no_reward == {4, 304}
    assert read.rewards == [0.0, 1.0, 0.0]


def test_an_answer_where_every_env_rewarded_lists_none() -> None:
    result = pb.VectorResult()
    fill_result(result, _outcome([0, 1], [0.0, 2.0], set()), URL, (), ())
    assert not result.no_reward
    assert _hop(_outcome([0, 1], [0.0, 2.0], set()), 0).no_reward == set()


def test_blocks_merge_their_rows_without_reward() -> None:
    out = BatchOutcome()
    _merge(out, _hop(_outcome([0, 1], [0.0, 1.0], {1}), offset=0))
    _merge(out, _hop(_outcome([0, 1], [0.0, 0.0], {0}), offset=2))
    assert out.rows == [0, 1, 2, 3]
    assert out.no_reward == {1, 2}


def test_a_clients_vector_result_lists_them_ascending_with_reward_0() -> None:
    read = _hop(_outcome([0, 1, 2], [0.0, 3.0, 0.0], {2, 0}), offset=0)
    client = pb.VectorResult()
    fill_result(client, read, URL, ["e-0", "e-1", "e-2"], [1, 1, 1])
    assert list(client.rewards) == [0.0, 3.0, 0.0]
    assert list(client.no_reward) == [0, 2]
