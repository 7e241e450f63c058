"""Parity of the one driver with the two it replaced (issue 20), found by a differential
attack: the same raw requests sent to a server at 108aff3 (EpisodeDriver / VectorDriver)
and at the refactor, every answer compared field by field.

Each test here asserts, on the raw generated stub, in process and with ``--isolated``,
what the server answered before the refactor -- except for one change made on purpose:
an env that completes a call but returns something else than its declared types (a
wrong observation type, not a Transition) is INTERNAL for that request and breaks the
episode, and the call is not booked (the episode id and step count stay where the env's
last good answer left them), as a vector stream always did; before, a Session counted
the step (or took the reset's episode id) first.
"""

from __future__ import annotations

import queue

import grpc
import pytest

from openenv_grpc import Transition
from openenv_grpc.metadata import ADMITTED_KEY
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc
from openenv_grpc_envs.echo import EchoAction, EchoObservation, EchoState
from support.envs import FaultyEnv

pytestmark = pytest.mark.timeout(60)

INTERNAL = grpc.StatusCode.INTERNAL.value[0]
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
WRONG_OBSERVATION = (
    "environment returned a EchoState observation, declared "
    "openenv_grpc_envs.echo.v1.EchoObservation"
)
NEEDS_RESET = "the environment failed during this episode: call reset"
SERVERS = {"in-process": (), "isolated": ("--isolated", "2")}


class WrongResetEnv(FaultyEnv):
    """A FaultyEnv whose reset with seed 3 resets, then returns a state as the
    observation (loaded by the server as ``test_driver_parity:WrongResetEnv``)."""

    def reset(  # type: ignore[no-untyped-def]
        self, *, seed, episode_id, options
    ) -> Transition[EchoObservation]:
        transition = super().reset(seed=seed, episode_id=episode_id, options=options)
        if seed == 3:
            return Transition(EchoState())  # type: ignore[arg-type]
        return transition


class RaisingCloseFaultyEnv(FaultyEnv):
    """A FaultyEnv whose close records itself, then raises (loaded by the server as
    ``test_driver_parity:RaisingCloseFaultyEnv``)."""

    def close(self) -> None:
        super().close()
        raise OSError("close failed on purpose")


class RawSession:
    """One Session stream on the generated stub: one request, one response."""

    def __init__(self, target: str) -> None:
        self._channel = grpc.insecure_channel(target)
        self._requests: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
        stub = pb_grpc.EnvServiceStub(self._channel)
        self.call = stub.Session(iter(self._requests.get, None), timeout=40)
        assert ADMITTED_KEY in dict(self.call.initial_metadata()), "session not admitted"
        self._next_id = 0

    def send(self, request: pb.SessionRequest) -> pb.SessionResponse:
        self._next_id += 1
        request.request_id = self._next_id
        self._requests.put(request)
        response: pb.SessionResponse = next(self.call)
        assert response.request_id == request.request_id
        return response

    def reset(self, **fields: object) -> pb.SessionResponse:
        request = pb.SessionRequest(reset=pb.ResetCommand(**fields))  # type: ignore[arg-type]
        request.reset.SetInParent()
        return self.send(request)

    def step(self, message: str) -> pb.SessionResponse:
        request = pb.SessionRequest()
        request.step.action.Pack(EchoAction(message=message))
        return self.send(request)

    def state(self) -> pb.StateResult:
        response = self.send(pb.SessionRequest(state=pb.StateCommand()))
        assert response.WhichOneof("outcome") == "state", response
        return response.state

    def close(self) -> None:
        response = self.send(pb.SessionRequest(close=pb.CloseCommand()))
        assert response.WhichOneof("outcome") == "closed", response
        self.end()

    def end(self) -> None:
        """Half-close; the stream must then end OK."""
        self._requests.put(None)
        with pytest.raises(StopIteration):
            next(self.call)
        assert self.call.code() is grpc.StatusCode.OK
        self._channel.close()


