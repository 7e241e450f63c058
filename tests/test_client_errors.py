"""Every exception a client call raises derives from OpenEnvError, as errors.py promises;
where Python has a conventional base for the case, the exception has that base too."""

from __future__ import annotations

import asyncio
import inspect
import socket
import subprocess
import sys
import threading

import grpc
import pytest

import openenv_grpc
from openenv_grpc import Session, SessionStateError, SessionTimeout
from openenv_grpc.client import errors
from openenv_grpc_envs.echo import EchoAction, EchoEnv, EchoObservation

#: The `server` fixture is one shared counting echo server (conftest.py).
pytestmark = pytest.mark.shared_server


def public_exceptions() -> list[type[BaseException]]:
    found = [getattr(errors, name) for name in errors.__all__]
    assert all(inspect.isclass(e) and issubclass(e, BaseException) for e in found)
    return found


def test_every_public_exception_derives_from_openenv_error() -> None:
    exceptions = public_exceptions()
    assert len(exceptions) >= 10
    for exception in exceptions:
        assert issubclass(exception, errors.OpenEnvError), exception
        # ...and is exported where users look for it.
        assert getattr(openenv_grpc.client, exception.__name__) is exception


@pytest.mark.parametrize(
    ("exception", "python_base"),
    [
        (errors.SessionTimeout, TimeoutError),
        (errors.SessionStateError, RuntimeError),
        (errors.PayloadTypeError, TypeError),
        (errors.CapacityError, errors.SessionRefused),
    ],
)
def test_conventional_bases(exception: type[BaseException], python_base: type) -> None:
    assert issubclass(exception, python_base)


def test_errors_carry_a_code_and_a_message() -> None:
    timeout = SessionTimeout(1.5)
    assert timeout.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert timeout.timeout == 1.5 and "session stays open" in timeout.message
    state = SessionStateError("session is not open")
    assert state.code is grpc.StatusCode.FAILED_PRECONDITION
    assert str(state) == "FAILED_PRECONDITION: session is not open"


def test_a_call_before_open_raises_session_state_error() -> None:
    env = EchoEnv("127.0.0.1:1")  # never opened: nothing is sent, so no server is needed
    with pytest.raises(SessionStateError, match="not open"):
        env.step(EchoAction(message="x"))
    env.abort()


def test_a_typed_client_given_the_wrong_message_raises_payload_type_error(server) -> None:
    with EchoEnv(server.target) as env:
        env.reset()
        with pytest.raises(errors.PayloadTypeError, match="action must be"):
            env.step(EchoObservation())  # type: ignore[arg-type]
        with pytest.raises(errors.OpenEnvError):  # one except clause catches everything
            env.step(EchoObservation())  # type: ignore[arg-type]
        assert env.step(EchoAction(message="fine")).step_count == 1


def test_opening_an_open_session_raises_session_state_error(server) -> None:
    with Session(server.target) as env, pytest.raises(SessionStateError, match="already open"):
        env.open()


def test_a_timed_out_call_raises_session_timeout_which_is_a_timeout_error(start_server) -> None:
    slow = start_server("support.envs:FaultyEnv")
    with EchoEnv(slow.target) as env:
        env.reset()
        with pytest.raises(SessionTimeout) as timed_out:
            env.step(EchoAction(message="sleep:2"), timeout=0.2)
        assert isinstance(timed_out.value, TimeoutError)
        assert timed_out.value.timeout == 0.2


def test_a_session_that_owns_its_channel_can_be_opened_again(server) -> None:
    """After close (or a lost stream) the owned channel is gone; open() makes a new one
    instead of failing with gRPC's raw "Channel closed"."""
    import asyncio

    from openenv_grpc_envs.echo import AsyncEchoEnv

    env = EchoEnv(server.target)
    for _ in range(2):
        with env:
            env.reset()
            assert env.step(EchoAction(message="again")).step_count == 1

    async def main() -> None:
        aenv = AsyncEchoEnv(server.target)
        for _ in range(2):
            async with aenv:
                await aenv.reset()
                assert (await aenv.step(EchoAction(message="again"))).step_count == 1

    asyncio.run(main())


