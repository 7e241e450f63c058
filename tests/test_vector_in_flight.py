"""Several requests in flight on one VectorSession stream, over raw gRPC: answered as each
completes (matched by request id), an env held by a request in flight refused in-band,
the cap on requests in flight (``--max-vector-in-flight``), a close after the requests in
flight, and ``--isolated`` blocks of different requests stepping at the same time.

Concurrency is shown by events (an env call held at a gate, a test opening it), never by
a clock."""

from __future__ import annotations

import queue
import signal
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest

from openenv_grpc.codec import pack
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc
from openenv_grpc_envs.echo import EchoAction, EchoObservation
from support.raw_vector import open_metadata

FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


class Pipe:
    """A VectorSession stream whose requests are sent without waiting for answers."""

    def __init__(self, target: str, num_envs: int, autoreset: str | None = None) -> None:
        self.channel = grpc.insecure_channel(target)
        self._queue: queue.SimpleQueue[pb.VectorSessionRequest | None] = queue.SimpleQueue()
        stub = pb_grpc.EnvServiceStub(self.channel)
        self.call = stub.VectorSession(
            self._requests(), metadata=open_metadata(num_envs, autoreset)
        )
        self._next_id = 1

    def _requests(self) -> Iterator[pb.VectorSessionRequest]:
        while (request := self._queue.get()) is not None:
            yield request

    def submit(self, request: pb.VectorSessionRequest) -> int:
        """Send ``request`` with a fresh id; returns the id (the answer is not awaited)."""
        request.request_id = self._next_id
        self._next_id += 1
        self._queue.put(request)
        return request.request_id

    def step(self, messages: Sequence[str], indices: Sequence[int] = ()) -> int:
        actions = [pack(EchoAction(message=m)) for m in messages]
        return self.submit(
            pb.VectorSessionRequest(step=pb.VectorStep(indices=indices, actions=actions))
        )

    def reset(self, indices: Sequence[int] = ()) -> int:
        return self.submit(pb.VectorSessionRequest(reset=pb.VectorReset(indices=indices)))

    def answer(self) -> pb.VectorSessionResponse:
        """The next answer (notices skipped)."""
        while True:
            response: pb.VectorSessionResponse = next(self.call)
            if response.request_id:
                return response

    def roundtrip(self, request_id: int) -> pb.VectorSessionResponse:
        response = self.answer()
        assert response.request_id == request_id, response
        return response

    def end(self) -> None:
        self._queue.put(None)
        self.channel.close()


def _echoed(result: pb.VectorResult) -> list[str]:
    return [EchoObservation.FromString(o.value).echoed_message for o in result.observations]


def _entered(gate: Path) -> bool:
    return Path(f"{gate}.entered").exists()


def _reset_all(pipe: Pipe) -> None:
    answer = pipe.roundtrip(pipe.reset())
    assert answer.WhichOneof("outcome") == "result", answer


