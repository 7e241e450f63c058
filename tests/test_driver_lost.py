"""The driver's books of envs lost with their env process (``--isolated``, issue 38):
the batch calls report the envs a call did not name (``calls.Losses``), the driver keeps
them in Phase.LOST and says what a request naming one gets. Driven here over fake batch
calls, so each rule is shown without killing a process (tests/test_isolated.py shows
them on a real server)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
import pytest

from openenv_grpc.environment import AutoresetMode
from openenv_grpc.server.errors import RowError
from openenv_grpc.server.local.batch import BatchOutcome
from openenv_grpc.server.local.calls import (
    BatchRefused,
    Losses,
    ResetArgs,
    RestoreArgs,
    StepArgs,
)
from openenv_grpc.server.model.phases import VECTOR_WORDS, Phase
from openenv_grpc.server.model.queries import BatchStates
from openenv_grpc.server.model.spec import EnvSpec
from openenv_grpc.server.stream.driver import Driver
from openenv_grpc_envs.echo import EchoEnvironment

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
GONE = RowError(UNAVAILABLE, "its env process was lost during a step of other envs; reset it")


class FakeCalls:
    """Envs that answer every call; ``terminate`` ends the episodes it names at a step,
    ``refuse_reset`` fails their resets, ``refuse_query`` refuses a query as a whole."""

    def __init__(self) -> None:
        self.losses: Losses | None = None
        self.named: list[Sequence[int]] = []
        self.terminate: set[int] = set()
        self.refuse_reset: set[int] = set()
        self.refuse_query = False

    def report_losses(self, losses: Losses) -> None:
        self.losses = losses

    native = False
    unsettled = False

    async def settle(self) -> None:
        pass

    def _outcome(self, indices: Sequence[int], failing: set[int]) -> BatchOutcome:
        out = BatchOutcome()
        for index in indices:
            if index in failing:
                out.errors[index] = RowError(INVALID_ARGUMENT, "refused")
                continue
            out.rows.append(index)
            out.observations.append(b"")
            out.rewards.append(0.0)
            out.terminated.append(index in self.terminate)
            out.truncated.append(False)
        return out

    async def step(self, args: StepArgs) -> BatchOutcome:
        self.named.append(list(args.indices))
        return self._outcome(args.indices, set())

    async def reset(self, args: ResetArgs) -> BatchOutcome:
        self.named.append(list(args.indices))
        return self._outcome(args.indices, self.refuse_reset)

    async def query(self, name: str, indices: Sequence[int]) -> BatchStates:
        self.named.append(list(indices))
        if self.refuse_query:
            raise BatchRefused(UNAVAILABLE, "refused as a whole")
        return BatchStates(rows=list(indices), states=[b"s"] * len(indices))

    async def restore(self, args: RestoreArgs) -> dict[int, RowError]:
        return {}

    async def close(self) -> None:
        pass

    async def close_strictly(self) -> None:
        pass


def _driver(autoreset: AutoresetMode = AutoresetMode.DISABLED) -> tuple[Driver, FakeCalls]:
    calls = FakeCalls()
    spec = EnvSpec.from_factory(EchoEnvironment)
    driver = Driver(spec, 4, autoreset, calls, VECTOR_WORDS)
    assert calls.losses is driver  # the driver keeps the books the calls report to
    asyncio.run(driver.reset(_reset([0, 1, 2, 3])))
    return driver, calls


def _reset(indices: list[int]) -> ResetArgs:
    count = len(indices)
    return ResetArgs(indices, [None] * count, ["e"] * count, [None] * count, False)


def _step(indices: list[int], batch_form: bool = False) -> StepArgs:
    if batch_form:
        return StepArgs(indices, object(), True)
    return StepArgs(indices, list(indices), False)


def test_a_lost_env_is_told_once_by_a_step_then_has_no_episode() -> None:
    driver, calls = _driver()
    driver.book_lost({1: GONE})
    assert driver.phases[1] is Phase.LOST and driver.known_phase(1) is Phase.RUNNING
    assert driver.blocked([0, 1]) == {}  # it may step: the step tells it
    outcome, stepped, _ = asyncio.run(driver.step(_step([0, 1, 2])))
    assert calls.named[-1] == [0, 2]  # never run on the fresh env
    assert list(outcome.errors) == [1] and outcome.errors[1] is GONE
    assert stepped == 2 and outcome.rows == [0, 2]
    assert driver.known_phase(1) is Phase.NO_EPISODE and driver.episode_ids[1] == ""
    assert driver.blocked([1])[1].code == FAILED_PRECONDITION


def test_a_lost_env_that_may_not_step_is_refused_as_before_and_stays_lost() -> None:
    driver, calls = _driver()
    calls.terminate = {1}
    asyncio.run(driver.step(_step([1])))
    driver.book_lost({1: GONE})
    (error,) = driver.blocked([0, 1]).values()
    assert error.message == "env 1: " + VECTOR_WORDS.needs_reset[Phase.TERMINATED]
    assert driver.cannot_step(1) == VECTOR_WORDS.needs_reset[Phase.TERMINATED]
    assert driver.phases[1] is Phase.LOST
    # A state tells it.
    states, _ = asyncio.run(driver.query("state", [0, 1]))
    assert states.rows == [0] and states.errors == {1: GONE}
    assert driver.cannot_step(1) == VECTOR_WORDS.needs_reset[Phase.NO_EPISODE]


def test_a_batch_form_step_naming_a_lost_env_is_refused_as_a_whole() -> None:
    driver, calls = _driver()
    driver.book_lost({2: GONE, 3: GONE})
    before = len(calls.named)
    with pytest.raises(BatchRefused) as refused:
        asyncio.run(driver.step(_step([0, 1, 2, 3], batch_form=True)))
    assert refused.value.code == FAILED_PRECONDITION
    assert refused.value.message == (
        "envs 2, 3 are fresh ones since their env process was lost: reset them "
        "(a batch_action steps every env it names; nothing was done)"
    )
    assert list(refused.value.indices) == [0, 1, 2, 3]
    assert len(calls.named) == before and driver.phases[2] is Phase.LOST


def test_a_reset_gives_a_lost_env_an_episode_unless_it_fails() -> None:
    driver, calls = _driver()
    driver.book_lost({1: GONE, 2: GONE})
    calls.refuse_reset = {2}
    outcome = asyncio.run(driver.reset(_reset([1, 2])))
    assert calls.named[-1] == [1, 2]  # a reset runs on the fresh env
    assert outcome.errors[2].code == INVALID_ARGUMENT
    assert driver.phases[1] is Phase.RUNNING
    assert driver.phases[2] is Phase.LOST  # no episode began: still told at its next step
    outcome, _, _ = asyncio.run(driver.step(_step([1, 2])))
    assert outcome.errors == {2: GONE}


def test_a_refused_query_leaves_its_lost_envs_lost() -> None:
    driver, calls = _driver()
    driver.book_lost({1: GONE})
    calls.refuse_query = True
    with pytest.raises(BatchRefused):
        asyncio.run(driver.query("state", [0, 1]))
    assert driver.phases[1] is Phase.LOST


def test_an_env_told_by_its_own_answer_is_not_lost_and_bookings_keep_lost_envs_lost() -> None:
    driver, _ = _driver()
    driver.book_lost({1: GONE, 2: GONE})
    driver.book_told([1])  # a call in flight on the lost block tells env 1 itself
    assert driver.phases[1] is Phase.RUNNING
    # A step of env 2 that completed before the loss is booked under its LOST phase.
    outcome = BatchOutcome(rows=[2], observations=[b""], rewards=[0.0])
    outcome.terminated, outcome.truncated = [True], [False]
    driver._orphaned(outcome, 0.0)
    assert driver.phases[2] is Phase.LOST and driver.known_phase(2) is Phase.TERMINATED
