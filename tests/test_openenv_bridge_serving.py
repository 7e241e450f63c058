"""``serve --openenv`` as a migrating user runs it: the env's own ``create_app`` module
or its class, from the env's folder, models named where nothing says them, the base
classes refused, the capacity guard on every path, step errors that keep the episode,
an async env that blocks its loop, and field names that collide with protobuf."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from openenv_grpc import CapacityError, EnvError, SessionLost
from openenv_grpc.cli import main
from openenv_grpc.client.info import fetch_info
from openenv_grpc.integrations.openenv import described_session
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.echo import EchoAction, EchoEnv

TESTS = Path(__file__).resolve().parent
BOARD_APP = "support.openenv_envs.apps:board_app"
BOARD = "support.openenv_envs.board"
SERVING = health_pb2.HealthCheckResponse.SERVING


def bridged(ref: str, *args: str) -> ServerProcess:
    return ServerProcess(f"--openenv={ref}", list(args), pythonpath=[TESTS])


@pytest.mark.fresh_server  # its own OpenEnv-bridged server (seconds of imports): make test
def test_the_envs_own_app_serves_with_its_create_app_types() -> None:
    """As uvicorn takes it: the module's create_app call names the env, the models
    (its step says only the base classes) and the env's name."""
    server = bridged(BOARD_APP)
    try:
        info = server.info()
        assert info.env_name == "board"  # create_app(..., env_name="board")
        assert info.action_type.endswith(".DropAction")
        assert info.observation_type.endswith(".BoardObservation")
        assert info.state_type.endswith(".BoardState")  # create_app(..., state_cls=...)
        assert info.capacity.max_sessions == 1  # not SUPPORTS_CONCURRENT_SESSIONS
        Board = described_session(info)
        with Board(server.target) as env:
            env.reset(seed=1)
            result = env.step(Board.Action(column=2))
            assert json.loads(result.observation.last_move.json) == [2, 2]
            assert json.loads(env.state().board.json)[2] == [0, 0, 1, 0]
    finally:
        server.stop()