def assert_error(response: pb.SessionResponse, code: int, message: str) -> None:
    assert response.WhichOneof("outcome") == "error", response
    assert (response.error.code, response.error.message) == (code, message)
    assert response.error.exception_type == ""


def assert_books_balanced(server) -> None:  # type: ignore[no-untyped-def]
    server.wait_until(lambda: server.active() == 0, what="no active session")
    server.wait_until(lambda: server.created() == server.closed_envs(), what="envs closed")


@pytest.mark.parametrize("mode", SERVERS)
@pytest.mark.parametrize("command", ["wrong-type", "not-transition"])
def test_session_step_with_a_mistyped_answer_breaks_the_episode_uncounted(
    start_server, mode: str, command: str
) -> None:  # type: ignore[no-untyped-def]
    server = start_server("support.envs:FaultyEnv", *SERVERS[mode])
    session = RawSession(server.target)
    episode = session.reset(episode_id="ep-a").result.episode_id
    assert episode == "ep-a"
    assert session.step("fine").result.step_count == 1
    response = session.step(command)
    assert response.WhichOneof("outcome") == "error", response
    assert response.error.code == INTERNAL
    assert_error(session.step("fine"), FAILED_PRECONDITION, NEEDS_RESET)
    # Its answer was not a step: the books stay at the last good one (as for a vector).
    state = session.state()
    assert (state.episode_id, state.step_count) == ("ep-a", 1)
    again = session.reset(episode_id="ep-b").result
    assert (again.episode_id, again.step_count) == ("ep-b", 0)
    assert session.step("resumed").result.step_count == 1
    session.close()
    assert_books_balanced(server)


@pytest.mark.parametrize("mode", SERVERS)
def test_session_reset_with_a_mistyped_observation_breaks_the_episode_unbooked(
    start_server, mode: str
) -> None:  # type: ignore[no-untyped-def]
    server = start_server("test_driver_parity:WrongResetEnv", *SERVERS[mode])
    session = RawSession(server.target)
    assert session.reset(episode_id="ep-a").result.episode_id == "ep-a"
    assert session.step("one").result.step_count == 1
    assert_error(session.reset(seed=3, episode_id="ep-b"), INTERNAL, WRONG_OBSERVATION)
    assert_error(session.step("two"), FAILED_PRECONDITION, NEEDS_RESET)
    # Its answer was not a reset: the books stay at the last good answer.
    state = session.state()
    assert (state.episode_id, state.step_count) == ("ep-a", 1)
    again = session.reset(episode_id="ep-c").result
    assert (again.episode_id, again.step_count) == ("ep-c", 0)
    session.close()
    assert_books_balanced(server)


TIMED_OUT = (
    "step did not finish within 1s; the environment was replaced with a fresh one: call reset"
)
ISOLATED_TIMEOUT = ("--isolated", "2", "--step-timeout", "1")


def test_isolated_session_close_after_a_hung_step_reports_the_fresh_envs_close(
    start_server,
) -> None:  # type: ignore[no-untyped-def]
    """The env made in place of a hung one is the session's env: a close command closes
    it and says what its close raised, as in process."""
    server = start_server("test_driver_parity:RaisingCloseFaultyEnv", *ISOLATED_TIMEOUT)
    session = RawSession(server.target)
    session.reset(episode_id="ep-a")
    response = session.step("sleep:3")
    assert response.WhichOneof("outcome") == "error", response
    assert (response.error.code, response.error.message) == (
        grpc.StatusCode.DEADLINE_EXCEEDED.value[0],
        TIMED_OUT,
    )
    assert_error(session.step("x"), FAILED_PRECONDITION, "step before reset: call reset first")
    response = session.send(pb.SessionRequest(close=pb.CloseCommand()))
    assert response.WhichOneof("outcome") == "error", response
    assert response.error.code == INTERNAL
    assert response.error.message == "close failed: OSError: close failed on purpose"
    assert response.error.exception_type == "builtins.OSError"
    session.end()
    server.wait_until(lambda: server.active() == 0, what="no active session")


