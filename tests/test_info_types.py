"""A result's info keeps its JSON types (issue 39): an int stays an int, also beyond 2^53,
a float a float, nested values as they were -- for the Python Session and VectorSession,
the Node and Go example clients, and with ``--isolated`` (infos cross the env process).

A client that opens with ``openenv-info: json`` gets ``info_json`` (JSON text); an old
client, which never sends the key, still gets the ``google.protobuf.Struct`` it reads. An
info JSON cannot write (NaN, infinities) comes as the Struct to every client.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from openenv_grpc import VectorSession
from openenv_grpc.codec import info_from_struct
from openenv_grpc.metadata import INFO_JSON, INFO_KEY
from openenv_grpc.testing import ServerProcess
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc
from openenv_grpc_envs.echo import EchoAction, EchoEnv, EchoResetOptions
from support.info_envs import BIG, HUGE, typed_info
from support.raw_vector import open_metadata

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
ENV = "support.info_envs:TypedInfoEcho"


def typed(value: Any) -> Any:
    """``value`` with every leaf paired with its exact type: equal only if the types are."""
    if isinstance(value, dict):
        return {key: typed(item) for key, item in value.items()}
    if isinstance(value, list):
        return [typed(item) for item in value]
    return (type(value).__name__, value)


@pytest.fixture(scope="module", params=["in-process", "isolated"])
def info_server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """A server of TypedInfoEcho: envs in the server, or in env processes."""
    args = ["--isolated", "1"] if request.param == "isolated" else []
    server = ServerProcess(ENV, args, pythonpath=[TESTS])
    yield server
    server.stop()


def test_session_info_keeps_ints_floats_and_nesting(info_server: ServerProcess) -> None:
    with EchoEnv(info_server.target) as env:
        assert typed(env.reset().info) == typed(typed_info(0))
        for step in (1, 2):
            result = env.step(EchoAction(message="m"))
            assert typed(result.info) == typed(typed_info(step))
        assert result.info["big"] == BIG and type(result.info["lives"]) is int
        assert type(result.info["whole_float"]) is float  # 2.0 stays a float


def test_vector_infos_and_final_infos_keep_their_types(info_server: ServerProcess) -> None:
    with VectorSession(info_server.target, 3) as envs:
        first = envs.reset()
        assert {i: typed(info) for i, info in first.infos.items()} == {
            i: typed(typed_info(0)) for i in range(3)
        }
        step = envs.step([EchoAction(message="v")] * 3)
        assert [typed(step.infos[i]) for i in range(3)] == [typed(typed_info(1))] * 3
    # SAME_STEP: the ended episodes' last infos come as final_infos, typed too.
    with VectorSession(info_server.target, 2, autoreset="same_step") as envs:
        envs.reset(options=EchoResetOptions(max_steps=1))
        ended = envs.step([EchoAction(message="w")] * 2)
        assert ended.autoreset == [True, True]
        assert [typed(ended.final_infos[i]) for i in range(2)] == [typed(typed_info(1))] * 2
        assert [typed(ended.infos[i]) for i in range(2)] == [typed(typed_info(0))] * 2


def test_an_info_with_nan_comes_as_the_struct(info_server: ServerProcess) -> None:
    """JSON has no NaN: such an info is the Struct's (numbers floats), NaN kept."""
    with EchoEnv(info_server.target) as env:
        env.reset()
        info = env.step(EchoAction(message="nan")).info
        assert math.isnan(info.pop("loss"))
        assert info["lives"] == 3 and type(info["lives"]) is float
        assert info["big"] == float(BIG) and info["nested"]["inner"] == {"x": 7.0, "y": 1.25}
        # The next info JSON can write is JSON again.
        assert type(env.step(EchoAction(message="m")).info["lives"]) is int


def _raw_step(
    stub: pb_grpc.EnvServiceStub, metadata: list[tuple[str, str]]
) -> tuple[pb.StepResult, pb.StepResult]:
    """Reset and one step on a raw Session stream opened with ``metadata``."""
    step = pb.SessionRequest(request_id=2)
    step.step.action.type_url = "type.googleapis.com/" + EchoAction.DESCRIPTOR.full_name
    step.step.action.value = EchoAction(message="raw").SerializeToString()
    requests = [
        pb.SessionRequest(request_id=1, reset=pb.ResetCommand()),
        step,
        pb.SessionRequest(request_id=3, close=pb.CloseCommand()),
    ]
    answers = list(stub.Session(iter(requests), metadata=metadata, timeout=30))
    assert [a.WhichOneof("outcome") for a in answers] == ["result", "result", "closed"]
    return answers[0].result, answers[1].result