def test_an_env_in_flight_is_refused_and_answers_come_as_each_completes(
    start_server, tmp_path: Path
) -> None:
    server = start_server("support.envs:FaultyEnv")
    pipe = Pipe(server.target, 3, "disabled")
    try:
        _reset_all(pipe)
        gate = tmp_path / "gate"
        held = pipe.step([f"gate:{gate}"], [0])
        server.wait_until(lambda: _entered(gate), what="env 0 at the gate")
        # Env 0 is held by the step in flight: refused, answered before that step.
        again = pipe.step(["again"], [0])
        refused = pipe.answer()
        assert refused.request_id == again
        assert refused.error.code == FAILED_PRECONDITION
        assert refused.error.message == (
            f"env 0 (request {held}) still in flight: a request may name only envs that no "
            "request in flight names; wait for its answer (nothing was done)"
        )
        # All envs (no indices) name env 0 too; a reset as well as a step.
        everything = pipe.step(["a", "b", "c"])
        assert pipe.roundtrip(everything).error.code == FAILED_PRECONDITION
        reset = pipe.reset([0, 2])
        answer = pipe.roundtrip(reset)
        assert answer.error.code == FAILED_PRECONDITION
        assert f"env 0 (request {held})" in answer.error.message
        # A step on other envs is taken in flight; its answer follows the held one's.
        other = pipe.step(["one", "two"], [1, 2])
        gate.touch()
        first, second = pipe.answer(), pipe.answer()
        assert {first.request_id, second.request_id} == {held, other}
        by_id = {first.request_id: first, second.request_id: second}
        assert _echoed(by_id[held].result) == [f"gate:{gate}"]
        assert list(by_id[held].result.indices) == [0]
        assert list(by_id[held].result.step_counts) == [1]
        assert _echoed(by_id[other].result) == ["one", "two"]
        assert list(by_id[other].result.step_counts) == [1, 1]
        # Nothing was lost: the refused requests did nothing, env 0 stepped once.
        after = pipe.roundtrip(pipe.step(["x", "y", "z"]))
        assert list(after.result.step_counts) == [2, 2, 2]
        closed = pipe.roundtrip(pipe.submit(pb.VectorSessionRequest(close=pb.CloseCommand())))
        assert closed.WhichOneof("outcome") == "closed"
    finally:
        pipe.end()
    server.wait_until(lambda: server.active() == 0 and server.closed_envs() == 3)


def test_past_the_cap_a_request_is_resource_exhausted_and_the_stream_goes_on(
    start_server, tmp_path: Path
) -> None:
    server = start_server("support.envs:FaultyEnv", "--max-vector-in-flight", "2")
    pipe = Pipe(server.target, 3, "disabled")
    try:
        _reset_all(pipe)
        gate = tmp_path / "gate"
        held = pipe.step([f"gate:{gate}"], [0])
        server.wait_until(lambda: _entered(gate), what="env 0 at the gate")
        waiting = pipe.step(["behind"], [1])  # in flight (behind env 0's batch call)
        over = pipe.step(["over"], [2])
        refused = pipe.answer()
        assert refused.request_id == over
        assert refused.error.code == RESOURCE_EXHAUSTED
        assert refused.error.message == (
            "2 requests already in flight on this stream, the most this server allows "
            "(--max-vector-in-flight, MAX_VECTOR_IN_FLIGHT = 2): wait for an answer before "
            "sending more; nothing was done, the stream goes on"
        )
        gate.touch()
        answers = {pipe.answer().request_id, pipe.answer().request_id}
        assert answers == {held, waiting}
        # Env 2 was never stepped; the stream goes on.
        after = pipe.roundtrip(pipe.step(["x", "y", "z"]))
        assert list(after.result.step_counts) == [2, 2, 1]
        assert server.active() == 3
    finally:
        pipe.end()
    server.wait_until(lambda: server.active() == 0 and server.closed_envs() == 3)


def test_a_close_waits_for_the_requests_in_flight(start_server, tmp_path: Path) -> None:
    server = start_server("support.envs:FaultyEnv")
    pipe = Pipe(server.target, 2, "disabled")
    try:
        _reset_all(pipe)
        gate = tmp_path / "gate"
        held = pipe.step([f"gate:{gate}"], [0])
        server.wait_until(lambda: _entered(gate), what="env 0 at the gate")
        close = pipe.submit(pb.VectorSessionRequest(close=pb.CloseCommand()))
        late = pipe.step(["late"], [1])
        refused = pipe.answer()  # the close is under way: what follows it is refused
        assert refused.request_id == late
        assert refused.error.code == FAILED_PRECONDITION
        assert refused.error.message == (
            f"the stream is closing (request {close} closes it): nothing was done"
        )
        assert server.closed_envs() == 0  # the close waits for env 0's step
        gate.touch()
        stepped = pipe.roundtrip(held)
        assert _echoed(stepped.result) == [f"gate:{gate}"]
        closed = pipe.roundtrip(close)
        assert closed.WhichOneof("outcome") == "closed"
        with pytest.raises(StopIteration):
            next(pipe.call)  # nothing follows the close's answer
        assert pipe.call.code() is grpc.StatusCode.OK
    finally:
        pipe.end()
    server.wait_until(lambda: server.active() == 0 and server.closed_envs() == 2)


