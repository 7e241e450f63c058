"""Snapshot and restore per index on a VectorSession stream, and forks into one, over real
gRPC against real server processes.

The env is mostly ``SnapshotEchoEnv`` (tests/support/envs.py): deterministic, with a
seeded random stream in every reward, so a restored env repeats only if its snapshot
really carried its state, and it misbehaves on command (``snapshot:raise`` ...). Each
per-index error is checked for its code, for its neighbours answering, and for the
stream going on; each test ends with no env left open (the envs' ledgers) and no slot
held (Info's active count back to zero).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from openenv_grpc import AutoresetMode
from openenv_grpc.client import EnvError, VectorEnvError
from openenv_grpc.client.errors import CapacityError, InvalidRequest
from openenv_grpc.testing import ServerProcess
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc_envs.echo import (
    AsyncEchoEnv,
    AsyncEchoVectorEnv,
    EchoAction,
    EchoEnv,
    EchoResetOptions,
    EchoVectorEnv,
)
from support.raw_vector import RawVector

pytestmark = pytest.mark.timeout(90)

TESTS = Path(__file__).resolve().parent
SNAP = "support.envs:SnapshotEchoEnv"
K1 = "k1:0123456789abcdef0123456789abcdef"
K2 = "k2:fedcba9876543210fedcba9876543210"

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED
INTERNAL = grpc.StatusCode.INTERNAL
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


class Ledgered(ServerProcess):
    """A server whose test envs record their creation and close in ``ledger``."""

    def __init__(self, env: str, ledger: Path, *args: str, keys: str = K1) -> None:
        ledger.mkdir()
        self.ledger = ledger
        environ = {"OPENENV_TEST_LEDGER": str(ledger), "SNAPSHOT_KEYS": keys}
        super().__init__(env, args, environ, pythonpath=[TESTS])

    def settled(self) -> None:
        """Every env of the closed streams is closed and every slot free."""
        self.wait_until(lambda: self.active() == 0 and not list(self.ledger.glob("*.open")))


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Ledgered]]:
    """The module's servers, by role; started once."""
    root = tmp_path_factory.mktemp("vector-snapshot-ledgers")
    plan: dict[str, tuple[str, tuple[str, ...], str]] = {
        "main": (SNAP, (), K1),
        "other_key": (SNAP, (), K2),
        "v2": ("support.envs:SnapshotEchoEnvV2", (), K1),
        "spread": (SNAP, ("--isolated", "2"), K1),
        "plain": ("support.envs:DeterministicEchoEnv", (), K1),
        "small": (SNAP, ("--max-snapshot-bytes", "2048"), K1),
        "tight": (SNAP, ("--max-message-bytes", "8192"), K1),
        "native": ("support.envs:BatchingEchoEnv", (), K1),
        "capacity": (SNAP, ("--max-concurrent-envs", "3"), K1),
    }
    made: dict[str, Ledgered] = {}
    try:
        for role, (env, args, keys) in plan.items():
            made[role] = Ledgered(env, root / role, *args, keys=keys)
        yield made
    finally:
        for server in made.values():
            server.stop()


def say(*messages: str) -> list[EchoAction]:
    return [EchoAction(message=m) for m in messages]


def rewards(envs: EchoVectorEnv, messages: str, indices: list[int] | None = None) -> list[float]:
    """Step one message per env named (a letter each); the rewards, per row."""
    outcome = envs.step(say(*messages), indices=indices)
    assert not outcome.errors
    return outcome.rewards


def command(envs: EchoVectorEnv, message: str, indices: list[int]) -> None:
    """Step ``message`` in each env of ``indices`` (e.g. ``snapshot:raise``)."""
    assert not envs.step(say(*[message] * len(indices)), indices=indices).errors


def started(target: str, n: int = 4, **kwargs: Any) -> EchoVectorEnv:
    """An open vector of ``n`` envs, reset with seeds 10.. and stepped twice."""
    envs = EchoVectorEnv(target, n, **kwargs)
    envs.open()
    envs.reset(seeds=10, options=EchoResetOptions(max_steps=50))
    rewards(envs, "abcdefgh"[:n])
    rewards(envs, "ijklmnop"[:n])
    return envs


