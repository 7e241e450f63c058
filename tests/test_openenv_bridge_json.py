"""Bridged JSON both ways without half-done steps (issue 36, row 8), on real bridged
servers: an action whose JSON field the bridge could not carry back (nested 900 levels,
a lone surrogate) is refused INVALID_ARGUMENT naming the field before the env sees it;
an answer holding what JSON or protobuf cannot write (NaN, a lone surrogate, 300 levels)
is sent with it replaced by null -- NaN silently, as OpenEnv writes it, the rest named in
the info's ``bridge_warnings`` -- never INTERNAL after the env moved. Before, each was
INTERNAL after the env had stepped (the session's step count 1, the env's own 2), and
NaN left as the literal ``NaN`` (not JSON)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from openenv_grpc import EnvError
from openenv_grpc.integrations.openenv import described_session
from openenv_grpc.integrations.openenv.json_checks import MAX_JSON_DEPTH, WARNINGS_KEY
from openenv_grpc.testing import ServerProcess

pytestmark = [pytest.mark.timeout(120), pytest.mark.fresh_server]

TESTS = Path(__file__).resolve().parent
JSON_ECHO = "support.openenv_envs.json_echo:JsonEchoEnvironment"


@pytest.fixture(scope="module", params=[(), ("--isolated", "1")], ids=["in-process", "isolated"])
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    process = ServerProcess(f"--openenv={JSON_ECHO}", list(request.param), pythonpath=[TESTS])
    yield process
    process.stop()


def _deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


def _counts(env: Any, result: Any) -> tuple[int, int]:
    """(the session's step count, the env's own)."""
    return result.step_count, env.state().step_count


def test_unreturnable_actions_are_refused_before_the_env_steps(server: ServerProcess) -> None:
    Env = described_session(server.target)
    with Env(server.target) as env:
        env.reset(seed=0)
        first = env.step(Env.Action(text="a"))
        assert _counts(env, first) == (1, 1)
        refused = [
            (json.dumps(_deep(900)), f"data: JSON nested more than {MAX_JSON_DEPTH} levels deep"),
            ('"\\ud800"', "data: a lone surrogate is not Unicode text"),
            ('{"a": ["ok", "x\\udfff"]}', "data.a[1]: a lone surrogate is not Unicode text"),
            ('{"\\ud800": 1}', "data: a key with a lone surrogate is not Unicode text"),
        ]
        for text, problem in refused:
            action = Env.Action()
            action.data.json = text
            with pytest.raises(EnvError) as failed:
                env.step(action)
            assert failed.value.code is grpc.StatusCode.INVALID_ARGUMENT
            assert failed.value.message == problem
            assert env.state().step_count == 1  # the env never saw it
        # Just within the bound, and a proper surrogate pair, are served and echoed.
        action = Env.Action()
        action.data.json = json.dumps({"deep": _deep(MAX_JSON_DEPTH - 1), "emoji": "\U0001f600"})
        served = env.step(action)
        assert json.loads(served.observation.data.json)["emoji"] == "\U0001f600"
        assert _counts(env, served) == (2, 2)
        # Reset options are checked the same way, and the episode goes on.
        options = Env.ResetOptions()
        options.kwargs.json = json.dumps({"level": _deep(900)})
        with pytest.raises(EnvError) as failed:
            env.reset(options=options)
        assert failed.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert f"kwargs: JSON nested more than {MAX_JSON_DEPTH} levels deep" in (
            failed.value.message
        )
        assert _counts(env, env.step(Env.Action(text="b"))) == (3, 3)


def test_nan_and_infinity_leave_as_null_as_openenv_writes_them(server: ServerProcess) -> None:
    Env = described_session(server.target)
    with Env(server.target) as env:
        env.reset(seed=0)
        result = env.step(Env.Action(make="nan"))
        assert json.loads(result.observation.data.json) == {
            "nan": None,
            "inf": [None, None],
            "one": 1.5,
        }
        metadata = json.loads(result.observation.metadata.json)
        assert metadata == {"data": None, "steps": 1, "score": None}
        assert result.info == {"data": None, "steps": 1, "score": None}  # no warning
        assert _counts(env, result) == (1, 1)


def test_what_cannot_be_written_is_null_with_a_named_warning(server: ServerProcess) -> None:
    Env = described_session(server.target)
    with Env(server.target) as env:
        env.reset(seed=0)
        result = env.step(Env.Action(make="surrogate"))
        assert json.loads(result.observation.data.json) == {"key": None}
        assert result.observation.text == ""  # unset: protobuf cannot hold it
        assert result.info[WARNINGS_KEY] == [
            "observation.data.key: a lone surrogate is not Unicode text; sent as null",
            "observation.text: a lone surrogate is not Unicode text; sent as null",
        ]
        assert _counts(env, result) == (1, 1)
        deep = env.step(Env.Action(make="deep"))  # 300 levels: past pydantic's 255
        cut: Any = json.loads(deep.observation.data.json)
        for _ in range(MAX_JSON_DEPTH):
            assert isinstance(cut, list) and len(cut) == 1
            cut = cut[0]
        assert cut is None
        warnings = deep.info[WARNINGS_KEY]
        assert len(warnings) == 3  # the observation's data, its metadata copy, the info
        assert all(
            w.endswith(f": nested more than {MAX_JSON_DEPTH} levels deep; sent as null")
            for w in warnings
        )
        assert {w.split("[", 1)[0] for w in warnings} == {
            "observation.data",
            "observation.metadata.data",
            "metadata.data",
        }
        assert _counts(env, deep) == (2, 2)
        # The session goes on.
        plain = Env.Action(text="c")
        plain.data.json = '{"a": 1}'
        after = env.step(plain)
        assert json.loads(after.observation.data.json) == {"a": 1}
        assert WARNINGS_KEY not in after.info
        assert _counts(env, after) == (3, 3)
