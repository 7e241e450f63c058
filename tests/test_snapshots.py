"""Snapshots, restore and fork over real gRPC, against real server processes: a Session's,
a VectorSession's by index, and forks into both.

The env is mostly ``SnapshotEchoEnv`` (tests/support/envs.py): deterministic, with a
seeded random stream in every reward, so a restored episode repeats only if the snapshot
really carried the env's state, and it misbehaves on command (``snapshot:raise`` ...).
What one env may do wrong runs on both streams (``Row``): a Session's env, and env 1 of a
vector whose env 0 must answer beside it. Each refusal is checked for its code, for words
of its message, and for the episodes going on unchanged. Servers are shared per module;
each env instance records its life in a ledger, so leaks show.
"""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from openenv_grpc import AutoresetMode
from openenv_grpc.client import EnvError, Session, VectorEnvError
from openenv_grpc.client.errors import CapacityError, InvalidRequest
from openenv_grpc.client.outcome import Restored
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
from support.servers import started_together

pytestmark = pytest.mark.timeout(90)

TESTS = Path(__file__).resolve().parent
SNAP = "support.envs:SnapshotEchoEnv"
SECRET = "0123456789abcdef0123456789abcdef"
K1 = f"k1:{SECRET}"
K2 = "k2:fedcba9876543210fedcba9876543210"
ACTIONS = [EchoAction(message=m) for m in ("alpha", "be", "gamma-ray", "d", "epsilon", "z")]

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED
INTERNAL = grpc.StatusCode.INTERNAL
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED

#: Run a test on a Session's env and on env 1 of a VectorSession.
BOTH_STREAMS = pytest.mark.parametrize("vector", [False, True], ids=["session", "vector"])


class Ledgered(ServerProcess):
    """A server whose test envs record their creation and close in ``ledger``."""

    def __init__(self, env: str, ledger: Path, *args: str, keys: str | None = None,
                 environ: dict[str, str] | None = None) -> None:  # fmt: skip
        ledger.mkdir()
        self.ledger = ledger
        extra = {"OPENENV_TEST_LEDGER": str(ledger), **(environ or {})}
        if keys is not None:
            extra["SNAPSHOT_KEYS"] = keys
        super().__init__(env, args, extra, pythonpath=[TESTS])

    def leaks(self) -> int:
        """Envs still open (none may be once their sessions closed)."""
        return len(list(self.ledger.glob("*.open")))

    def settled(self) -> None:
        """Every env of the closed streams is closed and every slot free."""
        self.wait_until(lambda: self.active() == 0 and self.leaks() == 0, what="all closed")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Ledgered]]:
    """The module's servers, by role; started once."""
    root = tmp_path_factory.mktemp("snapshot-ledgers")
    keyfile = root / "keys"
    keyfile.write_text(f"# the same key as `main`, from a file\n{K1}\n")
    keyfile.chmod(0o600)
    keys = {"SNAPSHOT_KEYS": K1}
    plan: dict[str, tuple[str, tuple[str, ...], dict[str, str]]] = {
        "main": (SNAP, (), keys),
        "twin": (SNAP, (), {"SNAPSHOT_KEYS_FILE": str(keyfile)}),
        "rotated": (SNAP, (), {"SNAPSHOT_KEYS": f"{K2},{K1}"}),
        "other_key": (SNAP, (), {"SNAPSHOT_KEYS": "k1:another-secret-of-key-k1"}),
        "new_key": (SNAP, (), {"SNAPSHOT_KEYS": K2}),
        "other_env": ("support.envs:OtherSnapshotEnv", (), keys),
        "v2": ("support.envs:SnapshotEchoEnvV2", (), keys),
        "small": (SNAP, ("--max-snapshot-bytes", "2048"), keys),
        "plain": ("support.envs:DeterministicEchoEnv", (), {}),  # no snapshots, no keys
        "spread": (SNAP, ("--isolated", "2"), keys),
        "tight": (SNAP, ("--max-message-bytes", "8192"), keys),
        "native": ("support.envs:BatchingEchoEnv", (), keys),
        "capacity": (SNAP, ("--max-concurrent-envs", "3"), keys),
    }
    makers = {
        role: functools.partial(Ledgered, env, root / role, *args, environ=environ)
        for role, (env, args, environ) in plan.items()
    }
    with started_together(makers) as made:
        yield made


