"""The driver decides a loop batch's autoresets and sends them down with the step (#38):
the new episode ids the envs are reset with are the ones the driver books and answers,
an autoreset uses the options of the env's last reset by the client (none after a
restore), in process and with ``--isolated`` (the step frame carries them to the env
processes), for sync and asyncio envs, under NEXT_STEP and SAME_STEP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from openenv_grpc import AutoresetMode
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.echo import EchoAction, EchoResetOptions, EchoVectorEnv

TESTS = Path(__file__).resolve().parent
KEYS = {"SNAPSHOT_KEYS": "k1:0123456789abcdef0123456789abcdef"}
ENVS = {
    "sync": "support.autoreset_envs:IdEchoEnv",
    "async": "support.autoreset_envs:AsyncIdEchoEnv",
}
PLACES = {"in-process": (), "isolated": ("--isolated", "2")}


@pytest.fixture(
    scope="module",
    params=[(env, place) for env in ENVS for place in PLACES],
    ids=lambda param: "-".join(param),
)
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    env, place = request.param
    process = ServerProcess(ENVS[env], PLACES[place], KEYS, pythonpath=[TESTS])
    yield process
    process.stop()


def say(*messages: str) -> list[EchoAction]:
    return [EchoAction(message=m) for m in messages]


def texts(outcome) -> list[str]:  # type: ignore[no-untyped-def]
    return [o.echoed_message for o in outcome.observations]


def test_next_step_autoresets_with_the_drivers_ids_and_the_last_options(server) -> None:
    with EchoVectorEnv(server.target, 3) as envs:
        # env 0 ends after 1 step, env 1 after 2; env 2 never
        envs.reset(options=[EchoResetOptions(max_steps=n) for n in (1, 2, 0)])
        first = envs.step(say("a", "b", "c"))
        assert first.truncated == [True, False, False] and not any(first.autoreset)
        second = envs.step(say("d", "e", "f"))
        assert second.autoreset == [True, False, False]
        new = second.episode_ids[0]
        assert new and new != first.episode_ids[0]
        # the env was reset with the id the driver answers, and its options again
        assert texts(second)[0] == f"reset {new} 1"
        assert second.step_counts == [0, 2, 2] and second.truncated == [False, True, False]
        third = envs.step(say("g", "h", "i"))
        assert third.autoreset == [False, True, False]
        assert texts(third)[0] == f"step {new} g"
        assert texts(third)[1] == f"reset {third.episode_ids[1]} 2"
        assert third.episode_ids[1] not in (second.episode_ids[1], new)
        # a client reset without options: its autoresets use none
        envs.reset(indices=[0])
        assert envs.step(say("j"), indices=[0]).truncated == [False]


def test_only_the_ended_envs_named_are_autoreset(server) -> None:
    with EchoVectorEnv(server.target, 4) as envs:
        envs.reset(options=EchoResetOptions(max_steps=1))
        assert envs.step(say("a", "b"), indices=[1, 3]).truncated == [True, True]
        out = envs.step(say("c", "d", "e", "f"))
        assert out.autoreset == [False, True, False, True]
        assert out.truncated == [True, False, True, False]
        assert texts(out)[1] == f"reset {out.episode_ids[1]} 1"
        assert texts(out)[3] == f"reset {out.episode_ids[3]} 1"
        assert len(set(out.episode_ids)) == 4


def test_same_step_autoresets_start_the_episodes_their_answers_name(server) -> None:
    with EchoVectorEnv(server.target, 3, autoreset=AutoresetMode.SAME_STEP) as envs:
        start = envs.reset(options=[EchoResetOptions(max_steps=n) for n in (1, 2, 0)])
        one = envs.step(say("a", "b", "c"))
        assert one.autoreset == [True, False, False] and one.truncated == [True, False, False]
        assert texts(one)[0] == f"reset {one.episode_ids[0]} 1"
        assert one.episode_ids[0] != start.episode_ids[0]
        assert one.episode_ids[1:] == start.episode_ids[1:]
        two = envs.step(say("d", "e", "f"))
        assert two.autoreset == [True, True, False]
        assert texts(two)[:2] == [f"reset {two.episode_ids[0]} 1", f"reset {two.episode_ids[1]} 2"]
        assert len(set(two.episode_ids)) == 3 and two.episode_ids[0] != one.episode_ids[0]


def test_a_restored_ended_episode_autoresets_without_the_slots_options(server) -> None:
    with EchoVectorEnv(server.target, 2) as envs:
        envs.reset(options=EchoResetOptions(max_steps=1))
        assert envs.step(say("a", "b")).truncated == [True, True]
        data = envs.snapshot()
        envs.reset(options=EchoResetOptions(max_steps=3))
        envs.restore(data)
        again = envs.step(say("c", "d"))
        assert again.autoreset == [True, True] and again.step_counts == [0, 0]
        assert texts(again) == [f"reset {i} 0" for i in again.episode_ids]
        assert envs.step(say("e", "f")).truncated == [False, False]


def test_a_step_frame_carries_its_autoresets_to_the_env_process() -> None:
    from openenv_grpc.server.local.batch import Autoresets
    from openenv_grpc.server.local.calls import StepArgs, part_args
    from openenv_grpc.server.local.frames import command_frame, read_command

    options = EchoResetOptions(max_steps=4)
    actions = say("a", "b", "c")
    autoresets = Autoresets({4: "id4", 6: "id6"}, {6: options})
    step = StepArgs([4, 5, 6], actions, False, None, autoresets)
    # the block of envs 4.. : local indices 0, 1, 2
    frame = command_frame("step", "step", 3, part_args(step, [0, 1, 2], [0, 1, 2]))
    what, method, envs, (indices, got, batch_form, sent) = read_command(frame)
    assert (what, method, envs) == ("step", "step", 3)
    assert (indices, got, batch_form) == ([0, 1, 2], actions, False)
    assert sent.episode_ids == {0: "id4", 2: "id6"} and sent.options == {2: options}


def test_an_autoreset_whose_episode_ends_as_it_begins_autoresets_again(server) -> None:
    with EchoVectorEnv(server.target, 2) as envs:
        ends = EchoResetOptions(stop_word="at-reset")
        assert envs.reset(options=[ends, EchoResetOptions()]).truncated == [True, False]
        for _ in range(2):  # NEXT_STEP: each step autoresets env 0 (with its options) again
            out = envs.step(say("a", "b"))
            assert out.autoreset == [True, False] and out.truncated == [True, False]
            assert out.step_counts[0] == 0
