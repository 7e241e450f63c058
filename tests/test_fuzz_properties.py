"""Property tests of the request path against one real server for the whole module.

Hypothesis builds valid-but-wrong ``SessionRequest`` envelopes (any command or none, any
``Any`` type url and bytes, request ids from 0 to 2**64-1, fields up to ~1 MiB, deeply
nested Structs) and raw frames of arbitrary bytes. Properties:

* the server process never dies;
* every decodable request is answered by exactly one response echoing its request id,
  which is a success of the kind the command asks for or an in-band ``Error`` whose code
  is INVALID_ARGUMENT, FAILED_PRECONDITION or INTERNAL, consistent with the episode's
  bookkeeping (step counts, episode ids, step-before-reset);
* a frame that does not decode ends its stream with INVALID_ARGUMENT, one over the size
  limit with RESOURCE_EXHAUSTED, and nothing else ends a stream;
* a neighbour session opened at module start keeps stepping correctly throughout;
* afterwards, every env the server created is closed and no session is left.

NaN and infinities are generated too, strictly (bugs 3 and 4 in docs/reliability.md, fixed
in 0d3adcb): a tool call carrying one is refused with INVALID_ARGUMENT and the toolbox's
message, and an info map carrying one reaches the client intact.

Hypothesis's example database is off (nothing written to the repo); a failure prints the
reproducing example and a ``@reproduce_failure`` blob.
"""

from __future__ import annotations

import asyncio
import math
import queue
import random
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2, struct_pb2
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from openenv_grpc import EnvError
from openenv_grpc.codec import info_from_struct, info_to_struct, type_name
from openenv_grpc.metadata import ADMITTED_KEY
from openenv_grpc.server.model.payloads import MAX_EPISODE_ID_BYTES
from openenv_grpc.testing import ServerProcess
from openenv_grpc.tools.v1.tools_pb2 import ToolCall
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc_envs.echo import (
    AsyncEchoEnv,
    EchoAction,
    EchoEnv,
    EchoObservation,
    EchoResetOptions,
)

pytestmark = pytest.mark.timeout(240)

TESTS = Path(__file__).resolve().parent
SESSION_METHOD = "/openenv_grpc.v1.EnvService/Session"
PREFIX = "type.googleapis.com/"
ACTION_URL = PREFIX + "openenv_grpc_envs.echo.v1.EchoAction"
OBSERVATION_URL = PREFIX + "openenv_grpc_envs.echo.v1.EchoObservation"
STATE_URL = PREFIX + "openenv_grpc_envs.echo.v1.EchoState"
RESET_OPTIONS_URL = PREFIX + "openenv_grpc_envs.echo.v1.EchoResetOptions"

#: The server's --max-message-bytes: requests (and answers) above it end their stream.
LIMIT = 512 * 1024
#: Largest generated field: well past the limit, so oversize requests are common.
HUGE = 1024 * 1024

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
INTERNAL = grpc.StatusCode.INTERNAL.value[0]
ERROR_CODES = {INVALID_ARGUMENT, FAILED_PRECONDITION, INTERNAL}
CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}

#: What each command's success looks like.
SUCCESS = {"reset": "result", "step": "result", "state": "state", "close": "closed"}

#: Per-module tally, printed at the end (and quoted in docs/reliability.md).
TALLY: dict[str, int] = {}


def _count(key: str) -> None:
    TALLY[key] = TALLY.get(key, 0) + 1


# -- the server, its neighbour, and a raw stream ----------------------------------------


class Neighbour:
    """A well-behaved session opened at module start; ``check()`` steps it."""

    def __init__(self, target: str) -> None:
        self.env = EchoEnv(target)
        self.env.open()
        assert self.env.reset(episode_id="neighbour").step_count == 0
        self.steps = 0

    def check(self) -> None:
        self.steps += 1
        message = f"neighbour step {self.steps}"
        result = self.env.step(EchoAction(message=message))
        assert result.observation.echoed_message == message
        assert result.observation.message_length == len(message)
        assert (result.step_count, result.episode_id, result.done) == (
            self.steps,
            "neighbour",
            False,
        )