def flipped(data: bytes) -> bytes:
    """``data`` with one byte of its body altered (the HMAC no longer matches)."""
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1 :]


# -- round trip -------------------------------------------------------------------------


def test_snapshot_and_restore_by_index_repeat_each_env(servers: dict[str, Ledgered]) -> None:
    server = servers["main"]
    with started(server.target) as envs:
        ids, counts = envs.episode_ids, envs.step_counts
        snapshots = envs.snapshot(indices=[0, 2])
        assert len(snapshots) == 2 and all(s.startswith(b"OGSN") for s in snapshots)
        assert envs.step_counts == counts  # a snapshot changes no episode
        original = rewards(envs, "wxyz")
        rewards(envs, "wxyz")  # envs 0 and 2 move on, then go back
        restored = envs.restore(snapshots, indices=[0, 2])
        assert [(r.episode_id, r.step_count, r.done) for r in restored] == [
            (ids[0], 2, False), (ids[2], 2, False),
        ]  # fmt: skip
        assert envs.episode_ids == ids
        assert envs.step_counts == [2, 4, 2, 4]  # the neighbours were not touched
        again = envs.step(say("w", "y"), indices=[0, 2])
        assert again.rewards == [original[0], original[2]]
        assert again.step_counts == [3, 3]
        # All envs at once (indices None), twice: a snapshot is a value.
        whole = envs.snapshot()
        first = rewards(envs, "abcd")
        for _ in range(2):
            envs.restore(whole)
            assert rewards(envs, "abcd") == first
    server.settled()


def test_a_vector_env_and_a_session_trade_snapshots(servers: dict[str, Ledgered]) -> None:
    server = servers["main"]
    with started(server.target) as envs, EchoEnv(server.target) as env:
        from_vector = envs.snapshot(indices=[3])[0]
        expected = rewards(envs, "qrst")[3]
        restored = env.restore(from_vector)
        assert (restored.episode_id, restored.step_count) == (envs.episode_ids[3], 2)
        assert env.step(EchoAction(message="t")).reward == expected
        # And back: a session's snapshot continues in env 1 of the vector.
        env.reset(seed=99, episode_id="solo", options=EchoResetOptions(max_steps=50))
        env.step(EchoAction(message="solo"))
        from_session = env.snapshot()
        follows = env.step(EchoAction(message="n")).reward
        [back] = envs.restore([from_session], indices=[1])
        assert (back.episode_id, back.step_count) == ("solo", 1)
        outcome = envs.step(say("n"), indices=[1])
        assert outcome.rewards == [follows] and outcome.episode_ids == ["solo"]
    server.settled()


def test_a_restored_ended_episode_autoresets_at_its_next_step(
    servers: dict[str, Ledgered],
) -> None:
    server = servers["main"]
    with EchoVectorEnv(server.target, 2) as envs:
        envs.reset(options=EchoResetOptions(max_steps=1))
        ended = envs.step(say("a", "b"))
        assert ended.truncated == [True, True]
        data = envs.snapshot()
        autoreset = envs.step(say("c", "d"))  # NEXT_STEP: this step reset both
        assert autoreset.autoreset == [True, True]
        restored = envs.restore(data)
        assert [r.truncated for r in restored] == [True, True]
        again = envs.step(say("c", "d"))
        assert again.autoreset == [True, True] and again.step_counts == [0, 0]
    with EchoVectorEnv(server.target, 1, autoreset=AutoresetMode.DISABLED) as envs:
        envs.restore(data[:1])  # an ended episode under DISABLED must be reset first
        blocked = envs.step(say("e"))
        assert blocked.errors[0].code is FAILED_PRECONDITION
        assert "truncated and no autoreset is due: reset it" in blocked.errors[0].message
    with EchoVectorEnv(server.target, 1, autoreset=AutoresetMode.SAME_STEP) as envs:
        envs.restore(data[:1])  # SAME_STEP resets in the step that ends: none is due now
        blocked = envs.step(say("f"))
        assert blocked.errors[0].code is FAILED_PRECONDITION
        assert "no autoreset is due" in blocked.errors[0].message
        envs.reset(options=EchoResetOptions(max_steps=5))
        assert not envs.step(say("g")).errors  # the stream goes on after a reset
    server.settled()


