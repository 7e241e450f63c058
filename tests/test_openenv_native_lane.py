"""The door's native lane (a ``/ws`` step of a bridged env served in process: OpenEnv's
own ``deserialize_action`` and ``serialize_observation``, no protobuf), on real server
processes: OpenEnv's frames where they are small, bounded where OpenEnv's are not, and
an observation pydantic cannot write still answered (the env has moved)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from openenv_grpc.integrations.openenv.native import MAX_ECHOED_BYTES, MAX_ERRORS
from openenv_grpc.testing import ServerProcess

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
from test_openenv_gateway import gateway_url  # noqa: E402

RESET = {"type": "reset", "data": {}}


def _serve(*args: str) -> ServerProcess:
    return ServerProcess(
        "--openenv=support.openenv_envs.odd:OddEnvironment",
        ["--openenv-port", "0", *args],
        pythonpath=[TESTS],
    )


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    served = _serve()
    try:
        yield served
    finally:
        served.stop()


def talk(server: ServerProcess, sent: list[Any]) -> list[dict[str, Any]]:
    """One socket's answers to ``sent``, in order."""
    url = gateway_url(server).replace("http://", "ws://") + "/ws"

    async def run() -> list[dict[str, Any]]:
        async with websockets.connect(url, max_size=None) as ws:
            answers = []
            for frame in sent:
                await ws.send(json.dumps(frame))
                answers.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
            return answers

    return asyncio.run(run())


def step(data: Any) -> dict[str, Any]:
    return {"type": "step", "data": data}


def test_a_small_refusal_is_openenv_s_own_frame(server: ServerProcess) -> None:
    refusal = talk(server, [RESET, step({"text": 5})])[1]
    assert refusal["type"] == "error"
    assert refusal["data"]["message"] == "Invalid message"
    assert refusal["data"]["code"] == "VALIDATION_ERROR"
    [error] = refusal["data"]["errors"]
    assert error["type"] == "string_type" and error["loc"] == ["text"] and error["input"] == 5


def test_a_refusal_lists_the_first_errors_and_echoes_no_large_input(
    server: ServerProcess,
) -> None:
    """40 fields the model forbids, 2,000 bytes each (an 80 KB frame): the first 16 errors
    and a count, without the inputs (OpenEnv's frame would hold all 40, each echoing its
    input); the session goes on."""
    data = {"text": "x", **{f"k{i}": "v" * 2000 for i in range(40)}}
    assert len(json.dumps(step(data))) * 40 > MAX_ECHOED_BYTES
    refusal, after = talk(server, [RESET, step(data), step({"text": "next"})])[1:]
    errors = refusal["data"]["errors"]
    assert refusal["data"]["code"] == "VALIDATION_ERROR"
    assert len(errors) == MAX_ERRORS + 1
    assert all(e["type"] == "extra_forbidden" and "input" not in e for e in errors[:-1])
    assert errors[-1]["type"] == "too_many_errors" and errors[-1]["msg"].startswith("40 ")
    assert len(json.dumps(refusal)) < 8 * 1024
    assert after["type"] == "observation" and after["data"]["observation"]["text"] == "next"


def test_a_refusal_of_thousands_of_errors_lists_none(server: ServerProcess) -> None:
    """5,000 forbidden fields: a count, not 5,000 entries (listing them would cost the
    event loop ~25 ms and make an answer larger than the frame)."""
    data = {"text": "x", **{f"k{i}": 1 for i in range(5000)}}
    refusal = talk(server, [RESET, step(data)])[1]
    [error] = refusal["data"]["errors"]
    assert error["type"] == "too_many_errors" and error["msg"].startswith("5000 ")
    assert len(json.dumps(refusal)) < 1024


@pytest.mark.parametrize("data", [[], "text", 5, None])
def test_step_data_that_is_no_object_is_openenv_s_validation_error(
    server: ServerProcess, data: Any
) -> None:
    """OpenEnv's server refuses it as a ``WSStepMessage`` (its data is a dict; null is no
    dict either): the same frame here, with no traceback in the server's log, and the env
    did not step."""
    refusal, state = talk(server, [RESET, step(data), {"type": "state"}])[1:]
    assert refusal["data"]["code"] == "VALIDATION_ERROR"
    [error] = refusal["data"]["errors"]
    assert error["type"] == "dict_type" and error["loc"] == ["data"] and error["input"] == data
    assert state["data"]["step_count"] == 0
    assert "Traceback" not in server.stderr()