@dataclass
class Fuzzed:
    server: ServerProcess
    ledger: Path
    channel: grpc.Channel
    neighbour: Neighbour
    examples: int = 0

    def __repr__(self) -> str:
        return f"<server {self.server.target}>"

    def after_example(self) -> None:
        """Between examples: the process is alive and the neighbour still steps."""
        self.examples += 1
        assert self.server.proc.poll() is None, self.server.stderr()[-4000:]
        self.neighbour.check()


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    ledger = tmp_path_factory.mktemp("fuzz-ledger")
    server = ServerProcess(
        "support.envs:CountingEchoEnv",
        ["--max-message-bytes", str(LIMIT), "--max-concurrent-envs", "0"],
        extra_env={"OPENENV_TEST_LEDGER": str(ledger)},
        pythonpath=[TESTS],
    )
    # The client never refuses anything itself: every limit hit is the server's.
    channel = grpc.insecure_channel(
        server.target,
        options=[
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ],
    )
    started = time.monotonic()
    try:
        neighbour = Neighbour(server.target)
        state = Fuzzed(server, ledger, channel, neighbour)
        yield state
        # The module's verdict on the books: neighbour closes, nothing is left open.
        neighbour.check()
        neighbour.env.close()
        created = len(list(ledger.iterdir()))
        server.wait_until(
            lambda: len(list(ledger.glob("*.closed"))) == created and server.active() == 0,
            30.0,
            "every fuzzed session's env closed",
        )
        assert "closed twice" not in server.stderr()
        assert server.proc.poll() is None
        summary = {
            "examples": state.examples,
            "neighbour_steps": neighbour.steps,
            "envs_created": created,
            "envs_closed": created,
            "seconds": round(time.monotonic() - started, 1),
            **dict(sorted(TALLY.items())),
        }
        print(f"\nFUZZ properties: {summary}", flush=True)
    finally:
        channel.close()
        server.stop()


