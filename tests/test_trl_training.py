"""A real TRL GRPOTrainer run over gRPC: the tiny offline model of
``examples/trl_wordle_grpo.py`` plays wordle on a real server for 3 optimizer steps.

It proves the whole path: TRL's tool-calling loop calls ``guess`` (each call a step on
the server), the env's rewards reach the trainer's loss, and once the trainer is gone
no session is left open on the server."""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from openenv_grpc.integrations.trl import environment_factory
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.wordle import WordleEnv

StartServer = Callable[..., ServerProcess]
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "trl_wordle_grpo.py"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("trl_wordle_grpo", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["trl_wordle_grpo"] = module
    spec.loader.exec_module(module)
    return module


def test_grpo_trainer_trains_on_the_wordle_server(
    start_server: StartServer, tmp_path: Path
) -> None:
    example = load_example()
    server = start_server("wordle")
    model, tokenizer = example.tiny_model_and_tokenizer(seed=0)
    bias = example.tool_call_bias(tokenizer, example.TINY_WORDS)
    factory = environment_factory(server.target, WordleEnv)
    try:
        history = example.train(
            factory,
            model,
            tokenizer,
            seeds=[0, 1, 2],
            generations=4,
            max_steps=3,
            generation_kwargs={"sequence_bias": bias},
            output_dir=str(tmp_path),
        )
        # The trainer is gone (train() dropped it): every session its pool held is closed,
        # while this process and the factory live on.
        server.wait_until(lambda: server.active() == 0, what="the trainer's sessions to close")
        assert factory.open_instances == 0
    finally:
        factory.close()

    steps = [entry for entry in history if "loss" in entry]
    assert [entry["step"] for entry in steps] == [1, 2, 3]  # 3 optimizer steps
    # The model called the tool, and each call was a guess the server played.
    assert all(entry["tools/call_frequency"] >= 1 for entry in steps)
    activity = server.info().activity
    assert activity.sessions_opened >= 4  # one session per rollout of a group (G = 4)
    assert activity.steps >= 3 * 4  # at least one guess per rollout, 3 steps of 4 rollouts
    # The env's rewards reached the trainer: the Wordle reward column (get_reward) is
    # positive (every played guess of these words earns letters), and differs within a
    # group at least once, so GRPO had a signal and the loss moved.
    rewards = [entry["rewards/Wordle/mean"] for entry in steps]
    assert all(reward > 0 for reward in rewards), rewards
    assert any(entry["rewards/Wordle/std"] > 0 for entry in steps)
    assert any(entry["loss"] != 0 and math.isfinite(entry["loss"]) for entry in steps)