# -- per-index errors: capturing --------------------------------------------------------


def test_an_env_without_snapshots_answers_unimplemented_per_index(
    servers: dict[str, Ledgered],
) -> None:
    server = servers["plain"]
    with started(server.target, 2) as envs:
        with pytest.raises(VectorEnvError) as refused:
            envs.snapshot()
        assert {i: e.code for i, e in refused.value.errors.items()} == {
            0: UNIMPLEMENTED, 1: UNIMPLEMENTED,
        }  # fmt: skip
        assert "does not support snapshots" in refused.value.errors[0].message
        with pytest.raises(VectorEnvError) as restoring:
            envs.restore([b"OGSN-anything", b"x"])
        assert restoring.value.code is UNIMPLEMENTED and restoring.value.done == []
        assert rewards(envs, "ab") and envs.step_counts == [3, 3]  # the stream goes on
    assert server.info().vector.snapshots and not server.info().snapshots.supported
    server.settled()


@pytest.mark.parametrize(
    ("misbehave", "code", "words"),
    [
        ("snapshot:unsupported", UNIMPLEMENTED, "not in this configuration, on purpose"),
        ("snapshot:raise", INTERNAL, "snapshot failed on purpose"),
        ("snapshot:invalid", INVALID_ARGUMENT, "cannot snapshot now, on purpose"),
        ("snapshot:not-bytes", INTERNAL, "not bytes"),
    ],
)
def test_an_env_that_cannot_snapshot_fails_alone(
    servers: dict[str, Ledgered], misbehave: str, code: grpc.StatusCode, words: str
) -> None:
    server = servers["main"]
    with started(server.target, 3) as envs:
        command(envs, misbehave, [1])
        counts = envs.step_counts
        with pytest.raises(VectorEnvError) as failed:
            envs.snapshot()
        error = failed.value
        assert list(error.errors) == [1] and error.code is code and words in error.message
        assert error.done == [0, 2]  # the neighbours were captured
        assert len(envs.snapshot(indices=[0, 2])) == 2
        assert envs.step_counts == counts
        rewards(envs, "abc")  # env 1's episode goes on (a failed snapshot breaks nothing)
    server.settled()


def test_no_episode_is_failed_precondition_per_index(servers: dict[str, Ledgered]) -> None:
    server = servers["main"]
    with EchoVectorEnv(server.target, 3) as envs:
        envs.reset(indices=[1])
        with pytest.raises(VectorEnvError) as failed:
            envs.snapshot()
        assert {i: e.code for i, e in failed.value.errors.items()} == {
            0: FAILED_PRECONDITION, 2: FAILED_PRECONDITION,
        }  # fmt: skip
        assert "snapshot before reset" in failed.value.errors[0].message
        assert failed.value.done == [1]
    server.settled()


def test_a_snapshot_over_the_size_limit_is_resource_exhausted_for_its_index(
    servers: dict[str, Ledgered],
) -> None:
    server = servers["small"]
    with started(server.target, 2) as envs:
        command(envs, "snapshot:big:4000", [0])
        with pytest.raises(VectorEnvError) as failed:
            envs.snapshot()
        error = failed.value.errors[0]
        assert error.code is RESOURCE_EXHAUSTED and "MAX_SNAPSHOT_BYTES" in error.message
        assert failed.value.done == [1]
    server.settled()


