"""A runnable tour of the gymnasium environment.

``python -m openenv_grpc_envs.gymnasium.example HOST:PORT``

Three envs on one session: CartPole until it falls, FrozenLake along a known path to the
goal (with a refused action on the way), and one Atari Pong frame decoded to numpy.
"""

from __future__ import annotations

import sys

from google.protobuf import struct_pb2

from openenv_grpc import EnvError
from openenv_grpc_envs.gymnasium import (
    GymnasiumAction,
    GymnasiumEnv,
    GymnasiumResetOptions,
    Value,
    convert,
)

#: FrozenLake 4x4 actions: 0 left, 1 down, 2 right, 3 up. This path avoids every hole.
FROZEN_LAKE_PATH = [1, 1, 2, 2, 1, 2]


def main(target: str) -> None:
    with GymnasiumEnv(target) as env:
        # CartPole: the reset result describes the spaces; push right until the pole falls.
        result = env.reset(seed=7, options=GymnasiumResetOptions(env_id="CartPole-v1"))
        description = result.observation.env
        observation_space = convert.build_space(description.observation_space)
        action_space = convert.build_space(description.action_space)
        print(
            f"{description.env_id}: observations {type(observation_space).__name__} "
            f"{observation_space.dtype} {observation_space.shape}, actions {action_space}, "
            f"limit {description.max_episode_steps} steps"
        )
        total = 0.0
        while not result.done:
            result = env.step(GymnasiumAction(value=convert.encode(1, action_space)))
            total += result.reward
        cart = convert.decode(result.observation.value)
        print(
            f"pushed right {result.step_count} times: terminated={result.terminated} "
            f"return={total} pole angle={cart[2]:+.3f}"
        )

        # FrozenLake without slipping: a whole new env, made by this reset.
        kwargs = struct_pb2.Struct()
        kwargs.update({"is_slippery": False})
        env.reset(seed=7, options=GymnasiumResetOptions(env_id="FrozenLake-v1", kwargs=kwargs))
        try:
            env.step(GymnasiumAction(value=Value(discrete=4)))
        except EnvError as exc:
            print(f"refused: {exc.code.name}: {exc.message}")
        for move in FROZEN_LAKE_PATH:
            result = env.step(GymnasiumAction(value=Value(discrete=move)))
        print(
            f"FrozenLake-v1: state {result.observation.value.discrete} after "
            f"{result.step_count} steps, reward={result.reward} terminated={result.terminated}"
        )

        # Atari: one 210x160x3 frame as raw bytes, decoded without a copy.
        result = env.reset(seed=7, options=GymnasiumResetOptions(env_id="ALE/Pong-v5"))
        frame = convert.decode(result.observation.value)
        print(f"ALE/Pong-v5: frame {frame.dtype} {frame.shape}, {frame.nbytes} bytes")
        state = env.state()
        print(
            f"state: env_id={state.env.env_id} episode_steps={state.episode_steps} "
            f"seed={state.seed}"
        )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051")