def test_isolated_session_failed_replacement_ends_the_session_on_the_next_request(
    start_server,
) -> None:  # type: ignore[no-untyped-def]
    """A hung env whose replacement cannot be made: the request after the timeout is
    answered INTERNAL with what the factory raised (not "call reset first"), and the
    stream ends."""
    server = start_server("support.envs:FlakyFactoryEnv", *ISOLATED_TIMEOUT)
    session = RawSession(server.target)
    session.reset(episode_id="ep-a")
    (server.ledger.parent / f"{server.ledger.name}.no-factory").touch()
    response = session.step("sleep:3")
    assert response.WhichOneof("outcome") == "error", response
    assert (response.error.code, response.error.message) == (
        grpc.StatusCode.DEADLINE_EXCEEDED.value[0],
        TIMED_OUT,
    )
    assert_error(
        session.step("x"),
        INTERNAL,
        "the environment hung and a new one could not be created: "
        "RuntimeError: the factory is switched off",
    )
    with pytest.raises(StopIteration):
        next(session.call)
    server.wait_until(lambda: server.active() == 0, what="no active session")


class RawVector:
    """One VectorSession stream on the generated stub: one request, one response."""

    def __init__(self, target: str, num_envs: int) -> None:
        self._channel = grpc.insecure_channel(target)
        self._requests: queue.SimpleQueue[pb.VectorSessionRequest | None] = queue.SimpleQueue()
        stub = pb_grpc.EnvServiceStub(self._channel)
        metadata = [("openenv-num-envs", str(num_envs))]
        self.call = stub.VectorSession(
            iter(self._requests.get, None), metadata=metadata, timeout=40
        )
        self._next_id = 0

    def send(self, request: pb.VectorSessionRequest) -> pb.VectorSessionResponse:
        self._next_id += 1
        request.request_id = self._next_id
        self._requests.put(request)
        response: pb.VectorSessionResponse = next(self.call)
        assert response.request_id == request.request_id
        return response

    def end(self) -> None:
        self._requests.put(None)
        with pytest.raises(StopIteration):
            next(self.call)
        assert self.call.code() is grpc.StatusCode.OK
        self._channel.close()


ASYNC_CASES = {
    "session-in-process": ("session", 1, ()),
    "session-isolated": ("session", 1, ("--isolated", "2")),
    "vector-of-1-in-process": ("vector", 1, ()),
    "vector-of-2-isolated": ("vector", 2, ("--isolated", "2")),
}


@pytest.mark.parametrize("case", ASYNC_CASES)
def test_an_async_env_serves_sessions_and_one_env_blocks(start_server, case: str) -> None:  # type: ignore[no-untyped-def]
    """An AsyncEnvironment (no ``cost_class``) is served wherever a loop batch holds one
    env: a Session, a vector of one, an isolated vector spread one env per worker; and
    every env it made is closed."""
    kind, num_envs, args = ASYNC_CASES[case]
    server = start_server("support.envs:AsyncEchoEnv", *args)
    if kind == "session":
        session = RawSession(server.target)
        assert session.reset(episode_id="ep-a").result.observation.Unpack(EchoObservation())
        result = session.step("hello").result
        assert (result.episode_id, result.step_count) == ("ep-a", 1)
        session.close()
    else:
        vector = RawVector(server.target, num_envs)
        response = vector.send(pb.VectorSessionRequest(reset=pb.VectorReset()))
        assert response.WhichOneof("outcome") == "result", response
        assert list(response.result.indices) == list(range(num_envs))
        assert not response.result.errors
        step = pb.VectorSessionRequest()
        for _ in range(num_envs):
            step.step.actions.add().Pack(EchoAction(message="hello"))
        response = vector.send(step)
        assert response.WhichOneof("outcome") == "result", response
        assert list(response.result.step_counts) == [1] * num_envs
        vector.end()
    assert_books_balanced(server)
