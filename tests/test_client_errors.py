"""Every exception a client call raises derives from OpenEnvError, as errors.py promises;
where Python has a conventional base for the case, the exception has that base too."""

from __future__ import annotations

import inspect

import grpc
import pytest

import openenv_grpc
from openenv_grpc import Session, SessionStateError, SessionTimeout
from openenv_grpc.client import errors
from openenv_grpc_envs.echo import EchoAction, EchoEnv, EchoObservation


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