# -- a Session's helpers ----------------------------------------------------------------


def play(env: Session, actions: list[EchoAction]) -> list[tuple[float, int, bool]]:  # type: ignore[type-arg]
    """Step ``actions``; what each step gave (reward, step count, done)."""
    return [(r.reward, r.step_count, r.done) for r in map(env.step, actions)]


def prefix(env: EchoEnv, steps: int = 3, seed: int = 7) -> None:
    env.reset(seed=seed, episode_id="ep-1", options=EchoResetOptions(max_steps=20))
    play(env, ACTIONS[:steps])


def refusal(env: EchoEnv, data: bytes) -> EnvError:
    """Restore ``data``; assert it is refused in-band and the episode is unchanged."""
    before = env.step_count, env.episode_id
    with pytest.raises(EnvError) as refused:
        env.restore(data)
    assert (env.step_count, env.episode_id) == before
    return refused.value


def goes_on(env: EchoEnv) -> None:
    """The session still steps, from where it was."""
    count = env.step_count
    assert env.step(EchoAction(message="still here")).step_count == count + 1


# -- a vector's helpers -----------------------------------------------------------------


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


# -- one env on either stream -----------------------------------------------------------


class Row:
    """The env a test drives, on either stream: a Session's env, or env 1 of a two-env
    VectorSession (autoreset off, as on a Session) whose env 0 is a neighbour with an
    episode of its own: it steps, snapshots and restores (to itself) in the same calls,
    and must answer every time, whatever env 1 does. Where ``shares_fate`` (an env without
    snapshots), the neighbour must fail exactly as env 1 does."""

    def __init__(self, target: str, vector: bool, shares_fate: bool = False) -> None:
        self.vector, self.shares_fate = vector, shares_fate
        self.client: Any = (
            EchoVectorEnv(target, 2, autoreset=AutoresetMode.DISABLED)
            if vector
            else EchoEnv(target)
        )

    def __enter__(self) -> Row:
        self.client.open()
        if self.vector:
            self.client.reset(indices=[0], seeds=5, options=EchoResetOptions(max_steps=50))
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()

    @property
    def step_count(self) -> int:
        return int(self.client.step_counts[1] if self.vector else self.client.step_count)

    def position(self) -> object:
        """Where every env of the stream is: episode ids and step counts."""
        if self.vector:
            return self.client.episode_ids, self.client.step_counts
        return self.client.episode_id, self.client.step_count

    def reset(self, seed: int = 7, max_steps: int = 20) -> None:
        options = EchoResetOptions(max_steps=max_steps)
        if self.vector:
            self.client.reset(indices=[1], seeds=seed, options=options, episode_ids=["ep-1"])
        else:
            self.client.reset(seed=seed, episode_id="ep-1", options=options)

    def step(self, message: str) -> int:
        """Step ``message`` (the neighbour steps beside it); the env's step count. Raises
        the env's error if its step failed."""
        if not self.vector:
            return int(self.client.step(EchoAction(message=message)).step_count)
        outcome = self.client.step(say("neighbour", message))
        assert 0 not in outcome.errors, outcome.errors
        if 1 in outcome.errors:
            raise outcome.errors[1]
        return int(outcome.step_counts[outcome.indices.index(1)])

    def prefix(self, steps: int = 3) -> None:
        """Reset with seed 7 and take ``steps`` steps."""
        self.reset()
        for action in ACTIONS[:steps]:
            self.step(action.message)

    def snapshot(self) -> bytes:
        if not self.vector:
            return bytes(self.client.snapshot())
        try:
            return bytes(self.client.snapshot()[1])
        except VectorEnvError as failed:
            raise self._alone(failed) from None

    def restore(self, data: bytes) -> Restored:
        if not self.vector:
            return self.client.restore(data)  # type: ignore[no-any-return]
        own = b"-" if self.shares_fate else self.client.snapshot(indices=[0])[0]
        try:
            return self.client.restore([own, data])[1]  # type: ignore[no-any-return]
        except VectorEnvError as failed:
            raise self._alone(failed) from None

    def _alone(self, failed: VectorEnvError) -> EnvError:
        """Env 1's error, once the neighbour is seen to have answered (or, sharing its
        fate, to have failed with the same code and message)."""
        mine = failed.errors[1]
        if self.shares_fate:
            neighbour = failed.errors[0]
            assert (neighbour.code, neighbour.message) == (mine.code, mine.message)
        else:
            assert list(failed.errors) == [1] and failed.done == [0], failed
        return mine

    def refused(self, call: Callable[[], object]) -> EnvError:
        """``call`` (a snapshot or a restore) fails in-band and moves no episode: the
        env's error."""
        before = self.position()
        with pytest.raises(EnvError) as refused:
            call()
        assert self.position() == before
        return refused.value

    def goes_on(self) -> None:
        """The env still steps, from where it was."""
        count = self.step_count
        assert self.step("still here") == count + 1


