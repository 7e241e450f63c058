"""The rows whose env gave no reward (``BatchOutcome.no_reward``, issue 37) on the hop
from an env process to its front (``--isolated``): field 100 of the ``VectorResult``,
which the proto reserves for it, read back with the block's offset, merged over blocks,
and never written into a client's answer. (Served end to end in
test_openenv_no_reward.py.)"""

from __future__ import annotations

from google.protobuf.unknown_fields import UnknownFieldSet

from openenv_grpc.server.isolated.spread import _merge
from openenv_grpc.server.local.batch import BatchOutcome
from openenv_grpc.server.local.frames import fill_no_reward, fill_result, read_outcome
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
    fill_no_reward(response.result, outcome)
    return read_outcome(
        pb.VectorSessionResponse.FromString(response.SerializeToString()).result, offset
    )


def test_the_rows_without_reward_cross_the_hop_moved_by_the_offset() -> None:
    read = _hop(_outcome([0, 1, 300], [0.0, 1.0, 0.0], {0, 300}), offset=4)
    assert read.rows == [4, 5, 304]
    assert read.no_reward == {4, 304}
    assert read.rewards == [0.0, 1.0, 0.0]


def test_an_answer_where_every_env_rewarded_is_unchanged_by_the_hop() -> None:
    outcome = _outcome([0, 1], [0.0, 2.0], set())
    plain = pb.VectorResult()
    fill_result(plain, outcome, URL, (), ())
    marked = pb.VectorResult()
    fill_result(marked, outcome, URL, (), ())
    fill_no_reward(marked, outcome)
    assert marked.SerializeToString() == plain.SerializeToString()
    assert _hop(outcome, 0).no_reward == set()


def test_blocks_merge_their_rows_without_reward() -> None:
    out = BatchOutcome()
    _merge(out, _hop(_outcome([0, 1], [0.0, 1.0], {1}), offset=0))
    _merge(out, _hop(_outcome([0, 1], [0.0, 0.0], {0}), offset=2))
    assert out.rows == [0, 1, 2, 3]
    assert out.no_reward == {1, 2}


def test_a_clients_vector_result_never_carries_the_hops_field() -> None:
    """The front answers a vector client from what it read: rewards 0, no field 100."""
    read = _hop(_outcome([0, 1], [0.0, 3.0], {0}), offset=0)
    client = pb.VectorResult()
    fill_result(client, read, URL, ["e-0", "e-1"], [1, 1])
    assert list(client.rewards) == [0.0, 3.0]
    assert len(UnknownFieldSet(client)) == 0