def test_base_annotated_env_class_is_refused_naming_the_fix(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    assert main(["serve", f"--openenv={BOARD}:BoardEnvironment", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "BoardEnvironment: its action is openenv's base Action" in err
    assert "--openenv pkg.server.app:app" in err and "--action MODULE:ACTION" in err


@pytest.mark.fresh_server  # its own OpenEnv-bridged server (seconds of imports): make test
def test_action_and_observation_options_serve_a_base_annotated_class() -> None:
    server = bridged(
        f"{BOARD}:BoardEnvironment",
        f"--action={BOARD}:DropAction",
        f"--observation={BOARD}:BoardObservation",
        f"--state={BOARD}:BoardState",
    )
    try:
        info = server.info()
        assert info.action_type.endswith(".DropAction")
        assert info.state_type.endswith(".BoardState")
        Board = described_session(info)
        with Board(server.target) as env:
            env.reset()
            assert list(env.step(Board.Action(column=0)).observation.legal_actions) == [
                0, 1, 2, 3
            ]  # fmt: skip
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([f"--openenv={BOARD}:BoardEnvironment", f"--action={BOARD}:Nope"],
         "has no attribute 'Nope'"),
        ([f"--openenv={BOARD}:BoardEnvironment", f"--action={BOARD}:Player"],
         "--action support.openenv_envs.board:Player"),
        (["echo", f"--action={BOARD}:DropAction"], "go with --openenv"),
        (["--openenv=support.openenv_envs.apps:not_an_app"], "has no attribute"),
        (["--openenv=support.openenv_envs.apps"], "package.server.app:app"),
    ],
)  # fmt: skip
def test_bad_model_options_exit_2(
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    assert main(["serve", *args, "--port", "0"]) == 2
    assert message in capsys.readouterr().err


def test_serve_help_lists_the_model_options() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "openenv_grpc", "serve", "--help"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    for option in ("--openenv MODULE:APP_OR_CLASS", "--action MODULE:MODEL",
                   "--observation MODULE:MODEL", "--state MODULE:MODEL"):  # fmt: skip
        assert option in done.stdout


@pytest.mark.fresh_server  # its own OpenEnv-bridged server (seconds of imports): make test
def test_the_console_script_imports_from_the_current_directory(tmp_path: Path) -> None:
    """``openenv-grpc serve --openenv server.my_environment:MyEnvironment`` from the env's
    folder, as ``uvicorn server.app:app`` works there (the console script's sys.path
    starts with its bin directory, not the current one)."""
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "__init__.py").write_text("")
    shutil.copy(TESTS / "support/openenv_envs/echo.py", tmp_path / "server/my_environment.py")
    script = Path(sys.executable).parent / "openenv-grpc"
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    process = subprocess.Popen(
        [str(script), "serve", "--openenv", "server.my_environment:EchoEnvironment",
         "--host", "127.0.0.1", "--port", "0"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.search(r"serving EchoEnvironment on 127\.0\.0\.1:(\d+)", line)
        assert match, (line, process.stderr.read() if process.poll() is not None else "")
        target = f"127.0.0.1:{match.group(1)}"
        Echo = described_session(target)
        with Echo(target) as env:
            env.reset()
            assert env.step(Echo.Action(message="here")).observation.message_length == 4
    finally:
        process.kill()
        process.wait(10)


@pytest.mark.fresh_server  # its own OpenEnv-bridged server (seconds of imports): make test
def test_capacity_guard_holds_for_an_adapter_served_without_serve_config() -> None:
    """openenv_environment(..., action=, observation=) served as a plain ENV at
    --max-concurrent-envs 8: the env is not concurrency-safe, so capacity 1."""
    server = ServerProcess(
        "support.openenv_envs.adapters:warehouse_adapter",
        ["--max-concurrent-envs", "8"],
        pythonpath=[TESTS],
    )
    try:
        assert server.info().capacity.max_sessions == 1
        Warehouse = described_session(server.target)
        with Warehouse(server.target) as env:
            env.reset(seed=1)
            with pytest.raises(CapacityError):
                Warehouse(server.target).open()
            env.step(Warehouse.Action())  # the first session is unharmed
    finally:
        server.stop()


@pytest.mark.fresh_server  # its own OpenEnv-bridged server (seconds of imports): make test
def test_an_async_env_raising_system_exit_keeps_its_loop() -> None:
    """step_async raises SystemExit on the env's own loop, then a task it started does:
    the step fails (INTERNAL, named), and the loop lives on for the next reset, step and
    close (a SystemExit left bare stopped that loop for good)."""
    server = bridged("support.openenv_envs.blocking:BlockingEnvironment")
    try:
        Ping = described_session(server.target)
        with Ping(server.target) as env:
            env.reset()
            with pytest.raises(EnvError) as failed:
                env.step(Ping.Action(text="exit"))
            assert failed.value.code is grpc.StatusCode.INTERNAL
            assert failed.value.message == "step failed: SystemExit: 3"
            env.reset()
            assert env.step(Ping.Action(text="task-exit")).observation.text == "task-exit"
            assert env.step(Ping.Action(text="alive")).observation.text == "alive"
        assert server.health() == SERVING
        server.wait_until(lambda: "SystemExit" in server.stderr(), 10, "the task's exit logged")
        assert "Event loop is closed" not in server.stderr()
    finally:
        server.stop()


@pytest.mark.fresh_server  # a server of its own: make test
@pytest.mark.parametrize(("env", "goes_on"), [("ForgivingEchoEnv", True), ("StrictEchoEnv", False)])
def test_a_native_env_opts_into_openenvs_step_error_rule(env: str, goes_on: bool) -> None:
    server = ServerProcess(f"support.step_errors:{env}", pythonpath=[TESTS])
    try:
        with EchoEnv(server.target) as session:
            session.reset()
            with pytest.raises(EnvError) as raised:
                session.step(EchoAction(message="raise"))
            assert raised.value.code is grpc.StatusCode.INTERNAL
            assert raised.value.message == "step failed: RuntimeError: boom in step"
            if goes_on:
                result = session.step(EchoAction(message="next"))
                assert result.observation.echoed_message == "next"
            else:
                with pytest.raises(EnvError) as after:
                    session.step(EchoAction(message="next"))
                assert after.value.code is grpc.StatusCode.FAILED_PRECONDITION
    finally:
        server.stop()


@pytest.mark.fresh_server  # its own OpenEnv-bridged server (seconds of imports): make test
def test_an_async_env_blocking_its_loop_freezes_neither_health_nor_drain(
    tmp_path: Path,
) -> None:
    """reset_async calls time.sleep(60): the server's loop is not the env's, so health,
    Info and another session answer meanwhile, and a SIGTERM drain ends (its bound,
    grace + 3 s, is only a hang guard here), leaving the stuck env unclosed."""
    server = bridged("support.openenv_envs.blocking:BlockingEnvironment", "--grace", "2")
    try:
        Ping = described_session(server.target)
        stuck = Ping(server.target)
        stuck.open()
        blocking = tmp_path / "blocking"
        errors: list[BaseException] = []

        def blocked_reset() -> None:
            try:
                stuck.reset(options=Ping.ResetOptions(block=60, mark=str(blocking)))
            except BaseException as exc:  # the drain ends it
                errors.append(exc)

        thread = threading.Thread(target=blocked_reset, daemon=True)
        thread.start()
        # The env made the file just before time.sleep: its loop is blocked from now on.
        server.wait_until(blocking.exists, 30, "the reset blocking its env's loop")
        assert server.health() == SERVING
        with Ping(server.target) as other:
            other.reset()
            assert other.step(Ping.Action(text="alive")).observation.text == "alive"
        assert fetch_info(server.target, timeout=5).capacity.active_sessions == 1
        assert thread.is_alive() and not errors  # the blocked reset is still blocked
        server.proc.send_signal(signal.SIGTERM)
        began = time.monotonic()
        code = server.proc.wait(2 + 3 + 10)  # the bound, plus slack: a hang guard
        assert code in (0, 1)
        # stdout's last lines reach stdout_lines through a reader thread after the exit.
        server.wait_until(
            lambda: "drained" in server.stderr() + "".join(server.stdout_lines),
            what="the drain's last line",
        )
        print(f"drain with a blocked env took {time.monotonic() - began:.2f}s")
        assert "drained, 1 environment(s) stuck in env code left unclosed" in (
            server.stderr() + "".join(server.stdout_lines)
        )
        thread.join(10)
        assert not thread.is_alive(), "the stuck reset got no answer after the drain"
        # The stuck reset got an answer (its stream ended), not silence.
        [error] = errors
        assert isinstance(error, SessionLost), repr(error)
    finally:
        server.stop()


@pytest.mark.fresh_server  # a server of its own: make test
@pytest.mark.parametrize(("env", "goes_on"), [("ForgivingEchoEnv", True), ("StrictEchoEnv", False)])
def test_the_step_error_rule_holds_on_a_vector_stream(env: str, goes_on: bool) -> None:
    from openenv_grpc import VectorSession

    server = ServerProcess(f"support.step_errors:{env}", pythonpath=[TESTS])
    try:
        with VectorSession[EchoAction, Any, Any, Any](server.target, 2) as vector:
            vector.reset()
            outcome = vector.step([EchoAction(message="raise"), EchoAction(message="ok")])
            assert outcome.errors[0].code is grpc.StatusCode.INTERNAL
            assert "boom in step" in outcome.errors[0].message
            outcome = vector.step([EchoAction(message="again"), EchoAction(message="ok")])
            if goes_on:
                assert not outcome.errors  # env 0's episode went on
            else:
                assert outcome.errors[0].code is grpc.StatusCode.FAILED_PRECONDITION
            assert 1 not in outcome.errors  # the neighbour is untouched either way
    finally:
        server.stop()


@pytest.mark.fresh_server  # its own OpenEnv-bridged server (seconds of imports): make test
def test_fields_named_like_protobuf_methods_work_through_the_described_client() -> None:
    """SerializeToString, ListFields, CopyFrom, DESCRIPTOR as pydantic field names: on the
    wire they are name_ (so the generated classes keep their methods), and the env sees
    its own names."""
    server = bridged("support.openenv_envs.clashing:ClashEnvironment")
    try:
        Clash = described_session(server.target)
        fields = [f.name for f in Clash.Action.DESCRIPTOR.fields]
        assert fields == ["metadata", "SerializeToString_", "ListFields_", "plain"]
        with Clash(server.target) as env:
            assert env.reset().observation.CopyFrom_ == "ready"
            action = Clash.Action(SerializeToString_="a", ListFields_=21, plain="b")
            assert Clash.Action.FromString(action.SerializeToString()) == action
            result = env.step(action)
            assert (result.observation.CopyFrom_, result.observation.DESCRIPTOR_) == ("ab", 42)
    finally:
        server.stop()