@pytest.fixture(scope="module")
def foreign(servers: dict[str, Ledgered]) -> dict[str, bytes]:
    """Snapshots after three steps, by the server that signed them: main, another env,
    another version of the env."""
    made: dict[str, bytes] = {}
    for role in ("main", "other_env", "v2"):
        with EchoEnv(servers[role].target) as env:
            prefix(env)
            made[role] = env.snapshot()
    return made


@BOTH_STREAMS
def test_refusals_each_have_their_code_and_leave_the_episodes_going(
    servers: dict[str, Ledgered], foreign: dict[str, bytes], vector: bool
) -> None:
    data = foreign["main"]
    cases: list[tuple[str, bytes, grpc.StatusCode, str]] = [
        ("main", foreign["other_env"], FAILED_PRECONDITION,
         "snapshot of env 'other-snapshot-echo' (version 1.0.0); this server hosts env "
         "'snapshot-echo'"),
        ("main", foreign["v2"], FAILED_PRECONDITION,
         "version 2.0.0; this server hosts version 1.0.0"),
        ("main", flipped(data), INVALID_ARGUMENT,
         "snapshot signature does not match under key 'k1'"),
        ("main", data[:-10], INVALID_ARGUMENT, f"snapshot truncated: {len(data) - 10} of its"),
        ("main", b"", INVALID_ARGUMENT, "empty snapshot"),
        ("main", b"\x89PNG\r\n\x1a\n" * 4, INVALID_ARGUMENT, "not a snapshot"),
        ("other_key", data, INVALID_ARGUMENT,  # the same key id, another secret
         "signed with another secret under the same key id"),
        ("new_key", data, FAILED_PRECONDITION,  # another key altogether
         "key 'k1', which this server does not hold (it verifies k2)"),
    ]  # fmt: skip
    for role, bad, code, words in cases:
        with Row(servers[role].target, vector) as row:
            row.prefix(steps=2)
            error = row.refused(lambda bad=bad: row.restore(bad))
            assert (error.code, words in error.message) == (code, True), (role, error.message)
            row.goes_on()
    for role in ("main", "other_key", "new_key"):
        servers[role].settled()