def test_after_a_half_close_the_requests_in_flight_are_answered(
    start_server, tmp_path: Path
) -> None:
    server = start_server("support.envs:FaultyEnv")
    pipe = Pipe(server.target, 2, "disabled")
    try:
        _reset_all(pipe)
        gate = tmp_path / "gate"
        held = pipe.step([f"gate:{gate}"], [0])
        server.wait_until(lambda: _entered(gate), what="env 0 at the gate")
        pipe._queue.put(None)  # half-close with a step in flight
        gate.touch()
        assert _echoed(pipe.roundtrip(held).result) == [f"gate:{gate}"]
        with pytest.raises(StopIteration):
            next(pipe.call)
        assert pipe.call.code() is grpc.StatusCode.OK
    finally:
        pipe.end()
    server.wait_until(lambda: server.active() == 0 and server.closed_envs() == 2)


def test_a_stream_with_a_request_in_flight_is_not_idle(start_server, tmp_path: Path) -> None:
    server = start_server("support.envs:FaultyEnv", "--idle-timeout", "0.3")
    pipe = Pipe(server.target, 2, "disabled")
    try:
        _reset_all(pipe)
        gate = tmp_path / "gate"
        held = pipe.step([f"gate:{gate}"], [0])
        server.wait_until(lambda: _entered(gate), what="env 0 at the gate")
        # A request answered meanwhile on env 1 (queued behind env 0's call) does not
        # make the stream idle either: one is still in flight.
        other = pipe.step(["other"], [1])
        # A witness opened now and left idle: once the reaper has ended it, the reaper
        # has swept past the timeout with this stream's request in flight.
        witness = Pipe(server.target, 1, "disabled")
        try:
            with pytest.raises(grpc.RpcError) as reaped:
                witness.answer()
            assert reaped.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            witness.end()
        server.wait_until(lambda: server.active() < 3, what="the witness's slot back")
        assert server.active() == 2, "the stream with a request in flight was reaped as idle"
        gate.touch()
        answers = {pipe.answer().request_id, pipe.answer().request_id}
        assert answers == {held, other}
        # Idle now: the reaper ends it.
        with pytest.raises(grpc.RpcError) as ended:
            pipe.answer()
        assert ended.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        pipe.end()
    # The stream's 2 envs and the witness's 1.
    server.wait_until(lambda: server.active() == 0 and server.closed_envs() == 3)


def test_a_hung_call_refuses_the_call_that_waited_behind_it(start_server, tmp_path: Path) -> None:
    server = start_server("support.envs:FaultyEnv", "--step-timeout", "0.5")
    pipe = Pipe(server.target, 2, "disabled")
    try:
        _reset_all(pipe)
        gate = tmp_path / "gate"
        hung = pipe.step([f"gate:{gate}"], [0])
        server.wait_until(lambda: _entered(gate), what="env 0 at the gate")
        behind = pipe.step(["behind"], [1])
        first = pipe.roundtrip(hung)
        assert first.error.code == DEADLINE_EXCEEDED
        assert "step did not finish within 0.5s" in first.error.message
        second = pipe.roundtrip(behind)
        assert second.error.code == FAILED_PRECONDITION
        assert second.error.message.startswith(
            "step not done: a call before it on this stream did not finish in time and "
        )
        gate.touch()
        # Both envs are fresh: they need a reset, then step from 0.
        again = pipe.roundtrip(pipe.step(["x", "y"]))
        assert set(again.result.errors) == {0, 1}
        assert all(e.code == FAILED_PRECONDITION for e in again.result.errors.values())
        _reset_all(pipe)
        after = pipe.roundtrip(pipe.step(["x", "y"]))
        assert list(after.result.step_counts) == [1, 1]
    finally:
        pipe.end()
    # The hung batch is closed once its call returns (the gate is open): no env leaks.
    server.wait_until(lambda: server.active() == 0 and server.closed_envs() == 4)


