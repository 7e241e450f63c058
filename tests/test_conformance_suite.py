"""The conformance suite can fail: run it on a broken env and see which checks catch it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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
    suite = SUITE.format(tests=str(TESTS), env=env, extra=extra)
    (tmp_path / "test_leaky.py").write_text(suite)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         str(tmp_path / "test_leaky.py")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    failed = {line.split("::")[-1].split(" ")[0] for line in run.stdout.splitlines()
              if line.startswith("FAILED")}  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert failed == caught_by, run.stdout