@BOTH_STREAMS
def test_what_the_env_does_wrong_is_in_band_and_the_episodes_go_on(
    servers: dict[str, Ledgered], vector: bool
) -> None:
    with Row(servers["main"].target, vector) as row:
        early = row.refused(row.snapshot)
        assert early.code is FAILED_PRECONDITION
        assert "snapshot before reset" in early.message
        row.prefix()
        for command, code, words in [
            (
                "snapshot:raise",
                INTERNAL,
                "snapshot failed: RuntimeError: snapshot failed on purpose",
            ),
            ("snapshot:invalid", INVALID_ARGUMENT, "cannot snapshot now, on purpose"),
            # NotImplementedError with a reason: this configuration cannot snapshot.
            ("snapshot:unsupported", UNIMPLEMENTED, "not in this configuration, on purpose"),
            ("snapshot:not-bytes", INTERNAL, "returned a str from snapshot(), not bytes"),
        ]:
            row.step(command)
            failed = row.refused(row.snapshot)  # a failed snapshot never moves the episode
            assert (failed.code, words in failed.message) == (code, True), failed.message
            row.goes_on()
        row.step("snapshot:ok")
        row.step("restore:invalid")
        refused_by_env = row.snapshot()
        error = row.refused(lambda: row.restore(refused_by_env))
        assert (error.code, "refused, on purpose" in error.message) == (INVALID_ARGUMENT, True)
        row.goes_on()
        row.step("restore:raise")
        breaking = row.snapshot()
        with pytest.raises(EnvError) as broke:
            row.restore(breaking)
        assert broke.value.code is INTERNAL and "restore failed on purpose" in broke.value.message
        with pytest.raises(EnvError) as after:
            row.step("x")
        assert after.value.code is FAILED_PRECONDITION  # half-restored: only a reset now
        row.reset()
        assert row.step_count == 0
        row.goes_on()
    servers["main"].settled()


@BOTH_STREAMS
def test_the_size_limit_is_named_both_ways(servers: dict[str, Ledgered], vector: bool) -> None:
    small = servers["small"]
    assert small.info().snapshots.max_bytes == 2048
    with Row(servers["main"].target, vector) as row:
        row.prefix()
        row.step("snapshot:big:3000")
        big = row.snapshot()  # fine under main's 8 MiB
    with Row(small.target, vector) as row:
        row.prefix()
        error = row.refused(lambda: row.restore(big))
        assert error.code is INVALID_ARGUMENT
        assert f"snapshot is {len(big)} bytes, over this server's snapshot limit of 2048" in (
            error.message
        )
        row.goes_on()
        row.step("snapshot:big:3000")
        made = row.refused(row.snapshot)
        assert made.code is RESOURCE_EXHAUSTED
        assert "over this server's snapshot limit of 2048 bytes" in made.message
        assert "MAX_SNAPSHOT_BYTES" in made.message
        row.goes_on()
    small.settled()


@BOTH_STREAMS
def test_an_env_without_snapshots_answers_unimplemented_and_keeps_working(
    servers: dict[str, Ledgered], foreign: dict[str, bytes], vector: bool
) -> None:
    plain = servers["plain"]
    with Row(plain.target, vector, shares_fate=True) as row:
        row.reset(seed=1)
        row.step("one")
        attempts: list[Callable[[], object]] = [row.snapshot, lambda: row.restore(foreign["main"])]
        if not vector:
            attempts.append(row.client.fork)
        for attempt in attempts:
            failed = row.refused(attempt)
            assert failed.code is UNIMPLEMENTED
            assert "does not support snapshots" in failed.message
            row.goes_on()
        assert row.step_count == 1 + len(attempts)
    plain.settled()


@BOTH_STREAMS
def test_an_ended_episode_restores_ended(servers: dict[str, Ledgered], vector: bool) -> None:
    with Row(servers["main"].target, vector) as row:
        row.reset(seed=2, max_steps=2)
        row.step("a")
        row.step("b")
        data = row.snapshot()
    with Row(servers["twin"].target, vector) as other:
        restored = other.restore(data)
        assert (restored.truncated, restored.terminated, restored.done) == (True, False, True)
        with pytest.raises(EnvError) as failed:
            other.step("c")
        assert failed.value.code is FAILED_PRECONDITION
        assert "reset" in failed.value.message
    servers["twin"].settled()


# -- round trip, fork -------------------------------------------------------------------


