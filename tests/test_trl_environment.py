"""The TRL integration against real servers: what TRL sees (tools with schemas, text) and
what the server sees (sessions opened, kept, closed).

TRL's own contract is followed by hand here (instances from the factory, ``reset(**row)``,
tools awaited, ``get_reward()``); ``test_trl_training.py`` runs the real GRPOTrainer."""

from __future__ import annotations

import asyncio
import gc
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers.utils import get_json_schema

from openenv_grpc.integrations.openenv.client import described_session
from openenv_grpc.integrations.trl import environment_factory
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.coding import CodingEnv
from openenv_grpc_envs.echo import EchoEnv
from openenv_grpc_envs.openspiel import OpenSpielEnv
from openenv_grpc_envs.wordle import AsyncWordleEnv, WordleEnv

StartServer = Callable[..., ServerProcess]


def tools_of(instance: object) -> list[str]:
    """The methods TRL turns into tools (its own rule: public functions of the class)."""
    return [
        name
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if not name.startswith("_") and name not in ("reset", "get_reward")
    ]


def call(tool: Callable[..., Any], **arguments: Any) -> str:
    """Run a tool the way TRL runs async tools: on an event loop of its own."""
    result = asyncio.run(tool(**arguments))
    assert isinstance(result, str)
    return result


def test_wordle_guess_tool_and_seeded_games(start_server: StartServer) -> None:
    server = start_server("wordle")
    with environment_factory(server.target, WordleEnv) as factory:
        first, second = factory(), factory()
        assert tools_of(first) == ["guess"]
        schema = get_json_schema(first.guess)["function"]
        assert schema["parameters"]["required"] == ["word"]
        assert "five-letter" in schema["parameters"]["properties"]["word"]["description"]
        # The same row seed: the same hidden word, so the same feedback for the same guess.
        intro = first.reset(prompt=[], seed=7)
        assert intro is not None and "Wordle" in intro and "guess tool" in intro
        second.reset(prompt=[], seed=7)
        assert call(first.guess, word="crane") == call(second.guess, word="crane")
        assert server.active() == 2
        text = call(first.guess, word="slate")
        assert "guesses left" in text
        rewards = [entry.reward for entry in _replay(server.target, 7, ["crane", "slate"])]
        assert first.get_reward() == pytest.approx(sum(rewards))
    assert server.active() == 0


def _replay(target: str, seed: int, words: list[str]) -> list[Any]:
    from openenv_grpc_envs.wordle import WordleAction

    with WordleEnv(target) as env:
        env.reset(seed=seed)
        return [env.step(WordleAction(guess=word)) for word in words]


def test_refused_guess_is_text_and_the_game_goes_on(start_server: StartServer) -> None:
    server = start_server("wordle")
    with environment_factory(server.target, WordleEnv) as factory:
        env = factory()
        env.reset(seed=1)
        call(env.guess, word="crane")
        steps = server.info().activity.steps
        refused = call(env.guess, word="xyzzy")
        assert refused.startswith("Refused: 'xyzzy' is not in the word list")
        assert "try again" in refused
        assert call(env.guess, word="crane").startswith("Refused: 'crane' was already guessed")
        assert server.info().activity.steps == steps  # refusals use no turn
        assert "You have 4 guesses left" in call(env.guess, word="slate")


def test_row_options_fix_the_game_and_a_won_game_takes_no_more_guesses(
    start_server: StartServer,
) -> None:
    server = start_server("wordle")
    with environment_factory(server.target, AsyncWordleEnv) as factory:
        env = factory()
        env.reset(seed=3, options={"target": "abide", "sparse_reward": True})
        assert "You won" in call(env.guess, word="abide")
        assert env.get_reward() == 1.0
        assert call(env.guess, word="crane") == "The episode is over: no more actions are accepted."
        # JSON text works too (a dataset column of strings), and a new game starts at 0.
        env.reset(options='{"target": "crane", "max_turns": 1}')
        assert env.get_reward() == 0.0
        assert "it was crane" in call(env.guess, word="slate")
        with pytest.raises(ValueError, match=r"options\.no_such_option: no such field"):
            env.reset(options={"no_such_option": 1})
        with pytest.raises(TypeError, match="must be a dict or JSON text"):
            env.reset(options=[1, 2])