def test_isolated_blocks_of_two_requests_step_at_the_same_time(
    start_server, tmp_path: Path
) -> None:
    server = start_server("support.envs:FaultyEnv", "--isolated", "2")
    pipe = Pipe(server.target, 4, "disabled")
    try:
        _reset_all(pipe)
        pids = _echoed(pipe.roundtrip(pipe.step(["pid"] * 4)).result)
        assert pids[0] == pids[1] != pids[2] == pids[3]  # blocks 0..1 and 2..3
        # Env 0 (block one) and env 2 (block two) meet: neither answers until both run.
        meeting = tmp_path / "meeting"
        meeting.mkdir()
        one = pipe.step([f"meet:{meeting}:2"], [0])
        two = pipe.step([f"meet:{meeting}:2"], [2])
        answers = {}
        for _ in range(2):
            answer = pipe.answer()
            answers[answer.request_id] = answer
        assert set(answers) == {one, two}
        for answer in answers.values():
            assert answer.WhichOneof("outcome") == "result", answer
            assert not answer.result.errors
        # Within one block, a second request on another env waits its turn and answers.
        gate = tmp_path / "gate"
        held = pipe.step([f"gate:{gate}"], [0])
        server.wait_until(lambda: _entered(gate), what="env 0 at the gate")
        same_block = pipe.step(["same"], [1])
        other_block = pipe.step(["other"], [3])
        assert _echoed(pipe.roundtrip(other_block).result) == ["other"]
        gate.touch()
        assert {pipe.answer().request_id, pipe.answer().request_id} == {held, same_block}
        after = pipe.roundtrip(pipe.step(["a", "b", "c", "d"]))
        assert list(after.result.step_counts) == [4, 3, 3, 3]
    finally:
        pipe.end()
    server.wait_until(lambda: server.active() == 0 and server.closed_envs() == 4)


def test_a_lost_block_is_rebuilt_once_for_two_requests_in_flight(
    start_server, tmp_path: Path
) -> None:
    server = start_server("support.envs:FaultyEnv", "--isolated", "2")
    pipe = Pipe(server.target, 4, "disabled")
    try:
        _reset_all(pipe)
        gate = tmp_path / "gate"
        first = pipe.step([f"gate:{gate}"], [0])
        server.wait_until(lambda: _entered(gate), what="env 0 at the gate")
        second = pipe.step(["exit"], [1])  # queued behind env 0 in the same process
        neighbour = pipe.step(["fine"], [2])
        assert _echoed(pipe.roundtrip(neighbour).result) == ["fine"]
        gate.touch()  # env 0 answers, then env 1 kills its process
        answers = {}
        for _ in range(2):
            answer = pipe.answer()
            answers[answer.request_id] = answer
        assert _echoed(answers[first].result) == [f"gate:{gate}"]
        lost = answers[second].result.errors[1]
        assert lost.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert "a fresh environment took this one's place: reset it" in lost.message
        # Env 1 needs a reset (a fresh env took its place); then every env steps.
        again = pipe.roundtrip(pipe.step(["x"] * 4))
        assert again.result.errors[1].code == FAILED_PRECONDITION
        _reset_all(pipe)
        after = pipe.roundtrip(pipe.step(["x"] * 4))
        assert list(after.result.indices) == [0, 1, 2, 3] and not after.result.errors
    finally:
        pipe.end()
    server.wait_until(lambda: server.active() == 0, what="every slot back")


