"""A runnable tour of the echo environment: ``python -m openenv_grpc_envs.echo.example HOST:PORT``.

Plays one truncated episode and one terminated episode on the same session.
"""

from __future__ import annotations

import sys

from openenv_grpc_envs.echo import EchoAction, EchoEnv, EchoResetOptions


def main(target: str) -> None:
    with EchoEnv(target) as env:
        # Episode 1: truncated by the step limit.
        result = env.reset(seed=42, options=EchoResetOptions(max_steps=2, greeting="hi"))
        print(f"reset -> {result.observation.echoed_message!r}, episode {result.episode_id}")
        while not result.done:
            result = env.step(EchoAction(message="ping"))
            print(
                f"step {result.step_count}: {result.observation.echoed_message!r} "
                f"reward={result.reward:.1f} truncated={result.truncated}"
            )
        # Episode 2, same session: terminated by the stop word.
        env.reset(options=EchoResetOptions(stop_word="bye"))
        result = env.step(EchoAction(message="bye"))
        print(f"step {result.step_count}: terminated={result.terminated}")
        print(f"state: total_length={env.state().total_length}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051")