def test_an_old_client_still_gets_the_struct_and_a_new_one_json(
    info_server: ServerProcess,
) -> None:
    """No openenv-info key (every client before this change): the Struct, info_json empty;
    ``json`` (any case): info_json only; any other value: the Struct."""
    with grpc.insecure_channel(info_server.target) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        for metadata in ([], [(INFO_KEY, "struct")]):
            for result in _raw_step(stub, metadata):
                assert result.info_json == "" and result.info.fields["lives"].number_value == 3
                assert info_from_struct(result.info)["big"] == float(BIG)
        for value in (INFO_JSON, "JSON"):
            reset, step = _raw_step(stub, [(INFO_KEY, value)])
            assert not reset.HasField("info") and not step.HasField("info")
            assert json.loads(step.info_json) == typed_info(1)
        # A raw vector stream: the same choice, per stream.
        json_open = [*open_metadata(2), (INFO_KEY, "json")]
        for metadata, as_json in ((open_metadata(2), False), (json_open, True)):
            requests = [
                pb.VectorSessionRequest(request_id=1, reset=pb.VectorReset()),
                pb.VectorSessionRequest(request_id=2, close=pb.CloseCommand()),
            ]
            answers = list(stub.VectorSession(iter(requests), metadata=metadata, timeout=30))
            result = answers[0].result
            if as_json:
                assert not result.infos and sorted(result.infos_json) == [0, 1]
                assert json.loads(result.infos_json[1]) == typed_info(0)
            else:
                assert not result.infos_json and sorted(result.infos) == [0, 1]
                assert result.infos[1].fields["big"].number_value == float(BIG)


# -- the Node and Go example clients ------------------------------------------------------


def _need(tool: str) -> str:
    found = shutil.which(tool)
    if found is None:
        pytest.fail(f"{tool} is not installed (make system-deps)")
    return found


