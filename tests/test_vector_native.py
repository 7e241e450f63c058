"""An env's native batch (``Environment.make_batch``) serving VectorSession streams: in
batch form (one action and one observation message for all envs) and to per-env clients
(through ``join_actions`` / ``split_observation``), with the same answers as the server's
loop over plain instances, its own autoreset, and its errors per index or per request."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from openenv_grpc import EnvError
from openenv_grpc_envs.echo import EchoAction, EchoResetOptions, EchoVectorEnv
from support.raw_vector import RawVector

NATIVE = "support.envs:BatchingEchoEnv"
N = 4


def _say(*messages: str) -> list[EchoAction]:
    return [EchoAction(message=m) for m in messages]


def _rows(outcome: Any) -> list[str]:
    """Each row's echoed message, whichever form the answer came in."""
    if outcome.batch_observation is not None:
        text: str = outcome.batch_observation.echoed_message
        return text.split("\n") if outcome.indices else []
    return [o.echoed_message for o in outcome.observations]


def _finals(outcome: Any) -> list[str]:
    if outcome.batch_final_observation is not None:
        return list(outcome.batch_final_observation.echoed_message.split("\n"))
    finals = outcome.final_observations
    return [finals[index].echoed_message for index in sorted(finals)]


def _trajectory(target: str, mode: str, batch: bool) -> list[tuple[Any, ...]]:
    """Five steps of four envs whose episodes end after 1..4 steps, as seen by a client."""
    seen: list[tuple[Any, ...]] = []
    with EchoVectorEnv(target, N, autoreset=mode) as envs:
        options = [EchoResetOptions(max_steps=i + 1, greeting=f"new {i}") for i in range(N)]
        first = envs.reset(options=options, batch=batch)
        seen.append((first.indices, _rows(first), first.step_counts))
        for t in range(5):
            messages = [f"m{t}{i}" for i in range(N)]
            if batch:
                out = envs.step_batch(EchoAction(message="\n".join(messages)))
            else:
                out = envs.step(_say(*messages))
            seen.append((
                out.indices, _rows(out), [round(r, 3) for r in out.rewards], out.truncated,
                out.step_counts, out.autoreset, _finals(out),
            ))  # fmt: skip
    return seen


@pytest.mark.parametrize("mode", ["next_step", "same_step"])
def test_native_batch_answers_as_the_loop_does_in_either_form(start_server, mode: str) -> None:
    native = start_server(NATIVE)
    loop = start_server("support.envs:CountingEchoEnv")
    expected = _trajectory(loop.target, mode, batch=False)
    assert _trajectory(native.target, mode, batch=False) == expected  # per-env client
    assert _trajectory(native.target, mode, batch=True) == expected  # batch form
    native.wait_until(lambda: native.closed_envs() == 2 * N and native.active() == 0)


def test_info_and_headers_say_native(start_server) -> None:
    server = start_server(NATIVE)
    assert server.info().vector.native_batch
    with EchoVectorEnv(server.target, N) as envs:
        assert envs.native
        assert server.created() == N  # the batch made its N envs, recorded each
    with EchoVectorEnv(server.target, 9) as big:  # make_batch gave None: the server loops
        assert not big.native
        big.reset()
        with pytest.raises(EnvError) as refused:
            big.step_batch(EchoAction(message="x"))
        assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
    refusal = RawVector(server.target, 13).refusal()
    assert refusal.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "bad luck" in (refusal.details() or "")
    server.wait_until(lambda: server.active() == 0 and server.closed_envs() == N + 9)


def test_native_errors_per_index_and_per_request(start_server) -> None:
    server = start_server(NATIVE, "--max-message-bytes", "4000")
    with EchoVectorEnv(server.target, 3, autoreset="disabled") as envs:
        envs.reset(batch=True)
        out = envs.step_batch(EchoAction(message="fine\nraise\ninvalid"))
        assert out.indices == [0] and _rows(out) == ["fine"]
        assert out.errors[1].code is grpc.StatusCode.INTERNAL
        assert "boom in the batch" in out.errors[1].message
        assert out.errors[2].code is grpc.StatusCode.INVALID_ARGUMENT
        # A batch-form action must be able to step every env named: env 1 needs a reset.
        with pytest.raises(EnvError) as blocked:
            envs.step_batch(EchoAction(message="a\nb\nc"))
        assert blocked.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert "env 1" in blocked.value.message
        # Per-env actions: only env 1 answers its error, the others step.
        out = envs.step(_say("a", "b", "c"))
        assert out.indices == [0, 2] and out.step_counts == [2, 1]
        assert out.errors[1].code is grpc.StatusCode.FAILED_PRECONDITION
        # What the batch refuses as a whole is refused as a whole, nothing stepped.
        envs.reset(indices=[1])
        with pytest.raises(EnvError) as rows:
            envs.step_batch(EchoAction(message="only\ntwo"))
        assert rows.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert "2 rows for 3 envs" in rows.value.message
        with pytest.raises(EnvError) as joined:
            envs.step(_say("new\nline", "x"), indices=[0, 2])
        assert joined.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert "newline" in joined.value.message
        assert envs.step_batch(EchoAction(message="p\nq\nr")).step_counts == [3, 1, 2]
        assert envs.state(0).total_length == len("fine") + 2
        # An answer over the message limit is refused in-band, naming it; the step happened.
        # (The request fits: the answer adds the episode ids and the columns.)
        with pytest.raises(EnvError) as huge:
            envs.step_batch(EchoAction(message="\n".join(["x" * 1290] * 3)))
        assert huge.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "4000 bytes" in huge.value.message
        assert envs.step(_say("a", "b", "c")).step_counts == [5, 3, 4]
