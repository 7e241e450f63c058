"""Bad input on the wire, sent through the raw generated stub with hand-built envelopes.

Every per-request failure must come back in-band as an ``Error`` carrying the request's
id, leave the offending session usable, and never disturb a neighbouring session on the
same server. Frames gRPC itself refuses (undecodable bytes, oversize messages) end only
their own stream. Each test ends with the server's books balanced: no active session,
every env created also closed.
"""

from __future__ import annotations

import queue
import random

import grpc
import pytest
from google.protobuf import any_pb2

from openenv_grpc.metadata import ADMITTED_KEY
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc
from openenv_grpc_envs.echo import (
    EchoAction,
    EchoEnv,
    EchoObservation,
    EchoResetOptions,
    EchoState,
)

pytestmark = [pytest.mark.timeout(20), pytest.mark.shared_server]

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
INTERNAL = grpc.StatusCode.INTERNAL.value[0]

PREFIX = "type.googleapis.com/"
ACTION = "openenv_grpc_envs.echo.v1.EchoAction"
RESET_OPTIONS = "openenv_grpc_envs.echo.v1.EchoResetOptions"
SESSION_METHOD = "/openenv_grpc.v1.EnvService/Session"


# -- helpers --------------------------------------------------------------------------


class RawSession:
    """One Session stream on the generated stub: one hand-built request, one response."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._requests: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
        stub = pb_grpc.EnvServiceStub(channel)
        self.call = stub.Session(iter(self._requests.get, None), timeout=30)
        assert ADMITTED_KEY in dict(self.call.initial_metadata()), "session not admitted"

    def send(self, request: pb.SessionRequest) -> pb.SessionResponse:
        self._requests.put(request)
        return next(self.call)

    def error(self, request: pb.SessionRequest) -> pb.Error:
        """Send ``request``; assert the answer is an in-band error for it, return that."""
        response = self.send(request)
        assert response.request_id == request.request_id
        assert response.WhichOneof("outcome") == "error", response
        return response.error

    def result(self, request: pb.SessionRequest) -> pb.StepResult:
        response = self.send(request)
        assert response.request_id == request.request_id
        assert response.WhichOneof("outcome") == "result", response
        return response.result

    def close(self, request_id: int = 999) -> None:
        response = self.send(pb.SessionRequest(request_id=request_id, close=pb.CloseCommand()))
        assert response.request_id == request_id
        assert response.WhichOneof("outcome") == "closed"
        self._requests.put(None)
        with pytest.raises(StopIteration):
            next(self.call)
        assert self.call.code() is grpc.StatusCode.OK


def reset(
    request_id: int, options: any_pb2.Any | None = None, **fields: object
) -> pb.SessionRequest:
    request = pb.SessionRequest(request_id=request_id, reset=pb.ResetCommand(**fields))
    request.reset.SetInParent()
    if options is not None:
        request.reset.options.CopyFrom(options)
    return request


def step(request_id: int, message: str) -> pb.SessionRequest:
    request = pb.SessionRequest(request_id=request_id)
    request.step.action.Pack(EchoAction(message=message))
    return request


def raw_step(request_id: int, type_url: str, value: bytes) -> pb.SessionRequest:
    request = pb.SessionRequest(request_id=request_id)
    request.step.action.type_url = type_url
    request.step.action.value = value
    return request


def packed(message: object) -> any_pb2.Any:
    payload = any_pb2.Any()
    payload.Pack(message)  # type: ignore[arg-type]
    return payload


class Neighbour:
    """A well-behaved session opened first; ``check()`` steps it and verifies the echo."""

    def __init__(self, target: str, *, full_echo: bool = True) -> None:
        #: The echo env reports lengths and history; FaultyEnv only echoes the message.
        self.full_echo = full_echo
        self.env = EchoEnv(target)
        self.env.open()
        first = self.env.reset(episode_id="neighbour")
        assert first.step_count == 0
        self.steps = 0

    def check(self) -> None:
        self.steps += 1
        message = f"neighbour step {self.steps}"
        result = self.env.step(EchoAction(message=message))
        assert result.observation.echoed_message == message
        if self.full_echo:
            assert result.observation.message_length == len(message)
        assert result.step_count == self.steps
        assert result.episode_id == "neighbour"
        assert not result.done

    def close(self) -> None:
        self.check()
        if self.full_echo:
            assert list(self.env.state().history) == [
                f"neighbour step {i}" for i in range(1, self.steps + 1)
            ]
        self.env.close()


def assert_books_balanced(server) -> None:  # type: ignore[no-untyped-def]
    server.wait_until(lambda: server.active() == 0, what="no active session")
    server.wait_until(
        lambda: server.created() == server.closed_envs(), what="every created env closed"
    )
    assert server.open_envs() == 0
    assert server.proc.poll() is None, "server process died"
    assert server.health() == 1  # SERVING


@pytest.fixture
def channel(server):  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(server.target) as channel:
        yield channel


# -- in-band request errors -----------------------------------------------------------


def test_empty_envelope_is_invalid_argument_with_request_id(server, channel) -> None:
    neighbour = Neighbour(server.target)
    session = RawSession(channel)
    # Before any reset, and with the edge request ids 0 and 2**64-1.
    for request_id in (0, 7, 2**64 - 1):
        error = session.error(pb.SessionRequest(request_id=request_id))
        assert error.code == INVALID_ARGUMENT
        assert (
            error.message
            == "empty request: set one of reset, step, state, close, snapshot, restore, render"
        )
        assert error.exception_type == ""
        neighbour.check()
    assert session.result(reset(8)).step_count == 0
    error = session.error(pb.SessionRequest(request_id=9))
    assert error.code == INVALID_ARGUMENT
    neighbour.check()
    # The session is still usable and the empty envelopes never counted as steps.
    result = session.result(step(10, "after empties"))
    assert result.step_count == 1
    session.close()
    neighbour.close()
    assert_books_balanced(server)


def test_wrong_or_unknown_action_type_url_is_invalid_argument(server, channel) -> None:
    neighbour = Neighbour(server.target)
    session = RawSession(channel)
    session.result(reset(1))
    assert session.result(step(2, "one")).step_count == 1
    cases = [
        # Another known type.
        packed(EchoState(total_length=3)),
        # The reset-options type where an action belongs.
        packed(EchoResetOptions(stop_word="x")),
        # A type nobody has heard of, with arbitrary bytes.
        any_pb2.Any(type_url=PREFIX + "no.such.Message", value=b"\x01\x02"),
        any_pb2.Any(type_url="example.com/x/y.Z", value=b""),
        # The right name, but not as the url's last path segment.
        any_pb2.Any(type_url=f"example.com/{ACTION}/v2", value=b""),
        any_pb2.Any(type_url=ACTION, value=b""),
    ]
    for request_id, payload in enumerate(cases, start=100):
        request = pb.SessionRequest(request_id=request_id)
        request.step.action.CopyFrom(payload)
        error = session.error(request)
        assert error.code == INVALID_ARGUMENT
        # Both the expected type and the url exactly as received.
        assert error.message == f"action must be {ACTION}, got {payload.type_url!r}"
        assert error.exception_type == ""
        neighbour.check()
    # The episode went on: the refused actions were not steps.
    result = session.result(step(200, "two"))
    assert (result.step_count, result.observation.type_url) == (
        2,
        PREFIX + "openenv_grpc_envs.echo.v1.EchoObservation",
    )
    session.close()
    neighbour.close()
    assert_books_balanced(server)


def test_any_url_whose_last_segment_names_the_type_is_accepted(server, channel) -> None:
    """The protobuf rule for Any: only the url's last path segment names the type, so a
    client in another language may use its own prefix (we always send
    type.googleapis.com/)."""
    neighbour = Neighbour(server.target)
    session = RawSession(channel)
    session.result(reset(1))
    value = EchoAction(message="prefixed").SerializeToString()
    for request_id, url in enumerate(
        [f"example.com/x/{ACTION}", f"/{ACTION}", f"https://types.example/a/b/{ACTION}"],
        start=2,
    ):
        result = session.result(raw_step(request_id, url, value))
        assert result.step_count == request_id - 1
        echoed = EchoObservation.FromString(result.observation.value).echoed_message
        assert echoed == "prefixed"
        # What we send keeps the standard prefix.
        assert result.observation.type_url == PREFIX + "openenv_grpc_envs.echo.v1.EchoObservation"
    options = any_pb2.Any(
        type_url=f"example.com/{RESET_OPTIONS}",
        value=EchoResetOptions(stop_word="halt").SerializeToString(),
    )
    session.result(reset(10, options))
    stopped = session.result(
        raw_step(11, f"example.com/{ACTION}", EchoAction(message="halt").SerializeToString())
    )
    assert stopped.terminated
    session.close()
    neighbour.close()
    assert_books_balanced(server)


def test_garbage_action_bytes_are_invalid_argument(server, channel) -> None:
    neighbour = Neighbour(server.target)
    session = RawSession(channel)
    session.result(reset(1))
    garbage = [
        b"\xff\xff\xff",  # a varint tag that never ends
        b"\x0a\x10ab",  # a length prefix longer than the data
        b"\x0a\x02\xff\xfe",  # a string field that is not UTF-8
        random.Random(1234).randbytes(200),
    ]
    for request_id, value in enumerate(garbage, start=50):
        error = session.error(raw_step(request_id, PREFIX + ACTION, value))
        assert error.code == INVALID_ARGUMENT
        assert error.message.startswith(f"action is not a valid {ACTION}: "), error.message
        assert error.exception_type == ""
        neighbour.check()
    result = session.result(step(60, "fine"))
    assert result.step_count == 1
    session.close()
    neighbour.close()
    assert_books_balanced(server)


def test_missing_action_is_invalid_argument(server, channel) -> None:
    neighbour = Neighbour(server.target)
    session = RawSession(channel)
    session.result(reset(1))
    no_action = pb.SessionRequest(request_id=2)
    no_action.step.SetInParent()  # a step command without its action
    error = session.error(no_action)
    assert (error.code, error.message) == (
        INVALID_ARGUMENT,
        f"action must be {ACTION}, got nothing",
    )
    neighbour.check()
    # Bytes without any type url are no better.
    error = session.error(raw_step(3, "", EchoAction(message="hi").SerializeToString()))
    assert (error.code, error.message) == (
        INVALID_ARGUMENT,
        f"action must be {ACTION}, got nothing",
    )
    neighbour.check()
    assert session.result(step(4, "real")).step_count == 1
    session.close()
    neighbour.close()
    assert_books_balanced(server)


def test_wrong_reset_options_type_is_invalid_argument_and_episode_unchanged(
    server, channel
) -> None:
    neighbour = Neighbour(server.target)
    session = RawSession(channel)
    first = session.result(reset(1, episode_id="kept"))
    session.result(step(2, "a"))
    error = session.error(reset(3, packed(EchoAction(message="x")), episode_id="other"))
    assert error.code == INVALID_ARGUMENT
    assert error.message == f"reset options must be {RESET_OPTIONS}, got {PREFIX + ACTION!r}"
    assert error.exception_type == ""
    neighbour.check()
    error = session.error(reset(4, any_pb2.Any(type_url=PREFIX + RESET_OPTIONS, value=b"\xff\xff")))
    assert error.code == INVALID_ARGUMENT
    assert error.message.startswith(f"reset options is not a valid {RESET_OPTIONS}: ")
    neighbour.check()
    # Neither refused reset happened: the episode and its step count carry on.
    result = session.result(step(5, "b"))
    assert (result.episode_id, result.step_count) == (first.episode_id, 2) == ("kept", 2)
    # Options of the right type are accepted.
    options = packed(EchoResetOptions(greeting="hello again"))
    again = session.result(reset(6, options, episode_id="new"))
    assert (again.episode_id, again.step_count) == ("new", 0)
    session.close()
    neighbour.close()
    assert_books_balanced(server)


def test_step_before_reset_is_failed_precondition(server, channel) -> None:
    neighbour = Neighbour(server.target)
    session = RawSession(channel)
    for request_id in (41, 42):
        error = session.error(step(request_id, "too early"))
        assert error.code == FAILED_PRECONDITION
        assert error.message == "step before reset: call reset first"
        neighbour.check()
    # Said before the action is read: an action of the wrong type gets the same answer.
    wrong = pb.SessionRequest(request_id=40)
    wrong.step.action.CopyFrom(packed(EchoState(total_length=3)))
    error = session.error(wrong)
    assert (error.code, error.message) == (
        FAILED_PRECONDITION,
        "step before reset: call reset first",
    )
    # state() is fine before a reset: empty episode id, no steps.
    response = session.send(pb.SessionRequest(request_id=43, state=pb.StateCommand()))
    assert response.request_id == 43 and response.WhichOneof("outcome") == "state"
    assert (response.state.episode_id, response.state.step_count) == ("", 0)
    assert session.result(reset(44)).step_count == 0
    assert session.result(step(45, "now")).step_count == 1
    session.close()
    neighbour.close()
    assert_books_balanced(server)


def test_step_after_episode_end_is_failed_precondition_until_reset(server, channel) -> None:
    neighbour = Neighbour(server.target)
    session = RawSession(channel)
    session.result(reset(1, packed(EchoResetOptions(stop_word="halt"))))
    end = session.result(step(2, "halt"))
    assert (end.terminated, end.truncated) == (True, False)
    for request_id in (3, 4):
        error = session.error(step(request_id, "more"))
        assert error.code == FAILED_PRECONDITION
        assert error.message == "the episode has terminated: call reset to start a new one"
        neighbour.check()
    session.result(reset(5, packed(EchoResetOptions(max_steps=1))))
    end = session.result(step(6, "only"))
    assert (end.terminated, end.truncated) == (False, True)
    error = session.error(step(7, "more"))
    assert error.code == FAILED_PRECONDITION
    assert error.message == "the episode was truncated: call reset to start a new one"
    neighbour.check()
    session.result(reset(8))
    assert session.result(step(9, "again")).step_count == 1
    session.close()
    neighbour.close()
    assert_books_balanced(server)


def test_env_failures_are_in_band_errors_on_the_wire(start_server) -> None:
    server = start_server("support.envs:FaultyEnv")
    neighbour = Neighbour(server.target, full_echo=False)
    with grpc.insecure_channel(server.target) as channel:
        session = RawSession(channel)
        session.result(reset(1))
        error = session.error(step(2, "raise"))
        assert error.code == INTERNAL
        assert error.message == "step failed: RuntimeError: boom in step"
        assert error.exception_type == "builtins.RuntimeError"
        neighbour.check()
        error = session.error(step(3, "ok"))
        assert error.code == FAILED_PRECONDITION
        assert error.message == "the environment failed during this episode: call reset"
        session.result(reset(4))
        error = session.error(step(5, "invalid"))
        assert (error.code, error.message) == (INVALID_ARGUMENT, "that move is not allowed here")
        assert error.exception_type == "openenv_grpc.environment.InvalidAction"
        assert session.result(step(6, "ok")).step_count == 1
        neighbour.check()
        for request_id, command in ((7, "wrong-type"), (9, "not-transition")):
            error = session.error(step(request_id, command))
            assert error.code == INTERNAL, command
            session.result(reset(request_id + 1))
            neighbour.check()
        session.result(step(11, "break-state"))
        error = session.error(pb.SessionRequest(request_id=12, state=pb.StateCommand()))
        assert error.code == INTERNAL
        assert error.message == "state failed: ValueError: state is unavailable"
        assert error.exception_type == "builtins.ValueError"
        assert session.result(step(13, "still")).step_count == 2
        session.close()
    neighbour.close()
    assert_books_balanced(server)


# -- frames gRPC refuses --------------------------------------------------------------

UNDECODABLE = [
    b"\xff" * 16,  # a varint tag that never ends
    b"\x12\x05\x0a",  # a length prefix longer than the data
    random.Random(7).randbytes(64),
]


def _raw_stream(channel: grpc.Channel, payload: bytes) -> tuple[list[bytes], grpc.RpcError | None]:
    """Open a Session with identity serializers, send ``payload``, read to the end."""
    session = channel.stream_stream(SESSION_METHOD)  # no serializers: bytes in, bytes out
    requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    call = session(iter(requests.get, None), timeout=10)
    assert ADMITTED_KEY in dict(call.initial_metadata())
    requests.put(payload)
    answers: list[bytes] = []
    try:
        for answer in call:
            answers.append(answer)
            requests.put(None)  # one answer is all we wait for: half-close
    except grpc.RpcError as exc:
        return answers, exc
    finally:
        requests.put(None)
    return answers, None


def _assert_undecodable(payload: bytes) -> None:
    try:
        pb.SessionRequest.FromString(payload)
    except Exception:
        return
    raise AssertionError(f"test payload {payload!r} unexpectedly parses")


def test_random_bytes_message_ends_stream_with_invalid_argument(server, channel) -> None:
    for payload in UNDECODABLE:
        _assert_undecodable(payload)
        answers, error = _raw_stream(channel, payload)
        assert answers == []
        assert error is not None, "stream ended OK after an undecodable message"
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
        assert "not a valid openenv_grpc.v1.SessionRequest" in error.details()
    assert_books_balanced(server)


def test_random_bytes_message_leaves_server_healthy_and_neighbour_working(server, channel) -> None:
    neighbour = Neighbour(server.target)
    for payload in UNDECODABLE:
        _assert_undecodable(payload)
        answers, error = _raw_stream(channel, payload)
        assert answers == []  # nothing is answered to an undecodable frame
        assert error is not None
        neighbour.check()
        assert server.proc.poll() is None
        # The stream's env is gone and its slot free; only the neighbour remains.
        server.wait_until(lambda: server.active() == 1, what="bad stream's slot released")
    # Bytes that do parse (an unknown field only) are an ordinary empty envelope.
    answers, error = _raw_stream(channel, b"\xa0\x06\x01")
    assert error is None
    assert len(answers) == 1
    response = pb.SessionResponse.FromString(answers[0])
    assert response.error.code == INVALID_ARGUMENT
    neighbour.check()
    neighbour.close()
    assert_books_balanced(server)


@pytest.fixture
def small_server(start_server):  # type: ignore[no-untyped-def]
    # Room for Info (its FileDescriptorSet) and the reset's tool list, not for 10 KiB.
    return start_server("support.envs:CountingEchoEnv", "--max-message-bytes", "4096")


def test_oversize_request_is_resource_exhausted_and_server_stays_healthy(small_server) -> None:
    server = small_server
    neighbour = Neighbour(server.target)
    with grpc.insecure_channel(server.target) as channel:
        # As the first message of a session, and mid-episode.
        for reset_first in (False, True):
            session = RawSession(channel)
            if reset_first:
                session.result(reset(1))
            request = step(2, "x" * 10 * 1024)
            assert request.ByteSize() > 10 * 1024
            with pytest.raises(grpc.RpcError) as raised:
                session.send(request)
            assert raised.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than max" in (raised.value.details() or "")
            neighbour.check()
            server.wait_until(lambda: server.active() == 1, what="oversize session released")
        # A message just under the limit still goes through on a fresh session.
        session = RawSession(channel)
        session.result(reset(1))
        result = session.result(step(2, "y" * 500))
        assert EchoObservation.FromString(result.observation.value).echoed_message == "y" * 500
        session.close()
    neighbour.close()
    assert_books_balanced(server)


def test_oversize_response_is_an_in_band_error_and_the_session_goes_on(small_server) -> None:
    server = small_server
    neighbour = Neighbour(server.target)
    with grpc.insecure_channel(server.target) as channel:
        session = RawSession(channel)
        session.result(reset(1))
        # The largest message whose request fits the limit; its echo, whose envelope also
        # carries the episode id, the step count and the reward, does not.
        size = max(n for n in range(3800, 4096) if step(2, "z" * n).ByteSize() <= 4096)
        error = session.error(step(2, "z" * size))
        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "over the server's message limit of 4096 bytes (--max-message-bytes)" in (
            error.message
        )
        neighbour.check()
        # The step took effect (its answer was lost); the episode goes on.
        assert session.result(step(3, "small")).step_count == 2
        session.close()
    neighbour.close()
    assert_books_balanced(server)


def test_every_bad_input_in_turn_spares_the_neighbour(start_server) -> None:
    """All of the above against one server: the neighbour steps between each."""
    server = start_server("support.envs:CountingEchoEnv", "--max-message-bytes", "4096")
    neighbour = Neighbour(server.target)
    with grpc.insecure_channel(server.target) as channel:
        session = RawSession(channel)
        bad_requests: list[tuple[pb.SessionRequest, int]] = [
            (step(10, "early"), FAILED_PRECONDITION),
            (pb.SessionRequest(request_id=11), INVALID_ARGUMENT),
            (reset(12, packed(EchoState())), INVALID_ARGUMENT),
        ]
        for request, code in bad_requests:
            assert session.error(request).code == code
            neighbour.check()
        session.result(reset(13))
        no_action = pb.SessionRequest(request_id=16)
        no_action.step.SetInParent()
        bad_requests = [
            (raw_step(14, PREFIX + "no.such.Type", b"\x00"), INVALID_ARGUMENT),
            (raw_step(15, PREFIX + ACTION, b"\xff\xff"), INVALID_ARGUMENT),
            (no_action, INVALID_ARGUMENT),
            (pb.SessionRequest(request_id=17), INVALID_ARGUMENT),
        ]
        for request, code in bad_requests:
            assert session.error(request).code == code
            neighbour.check()
        assert session.result(step(18, "good")).step_count == 1
        session.close()
        for payload in UNDECODABLE:
            _, error = _raw_stream(channel, payload)
            assert error is not None
            neighbour.check()
        oversize = RawSession(channel)
        with pytest.raises(grpc.RpcError) as raised:
            oversize.send(step(19, "o" * 10 * 1024))
        assert raised.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        neighbour.check()
    neighbour.close()
    assert_books_balanced(server)
    # Neighbour + normal + 3 undecodable + oversize sessions: each made one env, all closed.
    assert server.created() == server.closed_envs() == 6


# -- caps and parsing ---------------------------------------------------------------------


@pytest.mark.parametrize("size", [257, 292, 4096])
def test_a_type_url_over_256_bytes_is_refused_even_when_it_ends_with_the_type(
    server, channel, size: int
) -> None:
    """A url whose last segment names the action type passed whatever came before it (a
    292-byte one was accepted). Over 256 bytes it is refused in-band, naming the size,
    without echoing the url; 256 bytes still pass."""
    neighbour = Neighbour(server.target)
    session = RawSession(channel)
    session.result(reset(1))
    value = EchoAction(message="long url").SerializeToString()
    padding = "x" * (size - len(f"example.com//{ACTION}"))
    error = session.error(raw_step(2, f"example.com/{padding}/{ACTION}", value))
    assert error.code == INVALID_ARGUMENT
    assert error.message == f"action type_url is {size} bytes; at most 256 are allowed"
    neighbour.check()
    options = any_pb2.Any(
        type_url=f"example.com/{padding}/{RESET_OPTIONS}",
        value=EchoResetOptions(stop_word="x").SerializeToString(),
    )
    error = session.error(reset(3, options))
    assert error.code == INVALID_ARGUMENT
    url_bytes = len(options.type_url)
    assert error.message == f"reset options type_url is {url_bytes} bytes; at most 256 are allowed"
    # At the bound it is a step, and the episode went on from step 0.
    fits = "x" * (256 - len(f"example.com//{ACTION}"))
    result = session.result(raw_step(4, f"example.com/{fits}/{ACTION}", value))
    assert result.step_count == 1
    session.close()
    neighbour.close()
    assert_books_balanced(server)


def test_a_long_type_url_in_a_vector_step_is_refused_and_the_stream_goes_on(server) -> None:
    from support.raw_vector import RawVector

    stream = RawVector(server.target, 2)
    stream.reset()
    long_url = f"example.com/{'x' * 300}/{ACTION}"
    request = pb.VectorSessionRequest()
    request.step.actions.add().Pack(EchoAction(message="fine"))
    request.step.actions.add(
        type_url=long_url, value=EchoAction(message="long").SerializeToString()
    )
    answer = stream.send(request)
    assert answer.WhichOneof("outcome") == "error", answer
    assert answer.error.code == INVALID_ARGUMENT
    assert answer.error.message == (
        f"action 1 (env 1) type_url is {len(long_url)} bytes; at most 256 are allowed; "
        "nothing was done"
    )
    # Nothing stepped; the next request steps both envs from step 0.
    again = stream.step([EchoAction(message="a"), EchoAction(message="b")])
    assert not again.result.errors
    stream.close()
    assert_books_balanced(server)


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        (
            [("openenv-num-envs", "2"), ("openenv-num-envs", "8")],
            "openenv-num-envs was sent 2 times: send it once",
        ),
        (
            [("openenv-num-envs", "2"), ("openenv-autoreset", "disabled"),
             ("openenv-autoreset", "next_step")],
            "openenv-autoreset was sent 2 times: send it once",
        ),
        *(
            ([("openenv-num-envs", bad)], f"openenv-num-envs must be a whole number of envs, got {bad!r}")  # noqa: E501
            for bad in (" 8 ", "8 ", "+8", "0x8", "8.0")
        ),
        (
            [("openenv-num-envs", "9" * 5000)],
            f"openenv-num-envs is {'9' * 10}...: a vector stream holds 1 to 1024 envs on this "
            "server (--max-vector-envs)",
        ),
    ],
    ids=["num-envs-twice", "autoreset-twice", "spaces", "trailing-space", "sign", "hex",
         "decimal-point", "5000-digits"],
)  # fmt: skip
def test_vector_open_headers_are_strict(server, metadata, message: str) -> None:  # type: ignore[no-untyped-def]
    """Duplicate headers (the last one won) and N that is not plain ASCII digits (" 8 "
    was 8) are INVALID_ARGUMENT naming the header; no env is made."""
    from support.raw_vector import RawVector

    refused = RawVector(server.target, 0, metadata=metadata).refusal()
    assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details() == message
    assert server.created() == 0
    ok = RawVector(server.target, 2)
    ok.reset()
    ok.close()
    assert_books_balanced(server)


def test_n_in_other_scripts_digits_is_not_a_number() -> None:
    """A client library refuses to send non-ASCII metadata, but a raw HTTP/2 peer can:
    str.isdecimal() took fullwidth and Arabic-Indic digits as N."""
    from openenv_grpc.server.service import read_open

    for text in ("\uff18", "\u0668", b"\xef\xbc\x98"):
        with pytest.raises(ValueError, match="must be a whole number of envs"):
            read_open([("openenv-num-envs", text)], 1024)
    assert read_open([("openenv-num-envs", b"8")], 1024)[0] == 8