def test_echo_tools_come_from_the_server(start_server: StartServer) -> None:
    server = start_server("echo")
    with environment_factory(server.target, EchoEnv) as factory:
        env = factory()
        assert tools_of(env) == ["count", "history", "reverse"]
        count = get_json_schema(env.count)["function"]
        assert count["description"] == "Count how often a letter occurs in the message."
        assert sorted(count["parameters"]["required"]) == ["letter", "message"]
        history = get_json_schema(env.history)["function"]["parameters"]
        assert history["properties"]["last"]["type"] == "integer"
        assert "required" not in history  # it has a default on the server's side
        env.reset(seed=1)
        assert call(env.reverse, message="hello") == "olleh"
        assert call(env.count, message="hello", letter="l") == "2"
        failed = call(env.count, message="hello", letter="ll")
        assert failed == "Error: ValueError: letter must be one character, got 2"
        # The server checks the arguments (INVALID_ARGUMENT), and the model reads why.
        assert call(env.history, last="x").startswith("Refused: tool 'history': argument 'last'")
    assert server.active() == 0  # the probe that listed the tools was closed too


def test_other_envs_get_one_act_tool_from_the_action_fields(start_server: StartServer) -> None:
    server = start_server("openspiel")
    with environment_factory(server.target, OpenSpielEnv) as factory:
        env = factory()
        assert tools_of(env) == ["act"]
        schema = get_json_schema(env.act)["function"]["parameters"]["properties"]
        assert schema["id"]["type"] == "integer" and schema["name"]["type"] == "string"
        text = env.reset(seed=0, options={"game": "catch"})
        assert text is not None and "legal_actions" in text
        assert "legal_actions" in call(env.act, id=1)  # a step: the observation as text
        assert call(env.act, id="one").startswith("Refused:")