def test_a_whole_answer_over_the_message_limit_is_in_band(servers: dict[str, Ledgered]) -> None:
    server = servers["tight"]  # 8 KiB messages: 7 KiB snapshots fit one by one, not three
    with started(server.target, 3) as envs:
        command(envs, "snapshot:big:2500", [0, 1, 2])
        with pytest.raises(EnvError) as refused:
            envs.snapshot()
        assert refused.value.code is RESOURCE_EXHAUSTED
        assert "8192 bytes" in refused.value.message and "fewer envs" in refused.value.message
        assert not isinstance(refused.value, VectorEnvError)
        each = [envs.snapshot(indices=[i])[0] for i in range(3)]
        assert all(len(data) > 2500 for data in each)
        rewards(envs, "abc")  # the stream goes on
    server.settled()


def test_a_native_batch_without_snapshots_says_why_per_index(
    servers: dict[str, Ledgered],
) -> None:
    server = servers["native"]
    with EchoVectorEnv(server.target, 2) as envs:
        assert envs.native
        envs.reset()
        with pytest.raises(VectorEnvError) as failed:
            envs.snapshot()
        assert {i: e.code for i, e in failed.value.errors.items()} == {
            0: UNIMPLEMENTED, 1: UNIMPLEMENTED,
        }  # fmt: skip
        assert "native batch cannot snapshot one env" in failed.value.errors[0].message
        with EchoEnv(server.target) as env:  # its one-env sessions do snapshot
            env.reset()
            data = env.snapshot()
        with pytest.raises(VectorEnvError) as restoring:
            envs.restore([data], indices=[1])
        assert restoring.value.errors[1].code is UNIMPLEMENTED
        assert envs.step(say("a", "b")).indices == [0, 1]  # the stream goes on
    server.settled()


# -- per-index errors: restoring ----------------------------------------------------------


def test_refused_snapshots_fail_alone_and_change_nothing(servers: dict[str, Ledgered]) -> None:
    main = servers["main"]
    with started(servers["other_key"].target, 1) as foreign_key:
        signed_elsewhere = foreign_key.snapshot()[0]
    with started(servers["v2"].target, 1) as other_version:
        other_release = other_version.snapshot()[0]
    with started(main.target, 6) as envs:
        good = envs.snapshot(indices=[0])[0]
        rewards(envs, "abcdef")
        ids, counts = envs.episode_ids, envs.step_counts
        given = [good, flipped(good), good[:-3], signed_elsewhere, other_release, b""]
        with pytest.raises(VectorEnvError) as refused:
            envs.restore(given)
        codes = {i: (e.code, e.message) for i, e in refused.value.errors.items()}
        assert refused.value.done == [0]
        assert codes[1][0] is INVALID_ARGUMENT and "signature does not match" in codes[1][1]
        assert codes[2][0] is INVALID_ARGUMENT and "truncated" in codes[2][1]
        assert codes[3][0] is FAILED_PRECONDITION and "'k2'" in codes[3][1]
        assert codes[4][0] is FAILED_PRECONDITION and "version 2.0.0" in codes[4][1]
        assert codes[5][0] is INVALID_ARGUMENT and "empty snapshot" in codes[5][1]
        assert envs.step_counts == [2, *counts[1:]]  # env 0 restored, the others unchanged
        assert envs.episode_ids[1:] == ids[1:]
        assert len(rewards(envs, "ghijkl")) == 6  # every env steps on
    main.settled()


def test_an_env_that_refuses_or_fails_its_restore_fails_alone(
    servers: dict[str, Ledgered],
) -> None:
    server = servers["main"]
    with started(server.target, 3) as envs:
        command(envs, "x", [0])
        command(envs, "restore:invalid", [1])
        command(envs, "restore:raise", [2])
        data = envs.snapshot()
        counts = envs.step_counts
        rewards(envs, "abc")
        with pytest.raises(VectorEnvError) as failed:
            envs.restore(data)
        errors = failed.value.errors
        assert errors[1].code is INVALID_ARGUMENT and "refused, on purpose" in errors[1].message
        assert errors[2].code is INTERNAL and "restore failed on purpose" in errors[2].message
        assert failed.value.done == [0]
        assert envs.step_counts == [counts[0], counts[1] + 1, counts[2] + 1]
        after = envs.step(say("d", "e", "f"))
        assert sorted(after.indices) == [0, 1]  # env 1 goes on; env 2 must be reset
        assert after.errors[2].code is FAILED_PRECONDITION
        envs.reset(indices=[2])
        assert len(rewards(envs, "ghi")) == 3
    server.settled()


