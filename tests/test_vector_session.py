"""VectorSession streams over raw gRPC (no client library): admission of N slots all or
nothing, per-env and per-request errors, oversize batches, autoreset on the generic loop,
and the bookkeeping (episode ids, step counts, Info) of N envs bound to one stream."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.empty_pb2 import Empty

from openenv_grpc.codec import pack
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc_envs.echo import EchoAction, EchoObservation, EchoResetOptions, EchoState
from support.raw_vector import RawVector, open_metadata

pytestmark = pytest.mark.shared_server

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
INTERNAL = grpc.StatusCode.INTERNAL.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def _echo(result: pb.VectorResult) -> list[str]:
    return [EchoObservation.FromString(o.value).echoed_message for o in result.observations]


def _say(*messages: str) -> list[EchoAction]:
    return [EchoAction(message=m) for m in messages]


# -- admission ------------------------------------------------------------------------------


def test_admission_is_all_or_nothing_before_any_env_exists(start_server) -> None:
    server = start_server(
        "support.envs:CountingEchoEnv", "--max-concurrent-envs", "4", "--retry-pushback-ms", "150"
    )
    one = RawVector(server.target, 1)
    assert one.headers()["openenv-batch"] == "loop"
    refused = RawVector(server.target, 4).refusal()
    assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "4 envs asked, 3 free" in refused.details()
    assert ("grpc-retry-pushback-ms", "150") in tuple(refused.trailing_metadata() or ())
    never = RawVector(server.target, 5).refusal()
    assert never.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert never.details() == (
        "5 envs asked, more than this server's capacity of 4 (1 in use now): this never fits "
        "here; ask for fewer"
    )
    assert not any(k == "grpc-retry-pushback-ms" for k, _ in never.trailing_metadata() or ())
    assert server.created() == 1  # no env was made for the refused opens
    three = RawVector(server.target, 3)
    assert three.headers()["openenv-env"] == "echo"
    assert server.active() == 4 and server.created() == 4
    info = server.info()
    assert info.activity.sessions_refused == 9  # 4 + 5 refused envs
    three.close()
    one.close()
    server.wait_until(lambda: server.active() == 0 and server.closed_envs() == 4)


@pytest.mark.parametrize(
    ("metadata", "words"),
    [
        ([], "openenv-num-envs"),
        (open_metadata(0), "1 to 8"),
        (open_metadata(9), "1 to 8"),
        (open_metadata("four"), "whole number"),
        (open_metadata(-2), "whole number"),
        (open_metadata(2, "sometimes"), "next_step, same_step, disabled"),
    ],
)
def test_a_bad_open_is_invalid_argument_and_makes_no_env(
    start_server, metadata: list[tuple[str, str]], words: str
) -> None:
    server = start_server("support.envs:CountingEchoEnv", "--max-vector-envs", "8")
    refused = RawVector(server.target, 0, metadata=metadata).refusal()
    assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert words in refused.details()
    assert server.created() == 0 and server.active() == 0
    ok = RawVector(server.target, 2, "DISABLED")  # modes are case-insensitive
    assert ok.headers()["openenv-batch"] == "loop"
    ok.close()


def test_info_describes_vector_support_and_counts_envs(start_server) -> None:
    server = start_server("support.envs:CountingEchoEnv", "--max-vector-envs", "64")
    info = server.info()
    assert info.vector.supported and not info.vector.native_batch
    assert info.vector.max_envs_per_stream == 64
    assert list(info.vector.autoreset_modes) == [
        pb.AUTORESET_MODE_NEXT_STEP, pb.AUTORESET_MODE_SAME_STEP, pb.AUTORESET_MODE_DISABLED,
    ]  # fmt: skip
    stream = RawVector(server.target, 5)
    stream.reset()
    stream.step(_say(*"abcde"))
    stream.step(_say("x", "y"), indices=[1, 3])
    info = server.info()
    assert info.capacity.active_sessions == 5
    assert info.activity.steps == 7  # one per env that stepped
    assert info.activity.sessions_opened == 5
    stream.close()


# -- the generic loop -----------------------------------------------------------------------


def test_reset_step_state_by_index_keep_each_envs_books(server) -> None:
    stream = RawVector(server.target, 3)
    resets = [
        pb.ResetCommand(seed=7, episode_id="ep-a"),
        pb.ResetCommand(options=pack(EchoResetOptions(greeting="hey"))),
        pb.ResetCommand(),
    ]
    first = stream.reset(resets).result
    assert list(first.indices) == [0, 1, 2]
    assert _echo(first) == ["ready", "hey", "ready"]
    assert first.episode_ids[0] == "ep-a" and all(first.episode_ids)
    assert list(first.step_counts) == [0, 0, 0]
    stepped = stream.step(_say("one", "three"), indices=[0, 2]).result
    assert list(stepped.indices) == [0, 2] and _echo(stepped) == ["one", "three"]
    assert list(stepped.rewards) == pytest.approx([0.3, 0.5])
    assert list(stepped.step_counts) == [1, 1]
    assert stepped.episode_ids[0] == "ep-a"
    again = stream.step(_say("a", "b", "c")).result
    assert list(again.step_counts) == [2, 1, 2]
    states = stream.state([0, 1]).states
    assert list(states.indices) == [0, 1]
    decoded = [EchoState.FromString(s.state.value) for s in states.states]
    assert [s.total_length for s in decoded] == [4, 1] and decoded[0].seed == 7
    assert [s.step_count for s in states.states] == [2, 1]
    assert states.states[0].episode_id == "ep-a"
    # A reset of one env starts only its episode over.
    redo = stream.reset([pb.ResetCommand(episode_id="ep-b")], indices=[2]).result
    assert list(redo.indices) == [2] and list(redo.episode_ids) == ["ep-b"]
    assert list(stream.step(_say("p", "q", "r")).result.step_counts) == [3, 2, 1]
    assert stream.close().WhichOneof("outcome") == "closed"
    server.wait_until(lambda: server.closed_envs() == 3 and server.active() == 0)


def test_every_bad_request_gets_its_code_and_the_stream_goes_on(server) -> None:
    stream = RawVector(server.target, 3)
    stream.reset()
    wrong_type = pb.VectorStep(actions=[pack(EchoAction()), pack(Empty()), pack(EchoAction())])
    both = pb.VectorStep(actions=[pack(EchoAction())] * 3, batch_action=pack(EchoAction()))
    garbage = pack(EchoAction())
    garbage.value = b"\xff\xff\xff"
    undecodable = pb.VectorStep(actions=[pack(EchoAction()), pack(EchoAction()), garbage])
    bad = {
        "wrong action count": stream.step(_say("a", "b")),
        "out of range": stream.step(_say("a"), indices=[3]),
        "repeated": stream.step(_say("a", "b"), indices=[1, 1]),
        "out of order": stream.step(_say("a", "b"), indices=[2, 0]),
        "wrong-typed action": stream.send(pb.VectorSessionRequest(step=wrong_type)),
        "undecodable action": stream.send(pb.VectorSessionRequest(step=undecodable)),
        "empty envelope": stream.send(pb.VectorSessionRequest()),
        "batch_action on a loop": stream.step_batch(EchoAction(message="x")),
        "both forms": stream.send(pb.VectorSessionRequest(step=both)),
        "reset count": stream.reset([pb.ResetCommand()] * 2),
        "long episode id": stream.reset([pb.ResetCommand(episode_id="e" * 257)], indices=[0]),
        "wrong-typed options": stream.reset(
            [pb.ResetCommand(options=pack(EchoState()))], indices=[1]
        ),
        "batch observation on a loop": stream.reset(batch=True),
        "unknown answer mode": stream.send(
            pb.VectorSessionRequest(
                step=pb.VectorStep(actions=[pack(EchoAction())] * 3, answer_mode=7)  # type: ignore[arg-type]
            )
        ),
        "state out of range": stream.state([5]),
    }
    for what, response in bad.items():
        assert response.WhichOneof("outcome") == "error", what
        assert response.error.code == INVALID_ARGUMENT, (what, response.error)
    assert "2 actions for 3 envs" in bad["wrong action count"].error.message
    assert "out of range" in bad["out of range"].error.message
    assert "repeated" in bad["repeated"].error.message
    assert "strictly increasing" in bad["out of order"].error.message
    assert "google.protobuf.Empty" in bad["wrong-typed action"].error.message
    assert "env 1" in bad["wrong-typed action"].error.message
    assert "env 2" in bad["undecodable action"].error.message
    assert "empty request" in bad["empty envelope"].error.message
    assert "loop" in bad["batch_action on a loop"].error.message
    assert "256" in bad["long episode id"].error.message
    # Nothing was done by any of them: the envs are where they were.
    after = stream.step(_say("a", "b", "c")).result
    assert list(after.step_counts) == [1, 1, 1] and not after.errors
    stream.close()


def test_an_env_raising_in_one_index_leaves_the_others_answering(start_server) -> None:
    server = start_server("support.envs:FaultyEnv")
    stream = RawVector(server.target, 3)
    stream.reset()
    result = stream.step(_say("fine", "raise", "invalid")).result
    assert list(result.indices) == [0] and _echo(result) == ["fine"]
    assert result.errors[1].code == INTERNAL and "boom in step" in result.errors[1].message
    assert result.errors[1].exception_type == "builtins.RuntimeError"
    assert result.errors[2].code == INVALID_ARGUMENT
    # The broken env needs a reset; the refused one's episode goes on.
    result = stream.step(_say("a", "b", "c")).result
    assert list(result.indices) == [0, 2] and list(result.step_counts) == [2, 1]
    assert result.errors[1].code == FAILED_PRECONDITION and "reset" in result.errors[1].message
    stream.reset(indices=[1])
    result = stream.step(_say("a", "b", "c")).result
    assert list(result.indices) == [0, 1, 2] and list(result.step_counts) == [3, 1, 2]
    # A step before any reset fails for that index only.
    late = RawVector(server.target, 2)
    late.reset(indices=[1])
    result = late.step(_say("a", "b")).result
    assert list(result.indices) == [1]
    assert result.errors[0].code == FAILED_PRECONDITION
    assert "before reset" in result.errors[0].message
    info = server.info()
    assert info.activity.steps == 7
    late.close()
    stream.close()


def test_state_errors_are_per_index(start_server) -> None:
    server = start_server("support.envs:FaultyEnv")
    stream = RawVector(server.target, 2)
    stream.reset()
    stream.step(_say("x", "break-state"))
    states = stream.state().states
    assert list(states.indices) == [0]
    assert states.errors[1].code == INTERNAL and "state is unavailable" in states.errors[1].message
    assert list(stream.step(_say("y", "z")).result.indices) == [0, 1]  # its episode goes on
    stream.close()


def test_pooled_envs_step_in_one_thread_hop_per_batch(start_server) -> None:
    server = start_server("support.envs:ThreadReportingEnv", "--env-threads", "8")
    stream = RawVector(server.target, 8)
    stream.reset()
    for _ in range(3):
        threads = set(_echo(stream.step(_say(*"abcdefgh")).result))
        assert len(threads) == 1, threads  # N envs, one pool thread per vector step
    stream.close()


def test_async_envs_are_gathered(start_server) -> None:
    server = start_server("support.envs:AsyncEchoEnv")
    stream = RawVector(server.target, 4)
    stream.reset()
    result = stream.step(_say("a", "b", "c", "d")).result
    assert _echo(result) == ["a", "b", "c", "d"] and list(result.rewards) == [1, 1, 1, 1]
    stream.close()
    server.wait_until(lambda: server.closed_envs() == 4)


# -- sizes ----------------------------------------------------------------------------------


def test_a_batch_over_the_message_limit_is_answered_in_band_naming_the_limit(start_server) -> None:
    server = start_server("support.envs:FaultyEnv", "--max-message-bytes", "100000")
    stream = RawVector(server.target, 4, options=[("grpc.max_send_message_length", 1 << 22)])
    stream.reset()
    # 4 x 30 kB observations: each fits, the batch does not.
    too_big = stream.step(_say(*["big:30000"] * 4))
    assert too_big.error.code == RESOURCE_EXHAUSTED
    message = too_big.error.message
    assert "100000 bytes (--max-message-bytes)" in message and "fewer envs" in message
    assert "took effect" in message
    result = stream.step(_say("big:30000", "b", "c", "d"), indices=[]).result  # goes on
    assert list(result.step_counts) == [2, 2, 2, 2]
    # A request over the limit ends the stream, with the limit in the status.
    with pytest.raises(grpc.RpcError) as ended:
        stream.step(_say(*["x" * 40000] * 4))
    assert ended.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "100000" in (ended.value.details() or "")
    server.wait_until(lambda: server.active() == 0 and server.closed_envs() == 4)


# -- autoreset on the generic loop ----------------------------------------------------------

#: Env i truncates after i + 1 steps; its reset observation says "new i".
RESETS = [
    pb.ResetCommand(options=pack(EchoResetOptions(max_steps=i + 1, greeting=f"new {i}")))
    for i in range(3)
]


def _row(result: pb.VectorResult, index: int) -> dict[str, object]:
    r = list(result.indices).index(index)
    row: dict[str, object] = {
        "obs": _echo(result)[r],
        "reward": round(result.rewards[r], 3),
        "trunc": result.truncated[r],
        "steps": result.step_counts[r],
        "auto": bool(result.autoreset) and result.autoreset[r],
    }
    if result.final_observations:
        finals = [i for i, a in zip(result.indices, result.autoreset, strict=True) if a]
        if index in finals:
            value = result.final_observations[finals.index(index)].value
            row["final"] = EchoObservation.FromString(value).echoed_message
    return row


def _play(server, mode: str) -> list[dict[int, object]]:  # type: ignore[no-untyped-def]
    stream = RawVector(server.target, 3, mode)
    stream.reset(RESETS)
    table = []
    for t in range(3):
        result = stream.step(_say(f"a{t}", f"b{t}", f"c{t}")).result
        row: dict[int, object] = {i: _row(result, i) for i in result.indices}
        row.update({i: f"error {e.code}" for i, e in result.errors.items()})
        table.append(row)
    stream.close()
    return table


def test_next_step_autoreset_resets_on_the_step_after_the_end(server) -> None:
    def step(obs: str, trunc: bool, steps: int) -> dict[str, object]:
        return {"obs": obs, "reward": round(0.1 * len(obs), 3), "trunc": trunc,
                "steps": steps, "auto": False}  # fmt: skip

    def auto(i: int) -> dict[str, object]:
        return {"obs": f"new {i}", "reward": 0.0, "trunc": False, "steps": 0, "auto": True}

    assert _play(server, "next_step") == [
        {0: step("a0", True, 1), 1: step("b0", False, 1), 2: step("c0", False, 1)},
        {0: auto(0), 1: step("b1", True, 2), 2: step("c1", False, 2)},
        # env 0's new episode keeps its options: truncated again after one step
        {0: step("a2", True, 1), 1: auto(1), 2: step("c2", True, 3)},
    ]


def test_same_step_autoreset_resets_at_once_and_keeps_the_final_observation(server) -> None:
    def step(obs: str, steps: int) -> dict[str, object]:
        return {"obs": obs, "reward": round(0.1 * len(obs), 3), "trunc": False,
                "steps": steps, "auto": False}  # fmt: skip

    def ended(i: int, last: str) -> dict[str, object]:
        return {"obs": f"new {i}", "reward": 0.2, "trunc": True, "steps": 0, "auto": True,
                "final": last}  # fmt: skip

    assert _play(server, "same_step") == [
        {0: ended(0, "a0"), 1: step("b0", 1), 2: step("c0", 1)},
        {0: ended(0, "a1"), 1: ended(1, "b1"), 2: step("c1", 2)},
        {0: ended(0, "a2"), 1: step("b2", 1), 2: ended(2, "c2")},
    ]


def test_disabled_autoreset_refuses_an_ended_env_until_it_is_reset(server) -> None:
    table = _play(server, "disabled")
    assert table[0][0] == {"obs": "a0", "reward": 0.2, "trunc": True, "steps": 1, "auto": False}
    assert table[1][0] == f"error {FAILED_PRECONDITION}"
    assert table[2][0] == table[2][1] == f"error {FAILED_PRECONDITION}"
    assert table[2][2] == {"obs": "c2", "reward": 0.2, "trunc": True, "steps": 3, "auto": False}