# -- arguments the client checks before anything is sent (issue 21, item 8) -------------

BAD_SEEDS = [
    ("abc", errors.PayloadTypeError, r"seed must be an int from 0 to 2\*\*64-1 or None, got str"),
    (1.5, errors.PayloadTypeError, r"seed must be an int from 0 to 2\*\*64-1 or None, got float"),
    (True, errors.PayloadTypeError, r"seed must be an int .* got bool"),
    (-1, errors.InvalidRequest, r"seed must be an int from 0 to 2\*\*64-1 or None, got -1"),
    (2**64, errors.InvalidRequest, r"seed must be an int from 0 to 2\*\*64-1 .* got 1844"),
]


@pytest.mark.parametrize(("seed", "raised", "match"), BAD_SEEDS)
def test_a_bad_seed_names_seed_and_its_range_and_the_session_goes_on(
    server, seed, raised, match
) -> None:
    with EchoEnv(server.target) as env:
        with pytest.raises(raised, match=match):
            env.reset(seed=seed)
        assert env.reset(seed=2**64 - 1).step_count == 0  # the top of the range is fine
        assert env.step(EchoAction(message="still here")).observation.echoed_message == "still here"


def test_a_bad_seed_raises_the_python_base_a_caller_expects(server) -> None:
    with EchoEnv(server.target) as env:
        with pytest.raises(TypeError, match="seed"):
            env.reset(seed="abc")
        with pytest.raises(ValueError, match="seed"):
            env.reset(seed=-1)


def test_bad_options_and_actions_name_the_parameter_and_the_type_it_accepts(server) -> None:
    with EchoEnv(server.target) as env:
        with pytest.raises(TypeError, match=r"options must be .*EchoResetOptions, got dict"):
            env.reset(options={"max_steps": 3})  # type: ignore[arg-type]
        env.reset()
        with pytest.raises(TypeError, match=r"action must be .*EchoAction, got str"):
            env.step("hello")  # type: ignore[arg-type]
        assert env.step(EchoAction(message="ok")).step_count == 1
    with Session(server.target) as untyped:  # no pinned types: still named
        with pytest.raises(TypeError, match="options must be a protobuf message, got dict"):
            untyped.reset(options={"max_steps": 3})
        untyped.reset()
        with pytest.raises(TypeError, match="action must be a protobuf message, got dict"):
            untyped.step({"message": "hi"})
        assert untyped.step(EchoAction(message="ok")).step_count == 1


def test_the_async_session_names_bad_arguments_too(server) -> None:
    from openenv_grpc_envs.echo import AsyncEchoEnv

    async def main() -> None:
        async with AsyncEchoEnv(server.target) as env:
            with pytest.raises(TypeError, match=r"seed must be an int from 0 to 2\*\*64-1"):
                await env.reset(seed="abc")
            with pytest.raises(ValueError, match=r"seed must be an int .* got -1"):
                await env.reset(seed=-1)
            with pytest.raises(TypeError, match="options must be"):
                await env.reset(options={"a": 1})  # type: ignore[arg-type]
            await env.reset(seed=3)
            with pytest.raises(TypeError, match="action must be"):
                await env.step(3)  # type: ignore[arg-type]
            assert (await env.step(EchoAction(message="x"))).step_count == 1

    asyncio.run(main())