def test_restore_continues_exactly_where_the_snapshot_was(servers: dict[str, Ledgered]) -> None:
    with EchoEnv(servers["main"].target) as env:
        prefix(env)
        state = env.state()
        data = env.snapshot()
        assert isinstance(data, bytes) and data.startswith(b"OGSN")
        original = play(env, ACTIONS[3:])
        restored = env.restore(data)
        assert (restored.episode_id, restored.step_count, restored.done) == ("ep-1", 3, False)
        assert (env.episode_id, env.step_count) == ("ep-1", 3)
        assert env.state() == state
        assert play(env, ACTIONS[3:]) == original
        # Restoring twice gives the same again: a snapshot is a value, not a one-shot.
        env.restore(data)
        assert play(env, ACTIONS[3:]) == original


def test_forks_branch_the_episode_and_repeat_it(servers: dict[str, Ledgered]) -> None:
    server = servers["main"]
    with EchoEnv(server.target) as env:
        prefix(env)
        with env.fork() as branch:
            assert (branch.episode_id, branch.step_count) == ("ep-1", 3)
            assert branch.session_id != env.session_id
            original = play(branch, ACTIONS[3:])
        branches = env.fork(3)
        assert len({b.session_id for b in branches}) == 3
        # Each branch goes its own way; the parent does not move.
        assert play(branches[0], ACTIONS[3:]) == original
        play(branches[1], [EchoAction(message="another way")] * 4)
        assert play(branches[2], ACTIONS[3:]) == original
        assert env.step_count == 3
        assert play(env, ACTIONS[3:]) == original
    # The parent is closed first: its channel stays until the last fork lets go of it.
    assert play(branches[1], ACTIONS[:1])[0][1] == 8
    for branch in branches:
        branch.close()
    server.wait_until(lambda: server.active() == 0, what="every fork closed")
    server.wait_until(lambda: server.leaks() == 0, what="every env closed")


def test_async_forks_open_concurrently_and_repeat_the_original(
    servers: dict[str, Ledgered],
) -> None:
    server = servers["main"]

    async def main() -> None:
        async with AsyncEchoEnv(server.target) as env:
            await env.reset(seed=3, options=EchoResetOptions(max_steps=20))
            for action in ACTIONS[:2]:
                await env.step(action)
            branches = await env.fork(4)
            async with await env.fork() as single:
                expected = [(await single.step(a)).reward for a in ACTIONS[2:]]
            for branch in branches:
                assert [(await branch.step(a)).reward for a in ACTIONS[2:]] == expected
        for branch in branches:  # the parent's channel outlives it for its forks
            assert (await branch.step(ACTIONS[0])).step_count == len(ACTIONS) + 1
            await branch.close()

    asyncio.run(main())
    server.wait_until(lambda: server.active() == 0, what="every fork closed")


def test_a_fork_is_admitted_like_any_open_all_or_nothing(servers: dict[str, Ledgered]) -> None:
    server = servers["capacity"]  # 3 slots
    with EchoEnv(server.target) as env:
        prefix(env)
        data = env.snapshot()
        with pytest.raises(CapacityError):
            env.fork(3)  # two slots left: all or nothing
        with pytest.raises(CapacityError) as full:
            EchoVectorEnv.forked(env, [data] * 3)
        assert "3 envs asked, 2 free" in full.value.message
        assert server.active() == 1
        branches = env.fork(2)  # the two slots left are enough for two
        assert [branch.step_count for branch in branches] == [3, 3]
        for branch in branches:
            branch.close()
        with EchoVectorEnv.forked(env, [data] * 2) as group:
            assert group.step_counts == [3, 3]
        goes_on(env)
    server.settled()


# -- portable: another server with the key, and keys that rotate ------------------------