class Stream:
    """One Session stream (bytes in, bytes out) on the module's channel."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        session = channel.stream_stream(SESSION_METHOD)  # identity (de)serializers
        self.call = session(iter(self._requests.get, None), timeout=60)
        assert ADMITTED_KEY in dict(self.call.initial_metadata()), "session not admitted"

    def send(self, payload: bytes) -> bytes | grpc.RpcError | None:
        """Send one frame; its answer, the error that ended the stream, or None (OK end)."""
        self._requests.put(payload)
        try:
            return next(self.call)  # type: ignore[no-any-return]
        except StopIteration:
            return None
        except grpc.RpcError as exc:
            return exc

    def finish(self) -> None:
        """Half-close; the stream must end OK without another answer."""
        self._requests.put(None)
        rest = list(self.call)
        assert rest == [], f"answers nobody asked for: {rest!r}"
        assert self.call.code() is grpc.StatusCode.OK, (self.call.code(), self.call.details())

    def abandon(self) -> None:
        self._requests.put(None)
        self.call.cancel()


# -- the model: what a correct answer to each request is -----------------------------------


@dataclass
class Model:
    """The episode bookkeeping a correct server keeps for one session."""

    running: bool = False
    episode_id: str = ""
    steps: int = 0
    #: Upper bound of what later answers may carry besides the request itself (episode id,
    #: echoed history): past the limit, an answer may end the stream instead.
    carried: int = 0
    notes: list[str] = field(default_factory=list)

    def may_exceed_limit(self, request_size: int) -> bool:
        return self.carried + request_size + 16 * 1024 > LIMIT

    def check(self, request: pb.SessionRequest, response: pb.SessionResponse) -> None:
        assert response.request_id == request.request_id, "response does not echo the request id"
        command = request.WhichOneof("command")
        outcome = response.WhichOneof("outcome")
        if outcome == "error":
            error = response.error
            assert error.code in ERROR_CODES, f"error code {error.code} for {command}"
            assert error.message, "an error without a message"
            _count(f"{command or 'empty'}:error:{CODE_NAMES[error.code]}")
        else:
            assert command is not None, "an empty envelope was answered with a success"
            assert outcome == SUCCESS[command], f"{command} answered with {outcome}"
            _count(f"{command}:ok")
        if command is None:
            assert outcome == "error" and response.error.code == INVALID_ARGUMENT
        elif command == "reset":
            self._reset(request.reset, response)
        elif command == "step":
            self._step(request.step, response)
        elif command == "state" and outcome == "state":
            state = response.state
            assert (state.episode_id, state.step_count) == (self.episode_id, self.steps)
            assert state.state.type_url == STATE_URL

    def _reset(self, command: pb.ResetCommand, response: pb.SessionResponse) -> None:
        if response.WhichOneof("outcome") == "error":
            if response.error.code == INTERNAL:
                self.running = False  # the env raised: only a reset may follow
            else:
                # A refused reset (an episode id over its cap, options of the wrong type,
                # undecodable or over their cap) changes nothing.
                assert response.error.code == INVALID_ARGUMENT
                if len(command.episode_id.encode()) > MAX_EPISODE_ID_BYTES:
                    assert response.error.message.startswith("episode_id is ")
                else:
                    assert command.HasField("options")
                    assert response.error.message.startswith("reset options ")
            return
        result = response.result
        if command.HasField("options"):
            assert type_name(command.options.type_url) == type_name(RESET_OPTIONS_URL), (
                "foreign options accepted"
            )
        if command.HasField("episode_id"):
            assert result.episode_id == command.episode_id
        assert result.step_count == 0 and result.reward == 0.0
        assert result.observation.type_url == OBSERVATION_URL
        self.episode_id, self.steps = result.episode_id, 0
        self.carried = len(result.episode_id.encode())
        self.running = not (result.terminated or result.truncated)

    def _step(self, command: pb.StepCommand, response: pb.SessionResponse) -> None:
        if not self.running:
            assert response.WhichOneof("outcome") == "error", "a step outside an episode ran"
            assert response.error.code == FAILED_PRECONDITION
            return
        if type_name(command.action.type_url) != type_name(ACTION_URL):
            # Only the url's last path segment names the type (the Any rule).
            assert response.WhichOneof("outcome") == "error", "a foreign action was accepted"
            assert response.error.code == INVALID_ARGUMENT
            return
        if response.WhichOneof("outcome") == "error":
            if response.error.code == INTERNAL:
                self.running = False
            else:
                assert response.error.code == INVALID_ARGUMENT  # bad bytes or an illegal action
            return
        result = response.result
        self.steps += 1
        assert (result.step_count, result.episode_id) == (self.steps, self.episode_id)
        assert result.observation.type_url == OBSERVATION_URL
        observation = EchoObservation.FromString(result.observation.value)
        self.carried += len(observation.echoed_message.encode())
        self.running = not (result.terminated or result.truncated)


def _oversize_end(outcome: Any, what: str) -> None:
    assert isinstance(outcome, grpc.RpcError), (
        f"{what}: expected the stream to end, got {outcome!r}"
    )
    assert outcome.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, (outcome.code(), outcome.details())


def run_requests(fuzzed: Fuzzed, requests: list[pb.SessionRequest]) -> None:
    """Send ``requests`` one at a time on a fresh stream, checking each answer."""
    stream = Stream(fuzzed.channel)
    model = Model()
    try:
        for request in requests:
            payload = request.SerializeToString()
            outcome = stream.send(payload)
            if len(payload) > LIMIT:
                _oversize_end(outcome, f"a {len(payload)}-byte request")
                _count("stream:RESOURCE_EXHAUSTED:request")
                return
            if isinstance(outcome, grpc.RpcError):
                # Only an answer too big to send may end a stream of decodable requests.
                assert model.may_exceed_limit(len(payload)), (outcome.code(), outcome.details())
                _oversize_end(outcome, "an oversize answer")
                _count("stream:RESOURCE_EXHAUSTED:response")
                return
            assert outcome is not None, f"stream ended without answering {request!r:.200}"
            response = pb.SessionResponse.FromString(outcome)
            model.check(request, response)
            if request.WhichOneof("command") == "close":
                stream.finish()  # closed: the stream ends OK right after
                _count("stream:closed")
                return
        stream.finish()
        _count("stream:half-closed")
    finally:
        stream.abandon()
        fuzzed.after_example()


# -- strategies ----------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field, encoded by hand (no depth limit on our side)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def nested_struct(depth: int) -> bytes:
    """A google.protobuf.Struct ``{"message": {"k": {"k": ... "x"}}}`` nested ``depth`` deep."""
    value = _field(3, b"x")  # Value.string_value
    for _ in range(depth):
        entry = _field(1, b"k") + _field(2, value)  # map entry: key, value
        value = _field(5, _field(1, entry))  # Value.struct_value = Struct{fields: entry}
    return _field(1, _field(1, b"message") + _field(2, value))


def _huge(size: int, seed: int) -> bytes:
    # Random, constant, or a repeated varint-ish pattern: cheap to build at 1 MiB.
    kind = seed % 3
    if kind == 0:
        return random.Random(seed).randbytes(size)
    if kind == 1:
        return bytes([seed % 256]) * size
    return (b"\x0a\x03abc" * (size // 5 + 1))[:size]


#: Sizes for the big fields: small, around the limit, and up to ~1 MiB.
big_sizes = st.one_of(
    st.integers(0, 4096),
    st.integers(LIMIT - 4096, LIMIT + 64),
    st.integers(0, HUGE),
)
huge_bytes = st.builds(_huge, big_sizes, st.integers(0, 2**32))
small_bytes = st.binary(max_size=64)

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _tool_call_action(name: str, arguments: dict[str, Any], call_id: str) -> bytes:
    action = EchoAction()
    action.tool_call.name = name
    action.tool_call.call_id = call_id
    action.tool_call.arguments.update(arguments)
    return action.SerializeToString()


tool_names = st.one_of(st.sampled_from(["reverse", "count", "history"]), st.text(max_size=10))
tool_arguments = st.dictionaries(
    st.one_of(st.sampled_from(["message", "letter", "last"]), st.text(max_size=6)),
    json_value,
    max_size=3,
)

action_bytes = st.one_of(
    st.builds(lambda m: EchoAction(message=m).SerializeToString(), st.text(max_size=40)),
    st.builds(  # around the env's 64 Ki-character message limit
        lambda n: EchoAction(message="m" * n).SerializeToString(),
        st.integers(64 * 1024 - 2, 64 * 1024 + 2),
    ),
    st.just(EchoAction(list_tools={}).SerializeToString()),
    st.builds(_tool_call_action, tool_names, tool_arguments, st.text(max_size=8)),
    st.builds(  # Structs nested past the decoder's depth limit, and under it
        lambda depth: _field(3, _field(2, b"count") + _field(3, nested_struct(depth))),
        st.integers(1, 120),
    ),
)
options_bytes = st.one_of(
    st.builds(
        lambda steps, stop, greeting: EchoResetOptions(
            max_steps=steps, stop_word=stop, greeting=greeting
        ).SerializeToString(),
        st.integers(0, 2**32 - 1),
        st.text(max_size=6),
        st.text(max_size=20),
    ),
    st.builds(nested_struct, st.integers(1, 120)),
)
type_urls = st.one_of(
    st.sampled_from(
        [
            ACTION_URL,
            RESET_OPTIONS_URL,
            STATE_URL,
            OBSERVATION_URL,
            "",
            PREFIX,
            PREFIX + "google.protobuf.Struct",
            "openenv_grpc_envs.echo.v1.EchoAction",
            "evil.example/openenv_grpc_envs.echo.v1.EchoAction",
        ]
    ),
    st.text(max_size=40),
    st.builds(lambda n: "u" * n, big_sizes),
)


def _any(type_url: str, value: bytes) -> any_pb2.Any:
    return any_pb2.Any(type_url=type_url, value=value)


payload_any = st.builds(
    _any, type_urls, st.one_of(action_bytes, options_bytes, small_bytes, huge_bytes)
)
request_ids = st.one_of(st.sampled_from([0, 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
episode_ids = st.one_of(st.text(max_size=30), st.builds(lambda n: "e" * n, big_sizes))


@st.composite
def requests(draw: st.DrawFn) -> pb.SessionRequest:
    request = pb.SessionRequest(request_id=draw(request_ids))
    command = draw(st.sampled_from(["reset", "step", "state", "close", None, "valid-step"]))
    if command == "reset":
        request.reset.SetInParent()
        if draw(st.booleans()):
            request.reset.seed = draw(st.integers(0, 2**64 - 1))
        if draw(st.booleans()):
            request.reset.episode_id = draw(episode_ids)
        if draw(st.booleans()):
            if draw(st.booleans()):
                request.reset.options.CopyFrom(draw(payload_any))
            else:
                value = draw(options_bytes)
                request.reset.options.CopyFrom(_any(RESET_OPTIONS_URL, value))
    elif command == "step":
        request.step.SetInParent()
        if draw(st.integers(0, 9)):  # mostly with an action
            if draw(st.booleans()):
                request.step.action.CopyFrom(draw(payload_any))
            else:
                request.step.action.CopyFrom(_any(ACTION_URL, draw(action_bytes)))
    elif command == "valid-step":
        message = draw(st.text(max_size=30))
        request.step.action.CopyFrom(
            _any(ACTION_URL, EchoAction(message=message).SerializeToString())
        )
    elif command == "state":
        request.state.SetInParent()
    elif command == "close":
        request.close.SetInParent()
    return request


def _valid_reset(request_id: int) -> pb.SessionRequest:
    request = pb.SessionRequest(request_id=request_id)
    request.reset.SetInParent()
    return request


# Sequences: often opened by a valid reset so that steps reach the environment.
request_sequences = st.builds(
    lambda opener, rest: ([_valid_reset(opener)] if opener is not None else []) + rest,
    st.one_of(st.none(), request_ids),
    st.lists(requests(), min_size=1, max_size=6),
)

COMMON = settings(
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)


# -- properties ------------------------------------------------------------------------------


@settings(COMMON, max_examples=1000)
@given(sequence=request_sequences)
def test_every_decodable_request_gets_exactly_one_fitting_answer(
    fuzzed: Fuzzed, sequence: list[pb.SessionRequest]
) -> None:
    run_requests(fuzzed, sequence)


def _mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    buffer = bytearray(data)
    for kind, position, value in edits:
        if not buffer:
            buffer.append(value)
            continue
        position %= len(buffer)
        if kind == 0:
            buffer[position] ^= 1 << (value % 8)  # flip a bit
        elif kind == 1:
            del buffer[position:]  # truncate
        elif kind == 2:
            buffer.insert(position, value)  # insert a byte
        else:
            buffer[position] = value  # overwrite a byte
    return bytes(buffer)


raw_frames = st.one_of(
    st.binary(max_size=256),
    st.builds(
        _mutate,
        requests().map(lambda r: r.SerializeToString()),
        st.lists(
            st.tuples(st.integers(0, 3), st.integers(0, 2**16), st.integers(0, 255)),
            min_size=1,
            max_size=4,
        ),
    ),
    st.builds(  # two envelopes back to back: protobuf merges them into one
        lambda a, b: a.SerializeToString() + b.SerializeToString(), requests(), requests()
    ),
    huge_bytes,
)


@settings(COMMON, max_examples=1000)
@given(frame=raw_frames)
def test_raw_frames_are_answered_or_end_their_stream_cleanly(fuzzed: Fuzzed, frame: bytes) -> None:
    stream = Stream(fuzzed.channel)
    try:
        outcome = stream.send(frame)
        if len(frame) > LIMIT:
            _oversize_end(outcome, f"a {len(frame)}-byte frame")
            _count("raw:RESOURCE_EXHAUSTED")
            return
        try:
            request = pb.SessionRequest.FromString(frame)
        except DecodeError:
            assert isinstance(outcome, grpc.RpcError), f"undecodable frame answered: {outcome!r}"
            assert outcome.code() is grpc.StatusCode.INVALID_ARGUMENT, outcome.code()
            assert "not a valid openenv_grpc.v1.SessionRequest" in (outcome.details() or "")
            _count("raw:undecodable:INVALID_ARGUMENT")
            return
        model = Model()
        if isinstance(outcome, grpc.RpcError):
            assert model.may_exceed_limit(len(frame)), (outcome.code(), outcome.details())
            _oversize_end(outcome, "an oversize answer")
            _count("raw:RESOURCE_EXHAUSTED:response")
            return
        assert outcome is not None, "a decodable frame was not answered"
        model.check(request, pb.SessionResponse.FromString(outcome))
        stream.finish()
        _count("raw:decodable:answered")
    finally:
        stream.abandon()
        fuzzed.after_example()


# Tool calls are the one place the echo env interprets client-built JSON: a bad argument is
# the caller's mistake (INVALID_ARGUMENT, the episode goes on) or a tool error the agent can
# read (a result with is_error); never the env failing (INTERNAL, the episode broken).
#: NaN and the infinities, drawn often (st.floats() alone rarely gives them).
non_finite = st.sampled_from([math.nan, math.inf, -math.inf])
#: Arguments the echo tools accept, so that some calls get past the schema.
plausible = st.one_of(st.sampled_from(["banana", "a", "", "xyz"]), st.integers(-3, 200))
json_any_float = st.recursive(
    st.one_of(st.none(), st.booleans(), st.floats(), non_finite, plausible, st.text(max_size=10)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


random_tool_arguments = st.dictionaries(
    st.sampled_from(["message", "letter", "last"]), json_any_float, max_size=3
)
#: Arguments shaped like each echo tool's (the right names, mostly the right types), so
#: that calls also get past the schema and run; NaN and infinities still turn up.
tool_shaped_arguments = {
    "count": st.fixed_dictionaries(
        {"message": st.text(max_size=8), "letter": st.one_of(st.text(max_size=2), non_finite)}
    ),
    "reverse": st.fixed_dictionaries({"message": st.one_of(st.text(max_size=8), non_finite)}),
    "history": st.fixed_dictionaries(
        {}, optional={"last": st.one_of(st.integers(-3, 200), non_finite, st.floats())}
    ),
}


@settings(COMMON, max_examples=150)
@example(name="count", arguments={"message": "abc", "letter": math.nan})
@example(name="history", arguments={"last": math.inf})
@given(
    name=st.shared(tool_names, key="tool"),
    arguments=st.shared(tool_names, key="tool").flatmap(
        lambda name: st.one_of(random_tool_arguments, tool_shaped_arguments.get(name, st.nothing()))
    ),
)
def test_tool_calls_never_break_the_episode(
    fuzzed: Fuzzed, name: str, arguments: dict[str, Any]
) -> None:
    stream = Stream(fuzzed.channel)
    try:
        model = Model()
        for request in (_valid_reset(1), pb.SessionRequest(request_id=2)):
            if request.request_id == 2:
                call = ToolCall(name=name, call_id="c1")
                call.arguments.update(arguments)
                request.step.action.CopyFrom(
                    _any(ACTION_URL, EchoAction(tool_call=call).SerializeToString())
                )
            outcome = stream.send(request.SerializeToString())
            assert isinstance(outcome, bytes), outcome
            response = pb.SessionResponse.FromString(outcome)
            model.check(request, response)
        if response.WhichOneof("outcome") == "error":
            _count(f"tool:error:{CODE_NAMES.get(response.error.code, response.error.code)}")
            assert response.error.code == INVALID_ARGUMENT, (
                f"tool call {name}({arguments!r}) broke the episode: "
                f"{response.error.code} {response.error.message}"
            )
            # Refused by the toolbox (unknown tool or a bad argument), which says why.
            assert response.error.message.startswith(("tool ", "no tool named ")), (
                response.error.message
            )
            if not _finite(arguments):
                _count("tool:non-finite:refused")
        else:
            # Every echo tool takes strings and integers: NaN or an infinity anywhere in
            # the arguments is a bad argument, never something a tool gets to see.
            assert _finite(arguments), f"tool call {name}({arguments!r}) was not refused"
            observation = EchoObservation.FromString(response.result.observation.value)
            _count("tool:is_error" if observation.tool_result.is_error else "tool:ok")
        # The episode goes on: a plain step right after counts as the first step.
        after = pb.SessionRequest(request_id=3)
        after.step.action.CopyFrom(
            _any(ACTION_URL, EchoAction(message="after").SerializeToString())
        )
        outcome = stream.send(after.SerializeToString())
        assert isinstance(outcome, bytes), outcome
        model.check(after, pb.SessionResponse.FromString(outcome))
        stream.finish()
    finally:
        stream.abandon()
        fuzzed.after_example()


#: Tool calls with non-finite arguments, and what the toolbox says about each.
NON_FINITE_TOOL_CALLS = [
    (
        "count",
        {"message": "abc", "letter": math.nan},
        "argument 'letter' must be string, got float",
    ),
    ("history", {"last": math.inf}, "argument 'last' must be finite, got inf"),
    ("history", {"last": -math.inf}, "argument 'last' must be finite, got -inf"),
    ("history", {"last": math.nan}, "argument 'last' must be finite, got nan"),
    ("reverse", {"message": [math.nan]}, "argument 'message' must be string, got list"),
]


@pytest.mark.parametrize(
    ("name", "arguments", "message"),
    NON_FINITE_TOOL_CALLS,
    ids=[f"{n}-{k}={v}" for n, a, _ in NON_FINITE_TOOL_CALLS for k, v in list(a.items())[-1:]],
)
def test_non_finite_tool_arguments_are_refused_with_the_toolbox_message(
    fuzzed: Fuzzed, name: str, arguments: dict[str, Any], message: str
) -> None:
    """Bug 3 (fixed in 0d3adcb): these answered INTERNAL and broke the episode."""
    with EchoEnv(fuzzed.server.target) as env:
        env.reset()
        call = ToolCall(name=name, call_id="nf")
        call.arguments.update(arguments)
        with pytest.raises(EnvError) as refused:
            env.step(EchoAction(tool_call=call))
        assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.message == f"tool {name!r}: {message}"
        # The episode goes on, and the refused call was not counted as a step.
        result = env.step(EchoAction(message="after"))
        assert (result.step_count, result.observation.echoed_message) == (1, "after")
    _count("tool:non-finite:explicit")
    fuzzed.after_example()


# The info map of a result travels as a Struct: the server builds it with info_to_struct,
# every client decodes it with info_from_struct on each step. Whatever an env puts there
# (NaN losses and infinite bounds are common in RL), decoding must not raise, and finite
# JSON-like values must come back equal.
info_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.floats(),
        non_finite,
        st.integers(-(2**53), 2**53),
        st.text(max_size=10),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=10,
)


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


def _same(sent: Any, received: Any) -> bool:
    """Equal as JSON-like values, where NaN equals NaN (numbers arrive as floats)."""
    if isinstance(sent, float) and math.isnan(sent):
        return isinstance(received, float) and math.isnan(received)
    if isinstance(sent, list):
        return (
            isinstance(received, list)
            and len(sent) == len(received)
            and all(_same(a, b) for a, b in zip(sent, received, strict=True))
        )
    if isinstance(sent, dict):
        return (
            isinstance(received, dict)
            and set(sent) == set(received)
            and all(_same(sent[k], received[k]) for k in sent)
        )
    if isinstance(sent, bool) or sent is None:
        return received is sent
    if isinstance(sent, str):
        return received == sent
    return isinstance(received, float) and received == sent  # every number arrives a float


@settings(COMMON, max_examples=200)
@example(info={"loss": math.nan})
@example(info={"bound": math.inf})
@example(info={"low": -math.inf, "nested": {"l": [math.nan, 1, None, True]}})
@given(info=st.dictionaries(st.text(max_size=8), info_values, max_size=4))
def test_info_maps_survive_the_wire(info: dict[str, Any]) -> None:
    struct = struct_pb2.Struct()
    info_to_struct(info, struct)
    received = struct_pb2.Struct.FromString(struct.SerializeToString())
    decoded = info_from_struct(received)  # what every client does with a step's info
    _count("info:decoded" if _finite(info) else "info:decoded:non-finite")
    # Every value comes back, NaN and infinities included (bug 4, fixed in 0d3adcb).
    assert _same(info, decoded), (info, decoded)


#: An echo env whose every step reports non-finite numbers in its info map; written to
#: a temporary directory and served from there.
NON_FINITE_INFO_ENV = textwrap.dedent(
    """
    import math

    from openenv_grpc import Transition
    from openenv_grpc_envs.echo import EchoEnvironment

    class NonFiniteInfoEcho(EchoEnvironment):
        def step(self, action):
            done = super().step(action)
            info = {"loss": math.nan, "bound": math.inf, "low": -math.inf,
                    "nested": {"l": [math.nan, 2.5, None]}, "lives": 3}
            return Transition(done.observation, done.reward, done.terminated,
                              done.truncated, info=info)
    """
)


def _check_non_finite_info(info: dict[str, Any]) -> None:
    assert set(info) == {"loss", "bound", "low", "nested", "lives"}, info
    assert math.isnan(info["loss"])
    assert (info["bound"], info["low"], info["lives"]) == (math.inf, -math.inf, 3.0)
    assert math.isnan(info["nested"]["l"][0]) and info["nested"]["l"][1:] == [2.5, None]


def test_non_finite_info_reaches_sync_and_async_clients(tmp_path: Path) -> None:
    """Bug 4 (fixed in 0d3adcb): every client step raised ValueError on such an info map."""
    (tmp_path / "non_finite_info_env.py").write_text(NON_FINITE_INFO_ENV)
    server = ServerProcess("non_finite_info_env:NonFiniteInfoEcho", pythonpath=[tmp_path])
    try:
        with EchoEnv(server.target) as env:
            env.reset()
            for k in range(3):
                result = env.step(EchoAction(message=f"m{k}"))
                assert result.step_count == k + 1
                _check_non_finite_info(result.info)

        async def async_client() -> None:
            async with AsyncEchoEnv(server.target) as env:
                await env.reset()
                result = await env.step(EchoAction(message="a"))
                _check_non_finite_info(result.info)

        asyncio.run(async_client())
        _count("info:non-finite:over-the-wire")
    finally:
        server.stop()


def test_nested_struct_helper_matches_protobuf() -> None:
    """The hand encoder builds what protobuf builds (checked at a depth protobuf accepts)."""
    parsed = struct_pb2.Struct.FromString(nested_struct(3))
    value = parsed.fields["message"]
    for _ in range(3):
        value = value.struct_value.fields["k"]
    assert value.string_value == "x"
