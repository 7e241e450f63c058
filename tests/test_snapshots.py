"""Snapshots, restore and fork over real gRPC, against real server processes.

The env is ``SnapshotEchoEnv`` (tests/support/envs.py): deterministic, with a seeded
random stream in every reward, so a restored episode repeats only if the snapshot really
carried the env's state. Each refusal is checked for its code, for words of its message,
and for the session going on with its episode unchanged. Servers are shared per module;
each env instance records its life in a ledger, so leaks show.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from openenv_grpc.client import EnvError, Session
from openenv_grpc.client.errors import CapacityError
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.echo import AsyncEchoEnv, EchoAction, EchoEnv, EchoResetOptions

pytestmark = pytest.mark.timeout(60)

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

#: The start_server fixture of the root conftest.py.
StartServer = Callable[..., ServerProcess]


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


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Ledgered]]:
    """The module's servers, by role; started once."""
    root = tmp_path_factory.mktemp("snapshot-ledgers")
    keyfile = root / "keys"
    keyfile.write_text(f"# the same key as `main`, from a file\n{K1}\n")
    keyfile.chmod(0o600)
    made: dict[str, Ledgered] = {}
    plan: dict[str, tuple[str, tuple[str, ...], dict[str, str]]] = {
        "main": (SNAP, (), {"SNAPSHOT_KEYS": K1}),
        "twin": (SNAP, (), {"SNAPSHOT_KEYS_FILE": str(keyfile)}),
        "rotated": (SNAP, (), {"SNAPSHOT_KEYS": f"{K2},{K1}"}),
        "other_key": (SNAP, (), {"SNAPSHOT_KEYS": "k1:another-secret-of-key-k1"}),
        "new_key": (SNAP, (), {"SNAPSHOT_KEYS": K2}),
        "other_env": ("support.envs:OtherSnapshotEnv", (), {"SNAPSHOT_KEYS": K1}),
        "v2": ("support.envs:SnapshotEchoEnvV2", (), {"SNAPSHOT_KEYS": K1}),
        "small": (SNAP, ("--max-snapshot-bytes", "2048"), {"SNAPSHOT_KEYS": K1}),
        "plain": ("support.envs:FaultyEnv", (), {}),
    }
    try:
        for role, (env, args, environ) in plan.items():
            made[role] = Ledgered(env, root / role, *args, environ=environ)
        yield made
    finally:
        for server in made.values():
            server.stop()


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


# -- round trip, fork -----------------------------------------------------------------


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


def test_a_fork_is_admitted_like_any_open_and_never_leaks(tmp_path: Path) -> None:
    server = Ledgered(SNAP, tmp_path / "ledger", "--max-concurrent-envs", "2", keys=K1)
    try:
        with EchoEnv(server.target) as env:
            prefix(env)
            with pytest.raises(CapacityError):
                env.fork(2)  # one slot left: all or nothing
            assert server.active() == 1
            with env.fork() as branch:  # the one slot left is enough for one
                assert branch.step_count == 3
            goes_on(env)
        server.wait_until(lambda: server.leaks() == 0, what="every env closed")
    finally:
        server.stop()


# -- portable: another server with the key, and keys that rotate -----------------------


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


# -- refusals: each with its code, the session going on --------------------------------


def test_refusals_each_have_their_code_and_leave_the_session_going(
    servers: dict[str, Ledgered],
) -> None:
    with EchoEnv(servers["main"].target) as source:
        prefix(source)
        data = source.snapshot()
    for role in ("other_env", "v2"):
        with EchoEnv(servers[role].target) as env:
            prefix(env)
            foreign = env.snapshot()
        with EchoEnv(servers["main"].target) as env:
            prefix(env, steps=1)
            error = refusal(env, foreign)
            assert error.code is FAILED_PRECONDITION
            expected = (
                "snapshot of env 'other-snapshot-echo' (version 1.0.0); this server hosts "
                "env 'snapshot-echo'"
                if role == "other_env"
                else "version 2.0.0; this server hosts version 1.0.0"
            )
            assert expected in error.message
            goes_on(env)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01
    cases = [
        (bytes(flipped), INVALID_ARGUMENT, "snapshot signature does not match under key 'k1'"),
        (data[:-10], INVALID_ARGUMENT, f"snapshot truncated: {len(data) - 10} of its"),
        (b"", INVALID_ARGUMENT, "empty snapshot"),
        (b"\x89PNG\r\n\x1a\n" * 4, INVALID_ARGUMENT, "not a snapshot"),
    ]
    with EchoEnv(servers["main"].target) as env:
        prefix(env, steps=2)
        for bad, code, words in cases:
            error = refusal(env, bad)
            assert (error.code, words in error.message) == (code, True), error.message
            goes_on(env)
    with EchoEnv(servers["other_key"].target) as env:  # same key id, another secret
        prefix(env, steps=1)
        error = refusal(env, data)
        assert error.code is INVALID_ARGUMENT
        assert "signed with another secret under the same key id" in error.message
        goes_on(env)
    with EchoEnv(servers["new_key"].target) as env:  # another key altogether
        prefix(env, steps=1)
        error = refusal(env, data)
        assert error.code is FAILED_PRECONDITION
        assert "key 'k1', which this server does not hold (it verifies k2)" in error.message
        goes_on(env)