def test_node_client_reads_ints_as_ints_and_big_ints_as_bigints(
    info_server: ServerProcess,
) -> None:
    node = _need("node")
    if not (ROOT / "clients" / "node" / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("clients/node/node_modules is missing: run `make clients`")
    script = str(ROOT / "clients" / "node" / "infos.js")
    ran = subprocess.run(
        [node, script, "--target", info_server.target], capture_output=True, text=True, timeout=60
    )
    assert ran.returncode == 0, ran.stderr
    summary = json.loads(ran.stdout)

    def as_node(value: Any) -> Any:  # what infos.js prints for typed_info's values
        if isinstance(value, dict):
            return {key: as_node(item) for key, item in value.items()}
        if isinstance(value, list):
            return [as_node(item) for item in value]
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**53:
            return {"$bigint": str(value)}
        return value

    assert summary["reset"] == as_node(typed_info(0))
    assert summary["step"] == as_node(typed_info(1))
    assert summary["big_is_bigint"] is True and summary["lives_is_integer"] is True
    assert summary["nan_loss_is_nan"] is True and summary["nan_info_lives"] == 3
    assert summary["vector"] == {"0": as_node(typed_info(1)), "1": as_node(typed_info(1))}


@pytest.fixture(scope="module")
def go_infos(tmp_path_factory: pytest.TempPathFactory) -> str:
    """clients/go/infos, built in GOPATH mode from freshly generated stubs."""
    go = _need("go")
    gopath = tmp_path_factory.mktemp("gopath")
    subprocess.run(
        [str(ROOT / "clients" / "go" / "generate.sh"), str(gopath)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    binary = gopath / "bin" / "infos"
    environ = {
        **os.environ,
        "GOPATH": f"{gopath}{os.pathsep}/usr/share/gocode",
        "GO111MODULE": "off",
        "GOFLAGS": "",
    }
    built = subprocess.run(
        [go, "build", "-o", str(binary), "openenvgrpc/client/infos"],
        cwd=gopath, env=environ, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, f"go build failed:\n{built.stderr}"
    return str(binary)


def _as_go(value: Any) -> Any:
    """What clients/go/infos prints for a value session.Info returns: numbers tagged with
    their Go type."""
    if isinstance(value, dict):
        return {key: _as_go(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_go(item) for item in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return {"int64": value} if -(2**63) <= value < 2**63 else {"bigint": str(value)}
    if math.isnan(value) or math.isinf(value):
        return {"float64": "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")}
    return {"float64": value}


def test_go_client_reads_ints_as_int64_and_floats_as_float64(
    go_infos: str, info_server: ServerProcess
) -> None:
    ran = subprocess.run(
        [go_infos, "--target", info_server.target], capture_output=True, text=True, timeout=60
    )
    assert ran.returncode == 0, ran.stderr
    summary = json.loads(ran.stdout)
    assert summary["reset"] == _as_go(typed_info(0))
    assert summary["step"] == _as_go(typed_info(1))
    assert summary["step"]["big"] == {"int64": BIG}  # 2^60 + 1 exact
    assert summary["step"]["huge"] == {"bigint": str(HUGE)}  # beyond int64: a *big.Int
    # An info with NaN came as the Struct: every number a float64.
    assert _go_floats(summary["nan"]) == _as_go({**_floats(typed_info(2)), "loss": math.nan})


def _go_floats(value: Any) -> Any:
    """Go's printed float64s as Python floats (Go writes 2^60 as 1152921504606847000: the
    same double, but a different int to Python)."""
    if isinstance(value, dict):
        if set(value) == {"float64"} and not isinstance(value["float64"], str):
            return {"float64": float(value["float64"])}
        return {key: _go_floats(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_go_floats(item) for item in value]
    return value


def _floats(value: Any) -> Any:
    """``value`` with every int a float, as the Struct carries it."""
    if isinstance(value, dict):
        return {key: _floats(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_floats(item) for item in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


# -- the OpenEnv wire ------------------------------------------------------------------------


def test_openenv_clients_get_a_native_env_s_ints_as_ints() -> None:
    """OpenEnv's own GenericEnvClient, on the server's OpenEnv door: the result's metadata
    (our info) has the env's types, as OpenEnv's own server would send them."""
    from openenv.core.generic_client import GenericEnvClient

    server = ServerProcess(ENV, ["--openenv-port", "0"], pythonpath=[TESTS])
    try:
        url = _gateway_url(server)
        with GenericEnvClient(base_url=url).sync() as env:
            first = env.reset()
            assert typed(first.observation["metadata"]) == typed(typed_info(0))
            step = env.step({"message": "o"})
            assert typed(step.observation["metadata"]) == typed(typed_info(1))
            # A NaN in the info leaves as null, as OpenEnv's own server writes it, never
            # as a bare NaN token (not JSON: strict parsers refuse the whole frame).
            nan = env.step({"message": "nan"})
            assert "loss" in nan.observation["metadata"]
            assert nan.observation["metadata"]["loss"] is None
        # The same over HTTP (a 500 before: the JSON encoder refused the NaN).
        request = urllib.request.Request(
            f"{url}/step", data=json.dumps({"action": {"message": "nan"}}).encode(),
            headers={"Content-Type": "application/json"}, method="POST",
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
        answer = json.loads(text, parse_constant=_no_constant)
        assert answer["observation"]["metadata"]["loss"] is None
    finally:
        server.stop()


def _no_constant(name: str) -> object:
    raise AssertionError(f"the frame carries the non-JSON token {name}")


def _gateway_url(server: ServerProcess) -> str:
    """The OpenEnv URL the serve process printed once its door listened."""
    pattern = re.compile(r"OpenEnv protocol on (http://\S+)")
    for _ in range(1200):  # bounded wait for the line, not a speed assertion
        for line in server.stdout_lines:
            match = pattern.search(line)
            if match:
                return match.group(1)
        if server.proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"no OpenEnv door line; stderr:\n{server.stderr()}")


def test_a_bridged_openenv_env_s_metadata_ints_stay_ints() -> None:
    """OpenEnv's echo template puts ``step`` (an int) in its metadata: our info has it as
    an int too (it was a float while info was only a Struct)."""
    from openenv_grpc.integrations.openenv import described_session

    server = ServerProcess(
        "--openenv=support.openenv_envs.echo:EchoEnvironment", pythonpath=[TESTS]
    )
    try:
        Echo = described_session(server.info())
        with Echo(server.target) as env:
            env.reset()
            info = env.step(Echo.Action(message="hello")).info
            assert typed(info) == typed({"original_message": "hello", "step": 1})
    finally:
        server.stop()