def test_vector_sessions_name_bad_seeds_options_and_actions(server) -> None:
    from openenv_grpc import AsyncVectorSession, VectorSession

    with VectorSession(server.target, 3) as envs:
        with pytest.raises(TypeError, match=r"seeds must be an int, one int or None per env"):
            envs.reset(seeds="abc")
        with pytest.raises(ValueError, match=r"seeds must be an int from 0 to 2\*\*64-1 .* -1"):
            envs.reset(seeds=-1)
        with pytest.raises(ValueError, match=r"seeds \+ 2 must be an int from 0 to 2\*\*64-1"):
            envs.reset(seeds=2**64 - 2)  # env 2 would get 2**64
        with pytest.raises(TypeError, match=r"seeds\[1\] must be an int .* got str"):
            envs.reset(seeds=[1, "x", 3])
        with pytest.raises(TypeError, match="options must be a message, one message or None"):
            envs.reset(options={"max_steps": 2})
        with pytest.raises(TypeError, match=r"options must be a protobuf message, got int"):
            envs.reset(options=[None, 5, None])
        envs.reset(seeds=[1, None, 2])
        with pytest.raises(TypeError, match="actions must be a sequence of messages"):
            envs.step(EchoAction(message="one for all"))  # type: ignore[arg-type]
        with pytest.raises(errors.EnvError, match="2 actions for 3 envs"):  # the server's word
            envs.step([EchoAction(message="a")] * 2)
        with pytest.raises(TypeError, match="action must be a protobuf message, got str"):
            envs.step(["a", "b", "c"])  # type: ignore[list-item]
        outcome = envs.step([EchoAction(message=str(i)) for i in range(3)])
        assert [o.echoed_message for o in outcome.observations] == ["0", "1", "2"]

    async def main() -> None:
        async with AsyncVectorSession(server.target, 2) as envs:
            with pytest.raises(TypeError, match="seeds must be"):
                await envs.reset(seeds="ab")
            with pytest.raises(ValueError, match=r"seeds must be .* got -5"):
                await envs.reset(seeds=-5)
            await envs.reset(seeds=0)
            with pytest.raises(errors.EnvError, match="3 actions for 2 envs"):
                await envs.step([EchoAction()] * 3)
            assert len((await envs.step([EchoAction()] * 2)).observations) == 2

    asyncio.run(main())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_opening_where_nothing_listens_says_so(server) -> None:
    from openenv_grpc import AsyncSession, VectorSession

    target = f"127.0.0.1:{_free_port()}"
    expected = f"nothing is listening on {target}"
    with pytest.raises(errors.SessionRefused, match=expected) as refused:
        EchoEnv(target).open()
    assert refused.value.code is grpc.StatusCode.UNAVAILABLE
    with pytest.raises(errors.SessionRefused, match=expected):
        VectorSession(target, 2).open()

    async def main() -> None:
        with pytest.raises(errors.SessionRefused, match=expected):
            await AsyncSession(target).open()

    asyncio.run(main())


def test_fetch_info_where_nothing_listens_fails_at_once_and_says_so() -> None:
    from openenv_grpc.client.info import fetch_info

    target = f"127.0.0.1:{_free_port()}"
    # A timeout far beyond the one-second probe: the refusal must not wait for it.
    started = threading.Event()
    result: list[BaseException] = []

    def call() -> None:
        started.set()
        try:
            fetch_info(target, timeout=600)
        except BaseException as exc:
            result.append(exc)

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(60)  # a bound for the test only: hanging until 600 s is the bug
    assert not worker.is_alive(), "fetch_info waited for its timeout on a refused port"
    assert isinstance(result[0], errors.InfoUnavailable)
    assert result[0].code is grpc.StatusCode.UNAVAILABLE
    assert f"nothing is listening on {target}" in result[0].message


def test_cli_info_where_nothing_listens_says_so() -> None:
    target = f"127.0.0.1:{_free_port()}"
    done = subprocess.run(
        [sys.executable, "-m", "openenv_grpc", "info", target, "--timeout", "600"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert f"nothing is listening on {target}" in done.stderr
    assert "DEADLINE_EXCEEDED" not in done.stderr


def test_cli_info_still_answers_a_live_server(server) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "openenv_grpc", "info", server.target],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert '"env_name": "echo"' in done.stdout