def test_a_snapshot_restores_on_another_server_process_with_the_same_key(
    servers: dict[str, Ledgered],
) -> None:
    with EchoEnv(servers["main"].target) as env:
        prefix(env)
        data = env.snapshot()
        original = play(env, ACTIONS[3:])
    with EchoEnv(servers["twin"].target) as elsewhere:  # its key comes from a file
        assert elsewhere.restore(data).step_count == 3
        assert elsewhere.episode_id == "ep-1"
        assert play(elsewhere, ACTIONS[3:]) == original


def test_keys_rotate_the_old_key_still_verifies_and_the_new_one_signs(
    servers: dict[str, Ledgered],
) -> None:
    with EchoEnv(servers["main"].target) as old:
        prefix(old)
        signed_by_k1 = old.snapshot()
        with EchoEnv(servers["rotated"].target) as rotated:
            rotated.restore(signed_by_k1)  # k1 still verifies
            signed_by_k2 = rotated.snapshot()
        assert servers["rotated"].info().snapshots.signing_key_id == "k2"
        # A server that only has k1 cannot take what k2 signed; one with k2 can.
        error = refusal(old, signed_by_k2)
        assert error.code is FAILED_PRECONDITION
        assert "signed with key 'k2', which this server does not hold (it verifies k1)" in (
            error.message
        )
        goes_on(old)
    with EchoEnv(servers["new_key"].target) as new:
        assert new.restore(signed_by_k2).step_count == 3


def test_a_per_server_key_restores_on_that_server_only(tmp_path: Path) -> None:
    first = Ledgered(SNAP, tmp_path / "a", keys=None)
    second = Ledgered(SNAP, tmp_path / "b", keys=None)
    try:
        assert first.info().snapshots.ephemeral_key
        with EchoEnv(first.target) as env:
            prefix(env)
            data = env.snapshot()
            original = play(env, ACTIONS[3:])
        with EchoEnv(first.target) as again:  # another session, same server process
            again.restore(data)
            assert play(again, ACTIONS[3:]) == original
        with EchoEnv(second.target) as env:
            prefix(env)
            error = refusal(env, data)
            assert error.code is FAILED_PRECONDITION
            assert "without SNAPSHOT_KEYS it signs with a random key made at start" in (
                error.message
            )
            goes_on(env)
    finally:
        first.stop()
        second.stop()


# -- a vector by index: round trip ------------------------------------------------------


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
    with EchoVectorEnv(server.target, 1, autoreset=AutoresetMode.SAME_STEP) as envs:
        envs.restore(data[:1])  # SAME_STEP resets in the step that ends: none is due now
        blocked = envs.step(say("f"))
        assert blocked.errors[0].code is FAILED_PRECONDITION
        assert "no autoreset is due" in blocked.errors[0].message
        envs.reset(options=EchoResetOptions(max_steps=5))
        assert not envs.step(say("g")).errors  # the stream goes on after a reset
    server.settled()


# -- a vector by index: what one env cannot do ------------------------------------------


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


# -- a vector by index: restoring -------------------------------------------------------


def test_refused_snapshots_fail_alone_and_change_nothing(servers: dict[str, Ledgered]) -> None:
    main = servers["main"]
    with started(servers["new_key"].target, 1) as foreign_key:
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


# -- bad requests: the whole request refused, the stream goes on ------------------------


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


# -- --isolated: envs spread over env processes -----------------------------------------


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


# -- forks: G branches of one prefix in one vector stream -------------------------------


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


# -- isolated env processes and forked workers: one server, one key ring ----------------