# -- bad requests: the whole request refused, the stream goes on ----------------------------


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (pb.VectorSessionRequest(snapshot=pb.VectorSnapshot(indices=[0, 3])), "out of range"),
        (pb.VectorSessionRequest(snapshot=pb.VectorSnapshot(indices=[1, 1])), "repeated"),
        (pb.VectorSessionRequest(snapshot=pb.VectorSnapshot(indices=[2, 1])), "increasing"),
        (
            pb.VectorSessionRequest(
                restore=pb.VectorRestore(indices=[0, 3], snapshots=[b"a", b"b"])
            ),
            "out of range",
        ),
        (
            pb.VectorSessionRequest(
                restore=pb.VectorRestore(indices=[1, 1], snapshots=[b"a", b"b"])
            ),
            "repeated",
        ),
        (pb.VectorSessionRequest(restore=pb.VectorRestore(snapshots=[b"a"])), "1 snapshots for 3"),
        (
            pb.VectorSessionRequest(restore=pb.VectorRestore(indices=[0], snapshots=[b"a", b"b"])),
            "2 snapshots for 1",
        ),
    ],
)
def test_a_bad_request_is_invalid_argument_and_the_stream_goes_on(
    servers: dict[str, Ledgered], request_: pb.VectorSessionRequest, words: str
) -> None:
    server = servers["main"]
    stream = RawVector(server.target, 3)
    stream.reset()
    stream.step(say("a", "b", "c"))
    answer = stream.send(request_)
    assert answer.WhichOneof("outcome") == "error"
    assert answer.error.code == INVALID_ARGUMENT.value[0] and words in answer.error.message
    stepped = stream.step(say("d", "e", "f")).result
    assert list(stepped.step_counts) == [2, 2, 2]  # nothing was restored
    stream.close()
    server.settled()


def test_the_client_checks_what_it_can_before_sending(servers: dict[str, Ledgered]) -> None:
    server = servers["main"]
    with started(server.target, 2) as envs:
        data = envs.snapshot()
        with pytest.raises(InvalidRequest):
            envs.restore(data[:1])
        with pytest.raises(InvalidRequest):
            envs.restore(data[0])  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            envs.restore(["not bytes", data[1]])  # type: ignore[list-item]
        assert envs.restore(data)[0].step_count == 2
    server.settled()


# -- --isolated: envs spread over env processes ----------------------------------------------


def test_snapshots_of_a_spread_vector_restore_anywhere(servers: dict[str, Ledgered]) -> None:
    spread, main = servers["spread"], servers["main"]
    with started(spread.target, 4) as envs:
        data = envs.snapshot()
        expected = rewards(envs, "mnop")
        assert [r.step_count for r in envs.restore(data)] == [2, 2, 2, 2]
        assert rewards(envs, "mnop") == expected
        # One block's env refused, the other block restored: per index across processes.
        rewards(envs, "abcd")
        with pytest.raises(VectorEnvError) as refused:
            envs.restore([data[0], data[1], flipped(data[2]), data[3]])
        assert list(refused.value.errors) == [2] and refused.value.done == [0, 1, 3]
        assert envs.step_counts == [2, 2, 4, 2]
        # The same key: a spread env's snapshot continues in a one-process server's vector.
        with EchoVectorEnv(main.target, 1) as other:
            other.restore(data[3:])
            assert rewards(other, "p") == [expected[3]]
    spread.settled()
    main.settled()


