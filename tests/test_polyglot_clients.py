"""Trainers in other languages: the Node.js (clients/node) and Go (clients/go) players run
full episodes against real servers, and their JSON summaries are checked; the Node vector
player steps N envs over one VectorSession stream.

Each player opens a Session, provokes in-band errors (a step before reset, a step after
truncation, an illegal OpenSpiel action), plays episodes to their end, reads the state and
closes; against a full server it retries the refused open after the server's pushback.
The Node player also snapshots and restores an echo episode (``--snapshot``).
A missing ``node``, ``go`` or ``clients/node/node_modules`` fails these tests: CI must
install them (``make clients``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.echo import EchoAction, EchoEnv

ROOT = Path(__file__).resolve().parent.parent
NODE_DIR = ROOT / "clients" / "node"
GO_DIR = ROOT / "clients" / "go"
PUSHBACK_MS = 200
RUN_TIMEOUT = 60.0

INVALID_ARGUMENT = 3
FAILED_PRECONDITION = 9


def _need(tool: str, hint: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is not installed: {hint}")
    return path


@pytest.fixture(scope="module")
def node_play() -> list[str]:
    """The command line of the Node player."""
    node = _need("node", "apt-get install nodejs npm")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("clients/node/node_modules is missing: run `make clients` (npm ci there)")
    return [node, str(NODE_DIR / "play.js")]


@pytest.fixture(scope="module")
def go_play(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The Go player, built in GOPATH mode from freshly generated stubs."""
    go = _need("go", "apt-get install golang-go golang-google-grpc-dev ... (see clients/go)")
    gopath = tmp_path_factory.mktemp("gopath")
    subprocess.run(
        [str(GO_DIR / "generate.sh"), str(gopath)], check=True, capture_output=True, timeout=60
    )
    binary = gopath / "bin" / "play"
    environ = {
        **os.environ,
        "GOPATH": f"{gopath}{os.pathsep}/usr/share/gocode",
        "GO111MODULE": "off",
        "GOFLAGS": "",
    }
    built = subprocess.run(
        [go, "build", "-o", str(binary), "openenvgrpc/client/play"],
        cwd=gopath, env=environ, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, f"go build failed:\n{built.stderr}"
    return [str(binary)]


@pytest.fixture(scope="module")
def burst_commands(
    node_play: list[str], go_play: list[str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[str]]:
    """The burst programs (``clients/node/burst.js``, ``clients/go/burst``) by client:
    COUNT opens at once on one connection, no retry, one JSON summary line."""
    gopath = Path(go_play[0]).parent.parent  # the go_play fixture's GOPATH, stubs made
    binary = gopath / "bin" / "burst"
    environ = {
        **os.environ,
        "GOPATH": f"{gopath}{os.pathsep}/usr/share/gocode",
        "GO111MODULE": "off",
        "GOFLAGS": "",
    }
    built = subprocess.run(
        ["go", "build", "-o", str(binary), "openenvgrpc/client/burst"],
        cwd=gopath, env=environ, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, f"go build failed:\n{built.stderr}"
    return {"node": [node_play[0], str(NODE_DIR / "burst.js")], "go": [str(binary)]}


@pytest.fixture(params=["node", "go"])
def player(request: pytest.FixtureRequest) -> list[str]:
    """Each player in turn."""
    command: list[str] = request.getfixturevalue(f"{request.param}_play")
    return command


@pytest.fixture(scope="module")
def echo_server() -> Iterator[ServerProcess]:
    server = ServerProcess("echo")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def openspiel_server() -> Iterator[ServerProcess]:
    server = ServerProcess("openspiel")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def full_server() -> Iterator[ServerProcess]:
    """A one-session echo server; tests hold its slot to make it refuse."""
    server = ServerProcess(
        "echo", ["--max-concurrent-envs", "1", "--retry-pushback-ms", str(PUSHBACK_MS)]
    )
    yield server
    server.stop()


def _summary(stdout: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, f"expected one JSON summary line, got:\n{stdout}"
    summary: dict[str, Any] = json.loads(lines[0])
    return summary


def _play(player: list[str], target: str, *args: str) -> tuple[int, dict[str, Any], str]:
    done = subprocess.run(
        [*player, "--target", target, *args],
        capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )  # fmt: skip
    return done.returncode, _summary(done.stdout), done.stderr


def _codes(summary: dict[str, Any]) -> dict[str, int]:
    return {error["when"]: error["code"] for error in summary["errors"]}


def test_echo_episodes_until_truncated(player: list[str], echo_server: ServerProcess) -> None:
    code, summary, stderr = _play(
        player, echo_server.target, "--env", "echo", "--episodes", "3", "--max-steps", "4"
    )
    assert code == 0, stderr
    assert summary["env_name"] == "echo" and summary["session_id"]
    assert summary["episodes_finished"] == 3 and summary["closed"] is True
    for episode in summary["episodes"]:
        assert episode["truncated"] is True and episode["terminated"] is False
        assert episode["steps"] == episode["state_step_count"] == 4
        assert episode["state_ok"] is True
    assert len({e["episode_id"] for e in summary["episodes"]}) == 3
    assert _codes(summary) == {
        "step before reset": FAILED_PRECONDITION,
        "step after truncation": FAILED_PRECONDITION,
    }
    assert {e["code_name"] for e in summary["errors"]} == {"FAILED_PRECONDITION"}
    assert summary["capacity"] == {"refusals": 0, "pushback_ms": [], "admitted": True}
    echo_server.wait_until(lambda: echo_server.active() == 0)


@pytest.mark.parametrize("game", ["tic_tac_toe", "catch"])
def test_openspiel_games_to_the_end(
    player: list[str], openspiel_server: ServerProcess, game: str
) -> None:
    code, summary, stderr = _play(player, openspiel_server.target, "--env", "openspiel",
                                  "--game", game, "--episodes", "2")  # fmt: skip
    assert code == 0, stderr
    assert summary["env_name"] == "openspiel"
    assert summary["episodes_finished"] == 2 and summary["closed"] is True
    for episode in summary["episodes"]:
        assert episode["terminated"] is True and episode["truncated"] is False
        assert episode["steps"] == episode["state_step_count"] >= 1
        assert episode["state_ok"] is True and episode["game"].startswith(game)
        assert episode["board_ok"] is True  # render's text is the state's board
        assert episode["reward"] == pytest.approx(episode["returns"][0])
    codes = _codes(summary)
    assert codes.pop("step before reset") == FAILED_PRECONDITION
    [(when, illegal)] = codes.items()
    assert when.startswith("illegal action id") and illegal == INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("mode", "ended", "steps"),
    [("next_step", [2, 1, 1], [1, 2, 2]), ("same_step", [3, 2, 1], [1, 0, 3])],
)
def test_node_vector_player_steps_n_envs_on_one_stream(
    node_play: list[str], echo_server: ServerProcess, mode: str, ended: list[int], steps: list[int]
) -> None:
    """Env i truncates after 2 + i steps; six vector steps, then one of envs 0 and 2: the
    autoresets and step counts are those of Gymnasium's mode, worked out by hand."""
    vector = [node_play[0], str(NODE_DIR / "vector.js")]
    code, summary, stderr = _play(vector, echo_server.target, "--envs", "3", "--autoreset", mode)
    assert code == 0, stderr
    assert summary["kind"] == "vector" and summary["native"] is False and summary["session_id"]
    assert summary["per_env_errors"] == [
        {"when": "step before reset", "rows": 0, "codes": [FAILED_PRECONDITION] * 3}
    ]
    assert {r["when"]: r["code"] for r in summary["refusals"]} == {
        "wrong action count": INVALID_ARGUMENT,
        "index out of range": INVALID_ARGUMENT,
    }
    assert summary["steps"] == 6 and summary["env_steps"] == 18
    assert summary["episodes_ended"] == ended and summary["autoresets"] == ended
    assert summary["partial_rows"] == [0, 2] and summary["step_counts"] == steps
    assert summary["state_ok"] is True and summary["closed"] is True
    echo_server.wait_until(lambda: echo_server.active() == 0)


def test_node_and_go_play_alike(
    node_play: list[str], go_play: list[str], openspiel_server: ServerProcess
) -> None:
    """Same seeds, same generator: both players see the same catch episodes."""
    args = ["--env", "openspiel", "--game", "catch", "--episodes", "3", "--seed", "7"]
    runs = [_play(p, openspiel_server.target, *args) for p in (node_play, go_play)]
    assert [code for code, _, _ in runs] == [0, 0], [stderr for _, _, stderr in runs]
    node, go = (
        [(e["steps"], e["reward"], e["returns"]) for e in s["episodes"]] for _, s, _ in runs
    )
    assert node == go


def test_full_server_open_retried_after_pushback(
    player: list[str], full_server: ServerProcess
) -> None:
    refused = threading.Event()
    lines: list[str] = []
    with EchoEnv(full_server.target) as holder:  # takes the only slot
        holder.reset()
        proc = subprocess.Popen(
            [*player, "--target", full_server.target, "--env", "echo", "--episodes", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

        def read_stderr() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                lines.append(line)
                if "open refused" in line:
                    refused.set()

        reader = threading.Thread(target=read_stderr, daemon=True)
        reader.start()
        try:
            assert refused.wait(RUN_TIMEOUT), "".join(lines)
        except BaseException:
            proc.kill()
            raise
    # The holder's stream ended: its slot frees and the player's next retry gets in.
    stdout, _ = proc.communicate(timeout=RUN_TIMEOUT)
    reader.join(5)
    assert proc.returncode == 0, "".join(lines)
    summary = _summary(stdout)
    capacity = summary["capacity"]
    assert capacity["admitted"] is True and capacity["refusals"] >= 1
    assert capacity["pushback_ms"] == [PUSHBACK_MS] * capacity["refusals"]
    assert "RESOURCE_EXHAUSTED" in "".join(lines) or "ResourceExhausted" in "".join(lines)
    assert summary["episodes_finished"] == 1 and summary["closed"] is True
    full_server.wait_until(lambda: full_server.active() == 0)


def test_full_server_without_retries_reports_capacity(
    player: list[str], full_server: ServerProcess
) -> None:
    with EchoEnv(full_server.target) as holder:
        holder.reset()
        code, summary, _ = _play(player, full_server.target, "--env", "echo", "--open-retries", "0")
    assert code == 1
    assert summary["capacity"]["admitted"] is False and summary["episodes"] == []
    assert "RESOURCE_EXHAUSTED" in summary["failure"] or "ResourceExhausted" in summary["failure"]


def test_players_read_past_a_drain_notice(player: list[str]) -> None:
    """A draining server tells each session so with a notice (request_id 0) that answers no
    request: the players skip it and play on through the grace period."""
    server = ServerProcess(
        "support.envs:SlowFactoryEchoEnv", ["--grace", "30"],
        {"OPENENV_TEST_FACTORY_SECONDS": "1.5"}, pythonpath=[ROOT / "tests"],
    )  # fmt: skip
    proc = subprocess.Popen(
        [*player, "--target", server.target, "--env", "echo", "--episodes", "2",
         "--max-steps", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # SIGTERM while the player's env is being built: the notice is the first message
        # after the headers, before the answer to the player's first request.
        server.wait_until(lambda: server.active() == 1, 20, "the player's open admitted")
        server.proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT)
        assert proc.returncode == 0, stderr
        summary = _summary(stdout)
        assert summary["episodes_finished"] == 2 and summary["closed"] is True
        assert server.proc.wait(15) == 0  # the drain ended with the player's session
    finally:
        proc.kill()
        server.stop()


SNAPSHOT_KEYS = {"SNAPSHOT_KEYS": "polyglot:0123456789abcdef0123456789abcdef"}
UNIMPLEMENTED = 12


def test_node_snapshots_restores_and_is_refused_a_tampered_copy(node_play: list[str]) -> None:
    """The Node player branches an echo episode: snapshot, restore on the same and on a
    second session, the same rewards each time; a tampered copy refused in-band. Its
    snapshot then restores from Python on another server process with the same key."""
    support = [ROOT / "tests"]
    servers = [
        ServerProcess("support.envs:SnapshotEchoEnv", [], SNAPSHOT_KEYS, pythonpath=support)
        for _ in range(2)
    ]
    try:
        code, summary, stderr = _play(node_play, servers[0].target, "--env", "echo",
                                      "--snapshot", "--seed", "5")  # fmt: skip
        assert code == 0, stderr
        snap = summary["snapshot"]
        assert snap["original"] == snap["again"] == snap["there"] and len(snap["original"]) == 3
        assert snap["restored"]["step_count"] == snap["elsewhere"]["step_count"] == 2
        assert snap["restored"]["episode_id"] == snap["elsewhere"]["episode_id"]
        assert snap["tampered_code"] == INVALID_ARGUMENT
        assert snap["step_after_refusal"] == 2 + 3 + 1  # the refusal changed nothing
        assert summary["episodes_finished"] == 2 and summary["closed"] is True
        with EchoEnv(servers[1].target) as env:  # Node's bytes, another process, Python
            assert env.restore(bytes.fromhex(snap["hex"])).step_count == 2
            rewards = [env.step(EchoAction(message=m)).reward for m in ("one", "two", "three")]
        assert rewards == snap["original"]
        servers[0].wait_until(lambda: servers[0].active() == 0)
    finally:
        for server in servers:
            server.stop()


def test_node_sees_unimplemented_from_an_env_without_snapshots(node_play: list[str]) -> None:
    server = ServerProcess("support.envs:DeterministicEchoEnv", [], pythonpath=[ROOT / "tests"])
    try:
        code, summary, stderr = _play(node_play, server.target, "--env", "echo", "--snapshot")
        assert code == 0, stderr
        assert summary["snapshot"]["code"] == UNIMPLEMENTED
        assert "does not support snapshots" in summary["snapshot"]["message"]
        assert summary["episodes_finished"] == 2 and summary["closed"] is True
    finally:
        server.stop()


def test_node_plays_a_bridged_openenv_env_from_info_descriptors(node_play: list[str]) -> None:
    """An OpenEnv env served with --openenv has no .proto files anywhere: the Node client
    builds its types from the Info RPC's FileDescriptorSet and plays it, and sees what
    the Python client sees for the same actions."""
    from openenv_grpc.integrations.openenv import described_session

    tests = Path(__file__).resolve().parent
    server = ServerProcess(
        "--openenv=support.openenv_envs.warehouse:WarehouseEnvironment", pythonpath=[tests]
    )
    try:
        pick = {"lines": [{"item": {"sku": "bolt", "size": 2, "tags": ["m4"]}, "quantity": 2}],
                "note": "fragile", "hints": [{"key": "speed", "value": 1.5}]}  # fmt: skip
        finish = {"lines": [{"item": {"sku": "apple"}, "quantity": 2},
                            {"item": {"sku": "cable"}, "quantity": 3}]}  # fmt: skip
        actions = [pick, {"mode": "steal"}, finish]
        done = subprocess.run(
            [node_play[0], str(NODE_DIR / "play_described.js"), "--target", server.target,
             "--reset", json.dumps({"seed": 3, "options": {"difficulty": 2}}),
             "--actions", json.dumps(actions)],
            capture_output=True, text=True, timeout=RUN_TIMEOUT,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        summary = _summary(done.stdout)
        assert summary["env_name"] == "WarehouseEnvironment" and summary["closed"]
        first, picked, finished = summary["results"]
        assert first["observation"]["missing"] == ["apple", "bolt", "cable"]
        assert picked["observation"]["basket"] == [
            {"item": {"sku": "bolt", "size": "SIZE_LARGE", "tags": ["m4"]}, "quantity": 2}
        ]
        assert picked["observation"]["last_note"] == "fragile"
        assert picked["reward"] == pytest.approx(-0.1)
        assert finished["terminated"] and finished["reward"] == 1.0
        # The refused action: in-band INVALID_ARGUMENT with pydantic's words.
        [error] = summary["errors"]
        assert (error["index"], error["code"]) == (1, INVALID_ARGUMENT)
        assert error["message"] == "invalid PickAction: mode: Input should be 'add' or 'remove'"
        assert summary["state"]["difficulty"] == 2
        # The Python client, typed from the same Info, sees the same episode.
        Warehouse = described_session(server.target)
        with Warehouse(server.target) as env:
            env.reset(seed=3, options=Warehouse.ResetOptions(difficulty=2))
            action = Warehouse.Action(note="fragile")
            action.hints["speed"] = 1.5
            line = action.lines.add(quantity=2)
            line.item.sku, line.item.size = "bolt", 2
            line.item.tags.append("m4")
            result = env.step(action)
            assert list(result.observation.missing) == picked["observation"]["missing"]
            assert result.reward == pytest.approx(picked["reward"])
            assert result.observation.weights == picked["observation"]["weights"]
    finally:
        server.stop()


@pytest.mark.parametrize("write_first", [False, True], ids=["headers-first", "write-first"])
@pytest.mark.parametrize("client", ["node", "go"])
def test_a_burst_past_the_capacity_on_one_connection_is_admitted_or_full_with_pushback(
    burst_commands: dict[str, list[str]], client: str, write_first: bool
) -> None:
    """4,000 opens at once on one grpc-js / grpc-go connection, at the default capacity
    (1,024), no retry: each is admitted or RESOURCE_EXHAUSTED with the pushback hint.
    Before: grpc-go saw 1,406 UNAVAILABLE (REFUSED_STREAM) waiting for its headers, 221
    sending first; grpc-js 275 sending first."""
    server = ServerProcess("echo")
    try:
        flags = ["--write-first"] if write_first else []
        done = subprocess.run(
            [*burst_commands[client], server.target, "4000", *flags],
            capture_output=True, text=True, timeout=RUN_TIMEOUT * 2,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        full = (
            "RESOURCE_EXHAUSTED (pushback)" if client == "node" else "ResourceExhausted (pushback)"
        )
        assert _summary(done.stdout) == {"admitted": 1024, "outcomes": {full: 2976}}
        ServerProcess.wait_until(
            lambda: server.active() == 0, 30, "every admitted session released"
        )
    finally:
        server.stop()