def test_isolated_snapshots_are_sealed_with_the_servers_key_which_env_code_never_sees(
    servers: dict[str, Ledgered], tmp_path: Path
) -> None:
    isolated = Ledgered(SNAP, tmp_path / "iso", "--isolated", "2", keys=K1)
    ephemeral = Ledgered(SNAP, tmp_path / "eph", "--isolated", "2", keys=None)
    try:
        with EchoEnv(isolated.target) as env:
            prefix(env)
            assert env.step(
                EchoAction(message="environ:SNAPSHOT_KEYS")
            ).observation.echoed_message == ("<unset>")
            data = env.snapshot()
            original = play(env, ACTIONS[3:])
        with EchoEnv(servers["main"].target) as plain:  # a server without env processes
            plain.restore(data)
            assert play(plain, ACTIONS[3:]) == original
            peek = plain.step(EchoAction(message="environ:SNAPSHOT_KEYS"))  # env code inline
            assert peek.observation.echoed_message == "<unset>"
        # The front seals for every env process with the server's one random key: a
        # snapshot of an env in one restores in the other.
        with EchoEnv(ephemeral.target) as a, EchoEnv(ephemeral.target) as b:
            a.reset(seed=1)
            b.reset(seed=1)
            pids = {s.step(EchoAction(message="pid")).observation.echoed_message for s in (a, b)}
            assert len(pids) == 2, "the two sessions should live in two env processes"
            prefix(a)
            b.restore(a.snapshot())
            assert play(b, ACTIONS[3:]) == play(a, ACTIONS[3:])
    finally:
        isolated.stop()
        ephemeral.stop()


def test_forked_workers_share_one_random_key(tmp_path: Path) -> None:
    server = Ledgered(SNAP, tmp_path / "workers", "--workers", "2", keys=None)
    try:
        seen: dict[str, str] = {}
        for _ in range(40):  # each fresh channel is a connection: the kernel spreads them
            with EchoEnv(server.target) as env:
                env.reset(seed=1)
                pid = env.step(EchoAction(message="pid")).observation.echoed_message
                if pid not in seen:
                    prefix(env)
                    seen[pid] = env.snapshot().hex()
            if len(seen) == 2:
                break
        assert len(seen) == 2, "never reached the second worker"
        first, second = (bytes.fromhex(h) for h in seen.values())
        for _ in range(8):
            with EchoEnv(server.target) as env:
                env.restore(first)
                env.restore(second)
    finally:
        server.stop()


# -- starting: keys that are wrong stop the server --------------------------------------


def test_info_advertises_support_the_limit_and_the_signing_key(
    servers: dict[str, Ledgered],
) -> None:
    keyed = servers["small"].info().snapshots
    assert (keyed.supported, keyed.max_bytes, keyed.signing_key_id) == (True, 2048, "k1")
    assert not keyed.ephemeral_key
    plain = servers["plain"].info()
    assert plain.vector.snapshots  # the vector stream has the command, not this env
    plain = plain.snapshots
    assert not plain.supported
    assert plain.ephemeral_key and plain.signing_key_id.startswith("ephemeral-")
    assert plain.max_bytes == 8 * 1024 * 1024


@pytest.mark.parametrize(
    ("environ", "words"),
    [
        ({"SNAPSHOT_KEYS": "k1:tooshort"}, "the secret of key 'k1' is 8 bytes"),
        ({"SNAPSHOT_KEYS": K1, "SNAPSHOT_KEYS_FILE": "/nonexistent"}, "not both"),
        ({"SNAPSHOT_KEYS_FILE": "/nonexistent/keys"}, "/nonexistent/keys"),
    ],
)
def test_bad_keys_stop_the_server_at_start_without_printing_a_secret(
    environ: dict[str, str], words: str
) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SNAPSHOT_")}
    done = subprocess.run(
        [sys.executable, "-m", "openenv_grpc", "serve", "echo", "--port", "0"],
        env={**clean, **environ}, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode != 0
    assert words in done.stderr
    assert "tooshort" not in done.stderr + done.stdout
    assert SECRET not in done.stderr + done.stdout


def test_restore_takes_bytes_only(servers: dict[str, Ledgered]) -> None:
    with Session(servers["main"].target) as env, pytest.raises(TypeError, match="is bytes"):
        env.restore("OGSN...")  # type: ignore[arg-type]


def test_fork_needs_a_positive_count(servers: dict[str, Ledgered]) -> None:
    with EchoEnv(servers["main"].target) as env:
        prefix(env)
        with pytest.raises(ValueError, match="n >= 1"):
            env.fork(0)
        assert servers["main"].active() >= 1
