"""The conformance suite can fail: run it on a broken env and see which checks catch it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from openenv_grpc.server.model.spec import EnvSpec
from support import envs

TESTS = Path(__file__).resolve().parent

SUITE = textwrap.dedent(
    """
    from openenv_grpc.testing import EnvConformance
    from openenv_grpc_envs.echo import EchoAction, EchoResetOptions

    class TestBroken(EnvConformance):
        env = "support.envs:{env}"
        server_pythonpath = [{tests!r}]
        concurrent_sessions = 3

        def make_action(self, observation, step, rng):
            return EchoAction(message=f"m{{step}}")

        def ending_reset_options(self):
            return EchoResetOptions(max_steps=2)

        {extra}
    """
)

#: A suite that says its env is not deterministic, and names the part that must repeat.
NOT_DETERMINISTIC = (
    "deterministic = False\n    def comparable(self, observation):\n        return observation"
)


#: The checks that replay an episode from a snapshot.
SNAPSHOT_REPLAYS = {
    "test_restore_then_the_same_actions_repeat_the_trajectory",
    "test_forks_repeat_the_trajectory",
    "test_a_snapshot_restores_on_a_fresh_server_process",
    "test_a_tampered_snapshot_is_refused_and_the_episode_goes_on",
}


def run_suite(tmp_path: Path, env: str, extra: str = "") -> set[str]:
    """Run the suite on ``support.envs:<env>``; the names of the checks that failed."""
    suite = SUITE.format(tests=str(TESTS), env=env, extra=extra)
    (tmp_path / "test_suite.py").write_text(suite)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         str(tmp_path / "test_suite.py")],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )  # fmt: skip
    failed = {line.split("::")[-1].split(" ")[0] for line in run.stdout.splitlines()
              if line.startswith("FAILED")}  # fmt: skip
    assert run.returncode == (1 if failed else 0), run.stdout + run.stderr
    return failed


@pytest.mark.fresh_server  # a pytest run of the suite, with its servers: make test
@pytest.mark.parametrize(
    ("env", "caught_by"),
    [
        # Leaked state shows when sessions interleave (reset clears it in a serial replay).
        ("LeakyEchoEnv", {"test_concurrent_sessions_do_not_share_state"}),
        # An env that ignores its seed fails both checks that replay a seeded episode.
        (
            "UnseededEchoEnv",
            {"test_seeded_episodes_repeat", "test_concurrent_sessions_do_not_share_state"},
        ),
    ],
)
@pytest.mark.parametrize("extra", ["", NOT_DETERMINISTIC], ids=["deterministic", "comparable"])
def test_a_broken_env_fails_the_suite(
    tmp_path: Path, env: str, caught_by: set[str], extra: str
) -> None:
    """Also with ``deterministic = False``: the checks then compare what ``comparable``
    keeps, so a leak or an ignored seed is still caught (no check shrinks to one that
    cannot fail)."""
    failed = run_suite(tmp_path, env, extra)
    if EnvSpec.from_factory(getattr(envs, env)).snapshots:
        # An echo env with snapshots: its broken state may show in the replays too.
        assert caught_by <= failed <= caught_by | SNAPSHOT_REPLAYS
    else:
        assert failed == caught_by


@pytest.mark.fresh_server  # a pytest run of the suite, with its servers: make test
def test_an_env_with_snapshots_passes_the_whole_suite(tmp_path: Path) -> None:
    assert run_suite(tmp_path, "SnapshotEchoEnv", "snapshots = True") == set()


@pytest.mark.fresh_server  # a pytest run of the suite, with its servers: make test
@pytest.mark.parametrize(
    ("env", "caught_by"),
    [
        # A snapshot without the random stream: every replay draws other rewards.
        ("ForgetfulSnapshotEnv", SNAPSHOT_REPLAYS),
        # A snapshot kept in server memory: only a fresh server process shows it.
        ("ProcessLocalSnapshotEnv", {"test_a_snapshot_restores_on_a_fresh_server_process"}),
        # Claims snapshots it does not have: every snapshot check says so.
        ("DeterministicEchoEnv",
         {*SNAPSHOT_REPLAYS, "test_snapshots_are_supported_or_unimplemented"}),
    ],
)  # fmt: skip
def test_a_broken_snapshot_fails_the_checks_that_replay_it(
    tmp_path: Path, env: str, caught_by: set[str]
) -> None:
    assert run_suite(tmp_path, env, "snapshots = True") == caught_by
