"""Echo's native batch (``EchoBatchEnvironment``) on a real server: one action and one
observation message for all rows, answers equal to the server's loop over plain echo envs
in every autoreset mode, per-env clients served through it, refusals per row and per
request, states and snapshots per index (traded with a one-env Session)."""

from __future__ import annotations

import grpc
import pytest

from openenv_grpc import EnvError
from openenv_grpc.client import Session, VectorSession
from openenv_grpc_envs.echo import EchoAction, EchoObservation, EchoResetOptions
from openenv_grpc_envs.echo.environment import MAX_MESSAGE_CHARS
from openenv_grpc_envs.echo.v1.echo_pb2 import EchoState

BATCH = "openenv_grpc_envs.echo:EchoBatchEnvironment"
LOOP = "openenv_grpc_envs.echo:EchoEnvironment"

#: Three envs with an episode limit, a stop word and a tool call among the actions.
OPTIONS = EchoResetOptions(max_steps=3, stop_word="halt", greeting="hi")
SCRIPT = [
    ["a", "halt", "bb"],
    ["ccc", "d", ""],
    ["e", "f", "g"],
    ["h", "i", "j"],
    ["k", "l", "m"],
]


def _actions(messages: list[str]) -> list[EchoAction]:
    return [EchoAction(message=m) for m in messages]


def _play(envs: VectorSession, batch: bool, rounds: int) -> list[tuple[object, ...]]:
    """The script's answers, row by row: (index, observation, reward, flags, mark)."""
    first = envs.reset(seeds=5, options=OPTIONS, batch=batch)
    answers: list[tuple[object, ...]] = [tuple(first.indices)]
    tool = EchoAction()
    tool.tool_call.name = "reverse"
    tool.tool_call.arguments.update({"message": "abc"})
    for k, messages in enumerate(SCRIPT[:rounds]):
        actions = _actions(messages)
        if k == 3:
            actions[1] = tool
        if batch:
            outcome = envs.step_batch(EchoAction(rows=actions))
            observations = list(outcome.batch_observation.rows)  # type: ignore[union-attr]
            finals = outcome.batch_final_observation
            final_rows = list(finals.rows) if finals is not None else []
        else:
            outcome = envs.step(actions)
            observations = list(outcome.observations)
            final_rows = [outcome.final_observations[i] for i in sorted(outcome.final_observations)]
        for r, index in enumerate(outcome.indices):
            answers.append((
                index, observations[r], outcome.rewards[r],
                outcome.terminated[r], outcome.truncated[r], outcome.autoreset[r],
                outcome.episode_ids[r] != "", outcome.step_counts[r],
            ))  # fmt: skip
        answers.append(tuple(final_rows))  # messages compare by value (maps in any order)
    answers.append(tuple(envs.states()))
    return answers


@pytest.mark.parametrize("mode", ["next_step", "same_step", "disabled"])
def test_the_batch_answers_as_the_loop_over_plain_echo_envs(start_server, mode: str) -> None:
    batched, looped = start_server(BATCH), start_server(LOOP)
    # DISABLED: env 1 ends in the first round and may not step again (a batch-form step
    # naming it is refused as a whole): one round.
    rounds = 1 if mode == "disabled" else len(SCRIPT)
    with VectorSession(batched.target, 3, autoreset=mode) as native:
        assert native.native
        got = _play(native, batch=True, rounds=rounds)
    with VectorSession(looped.target, 3, autoreset=mode) as loop:
        assert not loop.native
        want = _play(loop, batch=False, rounds=rounds)
    assert got == want
    batched.wait_until(lambda: batched.active() == 0)


def test_per_env_clients_are_served_through_the_batch(start_server) -> None:
    server = start_server(BATCH)
    with VectorSession(server.target, 4) as envs:
        assert envs.native
        first = envs.reset()
        assert [o.echoed_message for o in first.observations] == ["ready"] * 4
        out = envs.step(_actions(["w", "x", "y", "z"]))
        assert [o.echoed_message for o in out.observations] == ["w", "x", "y", "z"]
        assert out.rewards == pytest.approx([0.1] * 4)
        part = envs.step(_actions(["only"]), indices=[2])
        assert part.indices == [2] and part.step_counts == [2]
        assert envs.state(2) == EchoState(total_length=5, history=["y", "only"])
    server.wait_until(lambda: server.active() == 0)


def test_refusals_are_per_row_and_per_request(start_server) -> None:
    server = start_server(BATCH)
    with VectorSession(server.target, 3) as envs:
        envs.reset(batch=True)
        with pytest.raises(EnvError) as refused:
            envs.step_batch(EchoAction(rows=_actions(["a", "b"])))
        assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert "2 action rows for 3 envs" in refused.value.message
        assert envs.step_counts == [0, 0, 0]  # nothing was stepped
        too_long = "x" * (MAX_MESSAGE_CHARS + 1)
        out = envs.step_batch(EchoAction(rows=_actions(["a", too_long, "c"])))
        assert out.indices == [0, 2] and set(out.errors) == {1}
        assert out.errors[1].code is grpc.StatusCode.INVALID_ARGUMENT
        assert "the limit is 65536" in out.errors[1].message
        rows = out.batch_observation.rows  # type: ignore[union-attr]
        assert [o.echoed_message for o in rows] == ["a", "c"]
        # The refused env's episode goes on; the stream too.
        again = envs.step_batch(EchoAction(rows=_actions(["d", "e", "f"])))
        assert again.step_counts == [2, 1, 2]
    server.wait_until(lambda: server.active() == 0)


def test_a_batch_envs_snapshot_restores_into_a_session_and_back(start_server) -> None:
    keys = {"SNAPSHOT_KEYS": "shared:0123456789abcdef0123456789abcdef"}
    batched, plain = start_server(BATCH, extra_env=keys), start_server(LOOP, extra_env=keys)
    with VectorSession(batched.target, 2) as envs:
        envs.reset(options=EchoResetOptions(max_steps=5))
        envs.step_batch(EchoAction(rows=_actions(["one", "two"])))
        data = envs.snapshot(indices=[1])[0]
        with Session(plain.target) as session:
            restored = session.restore(data)
            assert restored.step_count == 1
            assert session.state() == EchoState(total_length=3, history=["two"])
            session.step(EchoAction(message="three"))
            back = session.snapshot()
        envs.restore([back], indices=[0])
        assert envs.state(0) == EchoState(total_length=8, history=["two", "three"])
        out = envs.step_batch(EchoAction(rows=_actions(["four", "x"])))
        assert out.step_counts == [3, 2]
        rows = out.batch_observation.rows  # type: ignore[union-attr]
        assert rows[0] == EchoObservation(echoed_message="four", message_length=4)
    batched.wait_until(lambda: batched.active() == 0)