def test_an_observation_pydantic_cannot_write_is_still_the_observation(
    server: ServerProcess,
) -> None:
    """The observation's serializer raises after the env stepped: the frame is written
    field by field (not an error the client would retry, stepping twice)."""
    answers = talk(server, [RESET, step({"text": "unwritable"}), {"type": "state"}])
    observation, state = answers[1], answers[2]
    assert observation["type"] == "observation"
    assert observation["data"]["observation"]["text"] == "unwritable"
    assert observation["data"]["reward"] == 1.0 and observation["data"]["done"] is False
    assert state["data"]["step_count"] == 1


def test_an_object_whose_repr_raises_is_named_in_the_observation(server: ServerProcess) -> None:
    """pydantic cannot write the object and its ``repr`` raises: it is named, the rest of
    the observation written, no traceback (the env has moved)."""
    observation = talk(server, [RESET, step({"text": "unrepresentable"})])[1]
    assert observation["type"] == "observation"
    assert observation["data"]["observation"]["text"] == "unrepresentable"
    assert observation["data"]["observation"]["extra"].startswith("<unrepresentable")
    assert "Traceback" not in server.stderr()


def test_a_frame_over_the_message_limit_is_measured_in_bytes_on_a_held_session() -> None:
    """``--max-message-bytes 100000``: an observation frame of 30,000 four-byte characters
    (120,000 bytes of UTF-8) on a socket attached to a held session is refused as on a
    socket of its own; the session goes on."""
    import urllib.request

    limited = _serve("--max-message-bytes", "100000")
    try:
        url = gateway_url(limited)
        request = urllib.request.Request(
            f"{url}/mcp",
            json.dumps({"jsonrpc": "2.0", "id": 1, "method": "openenv/session/create"}).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            held = json.load(answer)["result"]["session_id"]
        base = url.replace("http://", "ws://") + "/ws"

        async def run(ws_url: str) -> list[dict[str, Any]]:
            async with websockets.connect(ws_url, max_size=None) as ws:
                answers = []
                for frame in [RESET, step({"text": "twice:" + "\U0001f600" * 15_000}),
                              step({"text": "small"})]:  # fmt: skip
                    await ws.send(json.dumps(frame, ensure_ascii=False))
                    answers.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
                return answers

        for ws_url in (base, f"{base}?session_id={held}"):
            refusal, after = asyncio.run(run(ws_url))[1:]
            assert refusal["type"] == "error", ws_url
            assert "over the server's message limit of 100000 bytes" in refusal["data"]["message"]
            assert after["data"]["observation"]["text"] == "small"
    finally:
        limited.stop()


def test_an_isolated_bridged_env_answers_the_same_frames_by_the_typed_path(
    server: ServerProcess,
) -> None:
    """With ``--isolated`` the env runs in another process: its steps take the typed path
    (protobuf to the env process) and answer the same observation frames."""
    sent = [RESET, step({"text": "hi"}), step({"text": "again"})]
    isolated = _serve("--isolated", "1")
    try:
        theirs = talk(isolated, sent)
    finally:
        isolated.stop()
    assert theirs == talk(server, sent)


def test_replaced_values_are_logged_once_a_period(caplog: pytest.LogCaptureFixture) -> None:
    """A client whose action comes back in every observation (an echo) must not write a
    log line per frame: one line a period, with the count of those left out."""
    from openenv_grpc.integrations.openenv import json_checks

    json_checks._logged.update(at=-json_checks.LOG_PERIOD, since=0)
    with caplog.at_level("WARNING", logger=json_checks.__name__):
        for _ in range(1000):
            json_checks.safe_jsonable({"text": "\ud800"}, "observation", json_checks.Warnings())
    lines = [r.getMessage() for r in caplog.records if r.name == json_checks.__name__]
    assert len(lines) == 1 and "lone surrogate" in lines[0]
    json_checks._logged["at"] -= json_checks.LOG_PERIOD  # the period is over
    with caplog.at_level("WARNING", logger=json_checks.__name__):
        json_checks.safe_jsonable({"text": "\ud800"}, "observation", json_checks.Warnings())
    lines = [r.getMessage() for r in caplog.records if r.name == json_checks.__name__]
    assert len(lines) == 2 and lines[1].endswith("(and 999 more since)")