def test_the_size_limit_is_named_both_ways(servers: dict[str, Ledgered]) -> None:
    small = servers["small"]
    assert small.info().snapshots.max_bytes == 2048
    with EchoEnv(servers["main"].target) as env:
        prefix(env)
        env.step(EchoAction(message="snapshot:big:3000"))
        big = env.snapshot()  # fine under main's 8 MiB
    with EchoEnv(small.target) as env:
        prefix(env)
        error = refusal(env, big)
        assert error.code is INVALID_ARGUMENT
        assert f"snapshot is {len(big)} bytes, over this server's snapshot limit of 2048" in (
            error.message
        )
        goes_on(env)
        env.step(EchoAction(message="snapshot:big:3000"))
        with pytest.raises(EnvError) as made:
            env.snapshot()
        assert made.value.code is RESOURCE_EXHAUSTED
        assert "over this server's snapshot limit of 2048 bytes" in made.value.message
        goes_on(env)


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


def test_an_env_without_snapshots_answers_unimplemented_and_keeps_working(
    servers: dict[str, Ledgered],
) -> None:
    plain = servers["plain"]
    with EchoEnv(servers["main"].target) as env:
        prefix(env)
        data = env.snapshot()
    with EchoEnv(plain.target) as env:
        env.reset(seed=1)
        env.step(EchoAction(message="one"))
        for attempt in (env.snapshot, lambda: env.restore(data), env.fork):
            with pytest.raises(EnvError) as failed:
                attempt()
            assert failed.value.code is UNIMPLEMENTED
            assert "does not support snapshots" in failed.value.message
            goes_on(env)
        assert env.step_count == 4
    plain.wait_until(lambda: plain.active() == 0, what="no session left")
    plain.wait_until(lambda: plain.leaks() == 0, what="every env closed")


def test_what_the_env_does_wrong_is_in_band_and_the_session_goes_on(
    servers: dict[str, Ledgered],
) -> None:
    with EchoEnv(servers["main"].target) as env:
        with pytest.raises(EnvError) as early:
            env.snapshot()
        assert early.value.code is FAILED_PRECONDITION
        assert "snapshot before reset" in early.value.message
        prefix(env)
        for command, code, words in [
            ("snapshot:raise", INTERNAL, "snapshot failed: RuntimeError"),
            ("snapshot:invalid", INVALID_ARGUMENT, "cannot snapshot now"),
            # NotImplementedError with a reason: this configuration cannot snapshot.
            ("snapshot:unsupported", UNIMPLEMENTED, "not in this configuration, on purpose"),
            ("snapshot:not-bytes", INTERNAL, "returned a str from snapshot(), not bytes"),
        ]:
            env.step(EchoAction(message=command))
            with pytest.raises(EnvError) as failed:
                env.snapshot()
            assert (failed.value.code, words in failed.value.message) == (code, True)
            goes_on(env)  # a failed snapshot never changes the episode
        env.step(EchoAction(message="snapshot:ok"))
        env.step(EchoAction(message="restore:invalid"))
        refused_by_env = env.snapshot()
        error = refusal(env, refused_by_env)
        assert (error.code, "refused, on purpose" in error.message) == (INVALID_ARGUMENT, True)
        goes_on(env)
        env.step(EchoAction(message="restore:raise"))
        breaking = env.snapshot()
        with pytest.raises(EnvError) as broke:
            env.restore(breaking)
        assert broke.value.code is INTERNAL and "restore failed" in broke.value.message
        with pytest.raises(EnvError) as after:
            env.step(EchoAction(message="x"))
        assert after.value.code is FAILED_PRECONDITION  # half-restored: only a reset now
        assert env.reset(seed=1).step_count == 0


def test_an_ended_episode_restores_ended(servers: dict[str, Ledgered]) -> None:
    with EchoEnv(servers["main"].target) as env:
        env.reset(seed=2, options=EchoResetOptions(max_steps=2))
        play(env, ACTIONS[:2])
        data = env.snapshot()
        with EchoEnv(servers["twin"].target) as other:
            restored = other.restore(data)
            assert (restored.truncated, restored.terminated, restored.done) == (True, False, True)
            with pytest.raises(EnvError) as failed:
                other.step(ACTIONS[0])
            assert failed.value.code is FAILED_PRECONDITION


# -- isolated env processes and forked workers share the server's keys ---------------


def test_env_processes_sign_with_the_servers_key_which_env_code_never_sees(
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
        # The random key of a server is its env processes' too: a snapshot made on one
        # worker restores on the other.
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


# -- starting: keys that are wrong stop the server ------------------------------------


def test_info_advertises_support_the_limit_and_the_signing_key(
    servers: dict[str, Ledgered],
) -> None:
    keyed = servers["small"].info().snapshots
    assert (keyed.supported, keyed.max_bytes, keyed.signing_key_id) == (True, 2048, "k1")
    assert not keyed.ephemeral_key
    plain = servers["plain"].info().snapshots
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