def test_a_fork_into_a_spread_vector(servers: dict[str, Ledgered]) -> None:
    spread = servers["spread"]
    with EchoEnv(spread.target) as env:
        env.reset(seed=4, options=EchoResetOptions(max_steps=50))
        env.step(EchoAction(message="prefix"))
        data = env.snapshot()
        expected = [env.step(EchoAction(message=m)).reward for m in "abc"]
        with EchoVectorEnv.forked(env, [data] * 4) as group:
            got = [rewards(group, m * 4) for m in "abc"]
        assert got == [[r] * 4 for r in expected]
    spread.settled()


# -- forks: G branches of one prefix in one vector stream -----------------------------------


def test_a_group_forked_from_one_prefix_repeats_it_in_every_branch(
    servers: dict[str, Ledgered],
) -> None:
    server = servers["main"]
    with EchoEnv(server.target) as env:
        env.reset(seed=3, episode_id="prefix", options=EchoResetOptions(max_steps=50))
        for message in ("one", "two", "three"):
            env.step(EchoAction(message=message))
        data = env.snapshot()
        continuation = [env.step(EchoAction(message=m)).reward for m in ("x", "yy", "zzz")]
        group = EchoVectorEnv.forked(env, [data] * 5)  # on the session's server and channel
        with group:
            assert group.is_open and group.num_envs == 5
            assert group.episode_ids == ["prefix"] * 5 and group.step_counts == [3] * 5
            got = [group.step(say(*[m] * 5)).rewards for m in ("x", "yy", "zzz")]
            assert got == [[r] * 5 for r in continuation]
            # Different actions per branch: the branches go their own ways.
            assert len(set(group.step(say("a", "bb", "a", "ccc", "a")).rewards)) == 3
        server.wait_until(lambda: server.active() == 1)  # only the parent is open
    server.settled()


def test_a_fork_that_cannot_be_restored_leaves_nothing_open(
    servers: dict[str, Ledgered],
) -> None:
    server = servers["main"]
    with EchoEnv(server.target) as env:
        env.reset()
        data = env.snapshot()
        with pytest.raises(VectorEnvError) as refused:
            EchoVectorEnv.forked(server.target, [data, flipped(data), data])
        assert refused.value.errors[1].code is INVALID_ARGUMENT
        server.wait_until(lambda: server.active() == 1)  # the fork's 3 slots are free
        with pytest.raises(ValueError):
            EchoVectorEnv.forked(env, [])
        with pytest.raises(TypeError):
            asyncio.run(AsyncEchoVectorEnv.forked(env, [data]))  # type: ignore[arg-type]
    server.settled()


def test_a_fork_is_admitted_all_or_nothing(servers: dict[str, Ledgered]) -> None:
    server = servers["capacity"]  # 3 slots
    with EchoEnv(server.target) as env:
        env.reset()
        data = env.snapshot()
        with pytest.raises(CapacityError) as full:
            EchoVectorEnv.forked(env, [data] * 3)
        assert "3 envs asked, 2 free" in full.value.message
        with EchoVectorEnv.forked(env, [data] * 2) as group:
            assert group.step_counts == [0, 0]
    server.settled()


def test_async_vector_snapshot_restore_and_fork(servers: dict[str, Ledgered]) -> None:
    server = servers["main"]

    async def run() -> None:
        async with AsyncEchoEnv(server.target) as env:
            await env.reset(seed=8, options=EchoResetOptions(max_steps=50))
            await env.step(EchoAction(message="prefix"))
            data = await env.snapshot()
            expected = (await env.step(EchoAction(message="go"))).reward
            async with await AsyncEchoVectorEnv.forked(env, [data] * 3) as group:
                assert (await group.step(say("go", "go", "go"))).rewards == [expected] * 3
                captured = await group.snapshot(indices=[1])
                await group.step(say("x"), indices=[1])
                [restored] = await group.restore(captured, indices=[1])
                assert restored.step_count == 2
                with pytest.raises(VectorEnvError) as refused:
                    await group.restore([flipped(data)], indices=[0])
                assert refused.value.errors[0].code is INVALID_ARGUMENT

    asyncio.run(run())
    server.settled()
