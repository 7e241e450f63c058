"""The training examples against real servers: CartPole PPO learns through the vector
adapter, and the wordle GRPO rollout plays its episodes on the server (and learns a bit).

Both examples are seeded end to end (server-side env seeds, the learner's generator), so
a run's numbers repeat; the bars below sit far under what seed 0 reaches."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.wordle import WordleEnv
from support.examples import EXAMPLES, load_example

StartServer = Callable[..., ServerProcess]  # the start_server fixture of conftest.py


@pytest.mark.timeout(240)
def test_cartpole_reaches_the_readme_promise(start_server: StartServer) -> None:
    """What the README promises: with seed 0, the mean return of 20 episodes reaches 195
    after ~11k env steps (the run is seeded end to end, so it repeats its numbers)."""
    server = start_server("gymnasium")
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_cartpole.py"), "--seed", "0",
         "--stop-at", "195", "--total-steps", "15000", "--target", server.target],
        capture_output=True, text=True, timeout=220,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    curve, summary = lines[:-1], lines[-1]["summary"]
    assert curve and all({"env_steps", "wall_s", "mean_return_20"} <= p.keys() for p in curve)
    assert [p["env_steps"] for p in curve] == sorted(p["env_steps"] for p in curve)
    assert summary["sessions"] == 16 and summary["episodes"] >= 20
    reached = summary["threshold_reached_at"]
    assert reached is not None, (summary, time.monotonic() - started)
    assert summary["final_mean_return_20"] >= 195
    assert reached["env_steps"] <= 12_000, summary  # "~11k" (11,098 with seed 0)
    assert curve[0]["mean_return_20"] < 50  # it started from a random policy (~22)
    server.wait_until(lambda: server.active() == 0, what="the example to close its sessions")


def test_wordle_rollout_shapes_and_server_episodes(start_server: StartServer) -> None:
    server = start_server("wordle")
    example = load_example("wordle_grpo_rollout")
    policy = example.WordPolicy()
    seeds, G = [3, 4, 5], 4
    batch: dict[str, Any] = example.rollout(server.target, policy, seeds, G)

    assert batch["env_reward"].shape == batch["advantages"].shape == (3, G)
    assert batch["logprobs"].shape == batch["won"].shape == (3, G)
    assert len(batch["prompts"]) == len(batch["completions"]) == 3 * G
    # Group-relative: every group's advantages sum to zero.
    assert np.allclose(batch["advantages"].sum(axis=1), 0.0, atol=1e-6)
    for prompt, completion in zip(batch["prompts"], batch["completions"], strict=True):
        assert prompt.startswith("You are playing Wordle.")  # the server's reset prompt
        assert completion.count("[") >= 1
    # The episodes ran on the server's games: replay each one's guesses on a fresh session
    # with the same seed and get the same reward (the target comes from the seed there).
    episodes = batch["episodes"]
    with WordleEnv(server.target) as env:
        for k, episode in enumerate(episodes[::G]):
            result = env.reset(seed=seeds[k])
            total = 0.0
            for text in episode.turns:
                result = env.step(example.WordleAction(guess=text))
                total += result.reward
            assert result.done and total == episode.reward
            assert env.state().game_over
    assert all(0 < len(e.turns) <= 6 for e in episodes)
    assert batch["env_reward"].min() > 0  # the shaped reward pays for letters found
    server.wait_until(lambda: server.active() == 0, what="the rollout to close its sessions")


def test_wordle_grpo_updates_raise_the_reward(start_server: StartServer) -> None:
    server = start_server("wordle")
    example = load_example("wordle_grpo_rollout")
    curve = example.train(server.target, 4, 16, 8, 120.0, 0, out=io.StringIO())
    first, last = curve[0], curve[-1]
    assert first["win_rate"] < 0.05  # a uniformly random guesser almost never wins
    assert last["mean_reward"] >= first["mean_reward"] + 0.25, curve


#: Run where pytest cannot be imported, as in a venv set up as docs/training.md says.
_WITHOUT_PYTEST = """
import runpy, sys
sys.modules["pytest"] = None  # import pytest -> ImportError, as in a training venv
for name in sys.argv[1:]:
    runpy.run_path(name, run_name="example")  # defines everything, trains nothing
import openenv_grpc.testing  # the process helpers too: EnvConformance loads on first use
from openenv_grpc.providers import LocalProcessProvider
with LocalProcessProvider("wordle") as server:  # what an example starts without --target
    print("serving", server.target)
"""


def test_examples_need_nothing_from_test_tooling() -> None:
    """Issue 21: ``python examples/trl_wordle_grpo.py`` in a venv made as the docs say
    failed with ``No module named 'pytest'`` (the examples started their server through
    openenv_grpc.testing, which imported the pytest suite)."""
    examples = sorted(str(path) for path in EXAMPLES.glob("*.py"))
    assert any(path.endswith("trl_wordle_grpo.py") for path in examples)
    for path in examples:
        assert "openenv_grpc.testing" not in Path(path).read_text(), path
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_PYTEST, *examples],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "serving 127.0.0.1:" in done.stdout
