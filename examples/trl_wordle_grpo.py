"""Train a model on the wordle env with TRL's GRPOTrainer, every guess a gRPC call.

    python examples/trl_wordle_grpo.py                         # tiny offline model, local server
    python examples/trl_wordle_grpo.py --target 127.0.0.1:50051 --model Qwen/Qwen2.5-0.5B-Instruct

``environment_factory(target, WordleEnv)`` gives TRL one environment per rollout, each
with its own session on the server and one tool, ``guess(word)``. The dataset is a list
of seeds: a row's ``seed`` picks the hidden word, and TRL's G generations of that row
play the same game, so GRPO compares like with like. The reward is the env's own
(``get_reward``: the sum of the shaped rewards of the episode's guesses).

With a real model name (``--model Qwen/Qwen2.5-0.5B-Instruct``, or any chat model whose
template renders tool calls) the script downloads it from the Hub as TRL always does.
Without one it builds a tiny random Qwen2 (hidden size 32, 2 layers) and a byte-level
BPE tokenizer trained in memory, so it runs offline on a CPU in seconds. Such a model
almost never writes a well-formed tool call by chance, so the tiny run raises the odds
of the tokens of ``guess`` calls for a few words (``sequence_bias``): it then plays
real games on the server, and the test checks what the server saw.

Prints one JSON line per logged step (``reward``, ``tool_calls``, ...) and a summary.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory is "experimental"

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import qwen2_5_chat_template

from openenv_grpc.integrations.trl import EnvironmentFactory, environment_factory
from openenv_grpc_envs.wordle import WordleEnv

#: The words the tiny model is nudged to guess.
TINY_WORDS = ("crane", "slate", "pious", "mound", "light", "brick")
PROMPT = "Let's play Wordle. Call the guess tool with one five-letter word per turn."


def tiny_model_and_tokenizer(seed: int = 0) -> tuple[Any, Any]:
    """A random Qwen2 model and a tokenizer that renders tool calls (TRL's Qwen2.5
    template), made in memory: no download."""
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    corpus = [qwen2_5_chat_template, PROMPT, *TINY_WORDS, *(_call(w) for w in TINY_WORDS)] * 4
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=600,
            special_tokens=special,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.padding_side = "left"
    tokenizer.chat_template = qwen2_5_chat_template
    # Plain added tokens, as in Qwen's own tokenizer: kept when completions are decoded.
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config), tokenizer


def tool_call_bias(tokenizer: Any, words: tuple[str, ...], bias: float = 12.0) -> dict[Any, float]:
    """``sequence_bias`` that makes a random model answer each turn with a ``guess`` call
    for one of ``words``: every prefix of each call, right after the assistant's turn
    starts, gets ``bias``."""
    head = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    sequence_bias: dict[Any, float] = {}
    for word in words:
        call = [*tokenizer.encode(_call(word), add_special_tokens=False), tokenizer.eos_token_id]
        for end in range(1, len(call) + 1):
            sequence_bias[tuple(head + call[:end])] = bias
    return sequence_bias


def _call(word: str) -> str:
    return f'<tool_call>\n{{"name": "guess", "arguments": {{"word": "{word}"}}}}\n</tool_call>'


def train(
    factory: EnvironmentFactory,
    model: Any,
    tokenizer: Any,
    *,
    seeds: list[int],
    generations: int = 4,
    max_steps: int = 3,
    max_completion_length: int = 256,
    generation_kwargs: dict[str, Any] | None = None,
    output_dir: str | None = None,
) -> list[dict[str, Any]]:
    """Run GRPO with ``factory``'s environments; returns the trainer's log history. When
    it returns the trainer is gone, and with it TRL's pool of environments: each one's
    finalizer has closed its session."""
    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": PROMPT}]] * len(seeds), "seed": seeds}
    )
    args = GRPOConfig(
        output_dir=output_dir or tempfile.mkdtemp(prefix="trl-wordle-"),
        per_device_train_batch_size=generations,  # one game (G rollouts) per step
        num_generations=generations,
        max_completion_length=max_completion_length,
        max_steps=max_steps,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        generation_kwargs=generation_kwargs,
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        args=args,
        train_dataset=dataset,
        environment_factory=factory,  # the reward: each environment's get_reward()
    )
    trainer.train()
    history = list(trainer.state.log_history)
    del trainer
    gc.collect()  # the trainer holds reference cycles
    return history


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", help="a wordle server (default: start one here)")
    parser.add_argument("--model", help="a Hub model, e.g. Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    server = None
    if args.target is None:
        from openenv_grpc.providers import LocalProcessProvider  # our own server

        server = LocalProcessProvider("wordle")
        server.start()
    target = args.target or server.target  # type: ignore[union-attr]
    try:
        if args.model:
            model = AutoModelForCausalLM.from_pretrained(args.model)
            tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
            generation_kwargs = None
        else:
            model, tokenizer = tiny_model_and_tokenizer(args.seed)
            generation_kwargs = {"sequence_bias": tool_call_bias(tokenizer, TINY_WORDS)}
        seeds = [args.seed + i for i in range(args.max_steps)]
        with environment_factory(target, WordleEnv) as factory:
            history = train(
                factory,
                model,
                tokenizer,
                seeds=seeds,
                generations=args.generations,
                max_steps=args.max_steps,
                generation_kwargs=generation_kwargs,
            )
    finally:
        if server is not None:
            server.stop()
    for entry in history:
        print(json.dumps(entry))
    return 0


if __name__ == "__main__":
    sys.exit(main())
