"""Coverage-guided fuzzer (atheris/libFuzzer) of the server's request handling, in-process.

Not a pytest module (no ``test_`` prefix); ``tests/test_fuzz_bounded.py`` runs it for a
bounded number of inputs. Run it by hand for longer::

    .venv/bin/python tests/fuzz/fuzz_session.py CORPUS_DIR -max_total_time=300 \
        -artifact_prefix=/tmp/fuzz-artifacts/

An empty or missing ``CORPUS_DIR`` is seeded with well-formed inputs first
(``fuzz_session.py --write-corpus DIR`` writes them and stops). A crash
(uncaught exception) writes ``crash-<sha1>`` under the artifact prefix; replay it with
``.venv/bin/python tests/fuzz/fuzz_session.py /tmp/fuzz-artifacts/crash-<sha1>``.

The first byte of an input picks a target; the rest is its data:

* 0, 1 - a session: the data is a list of frames (2-byte big-endian length, then bytes),
  each parsed as a ``SessionRequest`` (frames that do not decode are skipped: the server
  ends such a stream before the driver sees it) and handed in turn to one
  ``SessionView`` over a fresh ``EchoEnvironment``. Property: ``handle`` returns a
  serializable ``SessionResponse`` echoing the request id, a success of the kind asked for
  or an ``Error`` with code INVALID_ARGUMENT / FAILED_PRECONDITION / INTERNAL (or
  UNIMPLEMENTED for a snapshot or restore if the env has no snapshots, and for a render:
  the echo env does not render); INTERNAL is
  a failure too here, since the echo env never raises on its own (only client input that
  slips past validation can make it), and nothing follows a close. A step whose tool call
  carries NaN or an infinity in its arguments may never succeed (the toolbox refuses it).
* 2 - ``openenv_grpc.codec``: frames are an ``Any``'s type url and value, unpacked as each of
  the echo env's four types; only ``PayloadError`` may come out. Then a ``Struct`` parsed
  from the third frame goes through ``info_from_struct`` (what a client does with a step's
  info), which may not raise and must give back every value, NaN and infinities included.
* 3 - the echo env's tools: the data is a ``ToolCall``, called as a step; only
  ``InvalidAction`` may come out, the observation must serialize, and a call with NaN or
  an infinity in its arguments must be refused with ``InvalidAction``.

Every property is checked strictly: there is no known bug class to skip. NaN and
infinities (bugs 3 and 4 in docs/reliability.md, fixed in 0d3adcb) are kept as
``regression-*`` seeds.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import atheris

with atheris.instrument_imports(
    include=["openenv_grpc", "openenv_grpc_envs", "google.protobuf.json_format"]
):
    from google.protobuf import any_pb2, struct_pb2
    from google.protobuf.message import DecodeError

    from openenv_grpc.codec import PayloadError, info_from_struct, unpack
    from openenv_grpc.environment import AutoresetMode, InvalidAction
    from openenv_grpc.server.local.calls import local_calls
    from openenv_grpc.server.model.phases import SESSION_WORDS
    from openenv_grpc.server.model.spec import EnvSpec
    from openenv_grpc.server.stream.session_view import SessionView
    from openenv_grpc.tools.v1.tools_pb2 import ToolCall
    from openenv_grpc.v1 import session_pb2 as pb
    from openenv_grpc_envs.echo import (
        EchoAction,
        EchoEnvironment,
        EchoObservation,
        EchoResetOptions,
        EchoState,
    )

INVALID_ARGUMENT, FAILED_PRECONDITION, UNIMPLEMENTED, INTERNAL = 3, 9, 12, 13
ERROR_CODES = {INVALID_ARGUMENT, FAILED_PRECONDITION, INTERNAL}
#: Snapshot commands may also meet an env without snapshots.
SNAPSHOT_ERROR_CODES = {*ERROR_CODES, UNIMPLEMENTED}
SUCCESS = {
    "reset": "result", "step": "result", "state": "state", "close": "closed",
    "snapshot": "snapshot", "restore": "restored",
}  # fmt: skip
MAX_FRAMES = 16

logging.disable(logging.CRITICAL)  # the driver logs every env exception it maps
SPEC = EnvSpec.from_factory(EchoEnvironment)
POOL = ThreadPoolExecutor(1)  # unused by the inline echo env; EnvRunner wants one
LOOP = asyncio.new_event_loop()
MESSAGE_TYPES = [EchoAction, EchoObservation, EchoState, EchoResetOptions]


def frames(data: bytes) -> list[bytes]:
    """Split ``data`` into frames: a 2-byte big-endian length, then that many bytes."""
    out: list[bytes] = []
    i = 0
    while i + 2 <= len(data) and len(out) < MAX_FRAMES:
        size = int.from_bytes(data[i : i + 2], "big")
        out.append(data[i + 2 : i + 2 + size])
        i += 2 + size
    return out


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(2, "big") + payload


def has_nonfinite(message: Any) -> bool:
    """Whether ``message`` holds a NaN or Infinity ``Value.number_value`` anywhere."""
    if isinstance(message, struct_pb2.Value):
        kind = message.WhichOneof("kind")
        if kind == "number_value":
            return not math.isfinite(message.number_value)
        if kind == "struct_value":
            return has_nonfinite(message.struct_value)
        if kind == "list_value":
            return any(has_nonfinite(v) for v in message.list_value.values)
        return False
    if isinstance(message, struct_pb2.Struct):
        return any(has_nonfinite(v) for v in message.fields.values())
    return False


def _nonfinite_tool_call(request: pb.SessionRequest) -> bool:
    if request.WhichOneof("command") != "step" or request.step.action.type_url != SPEC.action_url:
        return False
    try:
        action = EchoAction.FromString(request.step.action.value)
    except DecodeError:
        return False
    return action.HasField("tool_call") and has_nonfinite(action.tool_call.arguments)


# -- targets ---------------------------------------------------------------------------


async def _driver() -> SessionView:
    """A ``SessionView`` as the session manager builds one (no env-call timeout)."""
    calls = await local_calls(
        SPEC, 1, AutoresetMode.DISABLED, POOL, words=SESSION_WORDS, native=False
    )
    return SessionView(SPEC, calls)


async def _session(requests: list[pb.SessionRequest]) -> None:
    driver = await _driver()
    try:
        for request in requests:
            answer = await driver.handle(request.SerializeToString())
            check_response(request, pb.SessionResponse.FromString(answer.response))
            if answer.ends:
                return  # the stream ends after a close: nothing more is read
    finally:
        await driver.close()  # whichever env it holds now (a hung one is replaced)


def check_response(request: pb.SessionRequest, response: Any) -> None:
    if not isinstance(response, pb.SessionResponse):
        raise AssertionError(f"handle returned {type(response).__name__}")
    if response.request_id != request.request_id:
        raise AssertionError(f"request id {request.request_id} answered as {response.request_id}")
    response.SerializeToString()  # the server must be able to send it
    command = request.WhichOneof("command")
    outcome = response.WhichOneof("outcome")
    if outcome == "error":
        error = response.error
        optional = ("snapshot", "restore", "render")  # methods an env may leave out
        allowed = SNAPSHOT_ERROR_CODES if command in optional else ERROR_CODES
        if error.code not in allowed:
            raise AssertionError(f"error code {error.code} for {command}: {error.message}")
        if error.code == INTERNAL:
            raise AssertionError(f"the echo env failed on client input: {error.message}")
        if command is None and error.code != INVALID_ARGUMENT:
            raise AssertionError("an empty envelope must be INVALID_ARGUMENT")
        return
    if command is None or outcome != SUCCESS[command]:
        raise AssertionError(f"{command} answered with {outcome}")
    if _nonfinite_tool_call(request):
        raise AssertionError("a tool call with non-finite arguments was not refused")


def fuzz_session(data: bytes) -> None:
    requests = []
    for raw in frames(data):
        try:
            requests.append(pb.SessionRequest.FromString(raw))
        except DecodeError:
            continue  # the server ends such a stream with INVALID_ARGUMENT before the driver
    if requests:
        LOOP.run_until_complete(_session(requests))


def fuzz_codec(data: bytes) -> None:
    parts = [*frames(data), b"", b"", b""]
    payload = any_pb2.Any(type_url=parts[0].decode("utf-8", "replace"), value=parts[1])
    for message_class in MESSAGE_TYPES:
        try:
            decoded = unpack(payload, message_class, "payload")
        except PayloadError:
            continue
        if not isinstance(decoded, message_class):
            raise AssertionError(f"unpack returned {type(decoded).__name__}")
    try:
        struct = struct_pb2.Struct.FromString(parts[2])
    except DecodeError:
        return
    info = info_from_struct(struct)  # a client decoding a step's info: must not raise
    check_decoded(struct, info)


def check_decoded(struct: struct_pb2.Struct, info: Any) -> None:
    """``info`` holds exactly what ``struct`` does, as plain Python values; a NaN stays a
    NaN and an infinity an infinity of the same sign."""
    if not isinstance(info, dict) or set(info) != set(struct.fields):
        raise AssertionError(f"keys {sorted(struct.fields)} decoded as {info!r:.200}")
    for key, value in struct.fields.items():
        _check_value(value, info[key])


def _check_value(value: struct_pb2.Value, decoded: Any) -> None:
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        number = value.number_value
        same = isinstance(decoded, float) and (
            decoded == number or (math.isnan(number) and math.isnan(decoded))
        )
    elif kind == "string_value":
        same = decoded == value.string_value
    elif kind == "bool_value":
        same = decoded is value.bool_value
    elif kind == "struct_value":
        check_decoded(value.struct_value, decoded)
        return
    elif kind == "list_value":
        items = value.list_value.values
        if not isinstance(decoded, list) or len(decoded) != len(items):
            raise AssertionError(f"a list of {len(items)} decoded as {decoded!r:.200}")
        for item, out in zip(items, decoded, strict=True):
            _check_value(item, out)
        return
    else:  # null_value, or no kind set
        same = decoded is None
    if not same:
        raise AssertionError(f"{kind} {value!r:.200} decoded as {decoded!r:.200}")


ECHO = EchoEnvironment()
ECHO.reset(seed=None, episode_id="fuzz", options=None)
ECHO_STEPS = [0]


def fuzz_tools(data: bytes) -> None:
    try:
        call = ToolCall.FromString(data)
    except DecodeError:
        return
    ECHO_STEPS[0] += 1
    if ECHO_STEPS[0] % 1000 == 0:  # a fresh episode now and then, as a trainer would
        ECHO.reset(seed=None, episode_id="fuzz", options=None)
    try:
        transition = ECHO.step(EchoAction(tool_call=call))
    except InvalidAction:
        return
    # Every echo tool takes strings and integers only, so NaN or an infinity anywhere in the
    # arguments is a bad argument (the toolbox says which), never the tool's input.
    if has_nonfinite(call.arguments):
        raise AssertionError(f"tool call with non-finite arguments ran: {call!r:.200}")
    transition.observation.SerializeToString()


def TestOneInput(data: bytes) -> None:  # atheris calls it by this name
    if not data:
        return
    target = data[0] % 4
    if target in (0, 1):
        fuzz_session(data[1:])
    elif target == 2:
        fuzz_codec(data[1:])
    else:
        fuzz_tools(data[1:])


# -- seeds -------------------------------------------------------------------------------


def seed_inputs() -> dict[str, bytes]:
    """Well-formed inputs for each target, so the fuzzer starts past the parsers, and
    ``regression-*`` inputs: ones that once crashed it (bugs 3 and 4 in
    docs/reliability.md, fixed in 0d3adcb); tests/test_fuzz_bounded.py replays each and
    checks the answers they must get now."""

    def request(request_id: int, **command: Any) -> bytes:
        return pb.SessionRequest(request_id=request_id, **command).SerializeToString()

    def step(request_id: int, action: EchoAction) -> bytes:
        message = pb.SessionRequest(request_id=request_id)
        message.step.action.type_url = SPEC.action_url
        message.step.action.value = action.SerializeToString()
        return message.SerializeToString()

    options = any_pb2.Any(
        type_url=SPEC.reset_options_url,
        value=EchoResetOptions(max_steps=3, stop_word="halt", greeting="hi").SerializeToString(),
    )
    call = ToolCall(name="count", call_id="c")
    call.arguments.update({"message": "banana", "letter": "a"})
    history = ToolCall(name="history")
    history.arguments.update({"last": 2})
    reset = request(1, reset=pb.ResetCommand(seed=7, episode_id="ep", options=options))
    session = [
        reset,
        step(2, EchoAction(message="hello")),
        step(3, EchoAction(list_tools={})),
        step(4, EchoAction(tool_call=call)),
        step(5, EchoAction(tool_call=history)),
        request(6, state=pb.StateCommand()),
        step(7, EchoAction(message="halt")),
        request(8, close=pb.CloseCommand()),
    ]
    struct = struct_pb2.Struct()
    struct.update({"lives": 3, "name": "x", "nested": {"a": [1, 2.5, None, True]}})
    nan_call = ToolCall(name="count", call_id="n")
    nan_call.arguments.update({"message": "abc", "letter": math.nan})
    infinite_call = ToolCall(name="history", call_id="i")
    infinite_call.arguments.update({"last": math.inf})
    infinite_info = struct_pb2.Struct()
    infinite_info.update({"loss": math.inf})
    return {
        "seed-session": b"\x00" + b"".join(frame(r) for r in session),
        "seed-edge-ids": b"\x01"
        + frame(request(0))
        + frame(request(2**64 - 1, state=pb.StateCommand())),
        "seed-codec": b"\x02"
        + frame(SPEC.action_url.encode())
        + frame(EchoAction(message="x").SerializeToString())
        + frame(struct.SerializeToString()),
        "seed-tool-count": b"\x03" + call.SerializeToString(),
        "seed-tool-history": b"\x03" + history.SerializeToString(),
        # A tool call whose argument is NaN: was INTERNAL (episode broken), now
        # INVALID_ARGUMENT from the toolbox; the episode goes on.
        "regression-nan-tool-argument": b"\x00"
        + frame(reset)
        + frame(step(2, EchoAction(tool_call=nan_call)))
        + frame(step(3, EchoAction(message="still running"))),
        # An integer argument that is Infinity: was INTERNAL too (found by
        # tests/test_fuzz_properties.py); now INVALID_ARGUMENT "must be finite".
        "regression-infinite-tool-argument": b"\x03" + infinite_call.SerializeToString(),
        # A step's info holding Infinity: the client's info_from_struct raised ValueError;
        # now it decodes to float("inf").
        "regression-infinite-info": b"\x02"
        + frame(b"")
        + frame(b"")
        + frame(infinite_info.SerializeToString()),
    }


def write_corpus(corpus: Path) -> None:
    corpus.mkdir(parents=True, exist_ok=True)
    for name, data in seed_inputs().items():
        (corpus / name).write_bytes(data)


def seed_corpus(argv: list[str]) -> None:
    """Fill the first corpus directory on the command line, if it is empty."""
    directories = [a for a in argv[1:] if not a.startswith("-")]
    if not directories:
        return
    corpus = Path(directories[0])
    if corpus.is_file():
        return  # replaying a single input
    if not corpus.exists() or not any(corpus.iterdir()):
        write_corpus(corpus)


def main() -> None:
    if sys.argv[1:2] == ["--write-corpus"]:  # write the seeds to DIR and stop
        write_corpus(Path(sys.argv[2]))
        return
    seed_corpus(sys.argv)
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