def test_a_drain_notice_goes_between_the_answers_of_requests_in_flight(
    start_server, tmp_path: Path
) -> None:
    server = start_server("support.envs:FaultyEnv", "--grace", "30")
    pipe = Pipe(server.target, 2, "disabled")
    try:
        _reset_all(pipe)
        gate = tmp_path / "gate"
        held = pipe.step([f"gate:{gate}"], [0])
        server.wait_until(lambda: _entered(gate), what="env 0 at the gate")
        server.proc.send_signal(signal.SIGTERM)
        notice = next(pipe.call)  # written while a step is in flight: not behind it
        assert notice.request_id == 0 and notice.notice.kind == pb.NOTICE_KIND_DRAINING
        other = pipe.step(["during grace"], [1])
        gate.touch()
        answers = {pipe.answer().request_id, pipe.answer().request_id}
        assert answers == {held, other}
        closed = pipe.roundtrip(pipe.submit(pb.VectorSessionRequest(close=pb.CloseCommand())))
        assert closed.WhichOneof("outcome") == "closed"
    finally:
        pipe.end()
    assert server.proc.wait(30) == 0
    assert server.closed_envs() == 2 and server.open_envs() == 0


def test_an_undecodable_request_ends_the_stream_with_requests_in_flight(
    start_server, tmp_path: Path
) -> None:
    server = start_server("support.envs:FaultyEnv")
    channel = grpc.insecure_channel(server.target)
    requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()

    def raw() -> Iterator[bytes]:
        while (item := requests.get()) is not None:
            yield item

    call = channel.stream_stream(
        "/openenv_grpc.v1.EnvService/VectorSession",
        request_serializer=None,
        response_deserializer=pb.VectorSessionResponse.FromString,
    )(raw(), metadata=open_metadata(2, "disabled"))
    try:
        requests.put(
            pb.VectorSessionRequest(request_id=1, reset=pb.VectorReset()).SerializeToString()
        )
        assert next(call).request_id == 1
        gate = tmp_path / "gate"
        step = pb.VectorStep(indices=[0], actions=[pack(EchoAction(message=f"gate:{gate}"))])
        requests.put(pb.VectorSessionRequest(request_id=2, step=step).SerializeToString())
        server.wait_until(lambda: _entered(gate), what="env 0 at the gate")
        requests.put(b"\xff\xff\xff")  # not a VectorSessionRequest
        with pytest.raises(grpc.RpcError) as ended:
            next(call)
        assert ended.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert (
            "request is not a valid openenv_grpc.v1.VectorSessionRequest" in ended.value.details()
        )
        gate.touch()
    finally:
        requests.put(None)
        channel.close()
    # The env at the gate is closed once its call returns; nothing leaks.
    server.wait_until(lambda: server.active() == 0 and server.closed_envs() == 2)


def test_steps_in_flight_are_counted_once_each(start_server, tmp_path: Path) -> None:
    server = start_server("support.envs:FaultyEnv")
    pipe = Pipe(server.target, 4, "disabled")
    try:
        _reset_all(pipe)
        sent = [pipe.step(["a", "b"], [0, 1]), pipe.step(["c", "d"], [2, 3])]
        assert {pipe.answer().request_id for _ in sent} == set(sent)
        after = pipe.roundtrip(pipe.step(["w", "x", "y", "z"]))
        assert list(after.result.step_counts) == [2, 2, 2, 2]
        # A refused request steps nothing and is counted as an error, not as steps.
        gate = tmp_path / "gate"
        held = pipe.step([f"gate:{gate}"], [0])
        server.wait_until(lambda: _entered(gate), what="env 0 at the gate")
        assert pipe.roundtrip(pipe.step(["no"], [0])).error.code == FAILED_PRECONDITION
        gate.touch()
        assert pipe.roundtrip(held).result.step_counts == [3]
        assert server.info().activity.steps == 9
    finally:
        pipe.end()
    server.wait_until(lambda: server.active() == 0)