def test_coding_run_code_is_checked_by_the_row_tests(start_server: StartServer) -> None:
    server = start_server("coding")
    with environment_factory(server.target, CodingEnv) as factory:
        env = factory()
        assert tools_of(env) == ["run_code"]
        assert env.reset(tests=["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]) is None
        text = call(env.run_code, code="def add(a, b):\n    return a - b\nprint('hi')")
        assert "exit code 0" in text and "hi" in text and "tests passed: 0/2" in text
        assert env.get_reward() == 0.0
        env.reset(tests=["assert add(2, 3) == 5"])
        assert "tests passed: 1/1" in call(env.run_code, code="def add(a, b):\n    return a + b")
        assert env.get_reward() == 1.0


def test_keepalive_holds_an_episode_through_a_pause_past_the_idle_timeout(
    start_server: StartServer,
) -> None:
    server = start_server("wordle", "--idle-timeout", "1")
    with environment_factory(server.target, WordleEnv, keepalive=0.3) as factory:
        env = factory()
        env.reset(seed=2)
        call(env.guess, word="crane")
        # A long generation between two turns: a witness session opened now, with no
        # keepalive, is reaped once it has sat idle past the timeout; the episode has sat
        # idle at least as long, held only by its keepalive.
        witness = WordleEnv(server.target)
        witness.open()
        server.wait_until(lambda: server.active() < 2, 30, "the idle witness reaped")
        assert server.active() == 1, "the episode was reaped too: its keepalive did not hold it"
        witness.abort()
        assert "You have 4 guesses left" in call(env.guess, word="slate")
        # The episode's session and the witness's: the episode was never reopened.
        assert server.info().activity.sessions_opened == 2


def test_without_keepalive_a_lost_episode_is_text_and_the_next_reset_reconnects(
    start_server: StartServer,
) -> None:
    server = start_server("wordle", "--idle-timeout", "1")
    with environment_factory(server.target, WordleEnv, keepalive=None) as factory:
        env = factory()
        env.reset(seed=2)
        server.wait_until(lambda: server.active() == 0, 30, "the idle session to be reaped")
        lost = call(env.guess, word="crane")
        assert lost.startswith("The environment session was lost (session idle for more than 1s")
        assert "episode is over" in lost
        assert call(env.guess, word="crane").startswith("The episode is over")
        # Pooled between batches and reaped: the next reset opens a fresh session.
        env.reset(seed=2)
        assert "You have 5 guesses left" in call(env.guess, word="crane")
        assert server.info().activity.sessions_opened == 2


def test_dropped_instances_close_their_sessions(start_server: StartServer) -> None:
    server = start_server("wordle")
    factory = environment_factory(server.target, WordleEnv)
    try:
        pool = [factory() for _ in range(3)]
        assert server.active() == 0  # a session opens on the first reset, not before
        for i, env in enumerate(pool):
            env.reset(seed=i)
        assert server.active() == 3 and factory.open_instances == 3
        del env, pool  # what happens to TRL's pool when the trainer goes
        gc.collect()
        server.wait_until(lambda: server.active() == 0, what="the finalizers to close the sessions")
        assert factory.open_instances == 0
        kept = factory()
        kept.reset(seed=9)
        assert server.active() == 1
    finally:
        factory.close()  # closes what is left, then the channel and the loop thread
    server.wait_until(lambda: server.active() == 0, what="close() to close the last session")
    with pytest.raises(RuntimeError, match="was closed"):
        kept.reset(seed=9)


def test_a_full_server_refuses_the_reset(start_server: StartServer) -> None:
    from openenv_grpc import CapacityError

    server = start_server("wordle", "--max-concurrent-envs", "1")
    with environment_factory(server.target, WordleEnv) as factory:
        first, second = factory(), factory()
        first.reset(seed=1)
        with pytest.raises(CapacityError):
            second.reset(seed=1)
        first._finalizer()  # TRL dropped it: its slot is free
        server.wait_until(lambda: server.active() == 0, what="the slot to be freed")
        second.reset(seed=1)
        assert server.active() == 1


def test_a_client_without_types_is_refused() -> None:
    from openenv_grpc import Session

    with pytest.raises(TypeError, match="not a typed client"):
        environment_factory("127.0.0.1:1", Session)


# -- what the model reads and fills (issue 21, item 6) -----------------------------------


def test_act_results_are_the_observation_as_json_never_protobuf_text(
    start_server: StartServer,
) -> None:
    server = start_server("openspiel")
    with environment_factory(server.target, OpenSpielEnv) as factory:
        env = factory()
        first = json.loads(env.reset(seed=0, options={"game": "catch"}) or "")
        assert isinstance(first["legal_actions"], list)
        ids = [legal["id"] for legal in first["legal_actions"]]
        assert ids and all(isinstance(i, int) for i in ids)  # int64 as ints, not "1"
        step = json.loads(call(env.act, id=1))
        assert set(step) == set(first)  # every field of the observation, by name


@pytest.mark.fresh_server  # its own OpenEnv-bridged server (seconds of imports): make test
def test_a_bridged_openenv_env_offers_no_metadata_and_answers_json(tmp_path: Path) -> None:
    server = ServerProcess(
        "--openenv=support.openenv_envs.warehouse:WarehouseEnvironment",
        pythonpath=[Path(__file__).parent],
    )
    try:
        client = described_session(server.target)
        with environment_factory(server.target, client) as factory:
            env = factory()
            assert tools_of(env) == ["act"]
            parameters = inspect.signature(env.act).parameters
            assert "metadata" not in parameters  # OpenEnv's Action.metadata is the trainer's
            assert {"lines", "mode", "note", "hints"} <= set(parameters)
            schema = get_json_schema(env.act)["function"]["parameters"]["properties"]
            assert "metadata" not in schema and schema["lines"]["type"] == "array"
            first = json.loads(env.reset(seed=1, options={"difficulty": 2}) or "")
            assert first["missing"] and first["counts"] == {}
            sku = first["missing"][0]
            text = call(env.act, lines=[{"item": {"sku": sku, "size": "SIZE_LARGE"}}])
            step = json.loads(text.removesuffix("\nThe episode is over."))
            assert step["counts"] == {sku: 1} and isinstance(step["counts"][sku], int)
            assert step["basket"][0]["item"]["sku"] == sku
            refused = call(env.act, lines=[{"item": {"sku": 5}}])
            assert refused.startswith("Refused: act.lines[0].item.sku: expected a string, got int")
            assert isinstance(env.get_reward(), float)  # the env's own reward, summed
    finally:
        server.stop()
