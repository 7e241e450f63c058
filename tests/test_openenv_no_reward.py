"""Issue 37: an OpenEnv env's reward None stays None. A bridged env whose reset gives no
reward and whose step gives the action's ``score`` (None included), served by real
``openenv-grpc serve`` processes, in process and ``--isolated``: the gRPC Session's
result has ``no_reward`` set and reward 0, a real 0.0 is not flagged, a vector stream's
rows read 0 with their indices in ``no_reward``, and the OpenEnv door answers
``"reward": null`` on every route (the live comparison with OpenEnv's own server is in
test_openenv_differential.py)."""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from openenv_grpc import VectorSession
from openenv_grpc.integrations.openenv import described_session
from openenv_grpc.testing import ServerProcess

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
from test_openenv_gateway import gateway_url  # noqa: E402

SCORE = "--openenv=support.openenv_envs.scored:ScoreEnvironment"


@pytest.fixture(scope="module", params=["in-process", "isolated"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[ServerProcess, str]]:
    """A serve process of the score env with its OpenEnv door: (server, door URL). The
    isolated one has two env processes, so a vector stream spreads over both."""
    isolated = ["--isolated", "2"] if request.param == "isolated" else []
    process = ServerProcess(SCORE, ["--openenv-port", "0", *isolated], pythonpath=[TESTS])
    try:
        yield process, gateway_url(process)
    finally:
        process.stop()


def test_session_reset_and_step_without_reward_are_flagged(
    server: tuple[ServerProcess, str],
) -> None:
    process, _ = server
    Score = described_session(process.target)
    with Score(process.target) as env:
        first = env.reset(seed=1)
        assert (first.no_reward, first.reward) == (True, 0.0)
        stepped = env.step(Score.Action())  # score None: no reward
        assert (stepped.no_reward, stepped.reward) == (True, 0.0)
        assert stepped.step_count == 1


def test_a_real_reward_is_not_flagged_zero_included(server: tuple[ServerProcess, str]) -> None:
    process, _ = server
    Score = described_session(process.target)
    with Score(process.target) as env:
        env.reset(seed=1)
        zero = env.step(Score.Action(score=0.0))
        assert (zero.no_reward, zero.reward) == (False, 0.0)
        half = env.step(Score.Action(score=0.5))
        assert (half.no_reward, half.reward) == (False, 0.5)
        again = env.step(Score.Action())  # and back to none: the flag is per result
        assert (again.no_reward, again.reward) == (True, 0.0)


def test_vector_rows_without_reward_read_zero(server: tuple[ServerProcess, str]) -> None:
    process, _ = server
    Score = described_session(process.target)
    with VectorSession(process.target, 4) as envs:
        reset = envs.reset(seeds=1)
        assert (list(reset.rewards), reset.no_reward) == ([0.0] * 4, {0, 1, 2, 3})
        actions = [Score.Action(), Score.Action(score=2.0), Score.Action(), Score.Action(score=0.0)]
        stepped = envs.step(actions)
        assert list(stepped.rewards) == [0.0, 2.0, 0.0, 0.0]
        assert stepped.no_reward == {0, 2}  # env 3's 0.0 was a reward


def _ws(url: str, sent: list[dict[str, Any]]) -> list[Any]:
    async def talk() -> list[Any]:
        answers = []
        async with websockets.connect(url.replace("http", "ws", 1) + "/ws") as ws:
            for frame in sent:
                await ws.send(json.dumps(frame))
                answers.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
        return answers

    return asyncio.run(talk())


def _post(url: str, path: str, body: Any) -> Any:
    request = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def test_the_door_answers_a_missing_reward_as_null(server: tuple[ServerProcess, str]) -> None:
    _, url = server
    answers = _ws(
        url,
        [
            {"type": "reset", "data": {"seed": 1}},
            {"type": "step", "data": {}},
            {"type": "step", "data": {"score": None}},
            {"type": "step", "data": {"score": 0.0}},
            {"type": "step", "data": {"score": 1.5}},
        ],
    )
    assert [answer["type"] for answer in answers] == ["observation"] * 5
    assert [answer["data"]["reward"] for answer in answers] == [None, None, None, 0.0, 1.5]
    assert _post(url, "/reset", {})["reward"] is None
    assert _post(url, "/step", {"action": {}})["reward"] is None
    assert _post(url, "/step", {"action": {"score": 0.0}})["reward"] == 0.0
