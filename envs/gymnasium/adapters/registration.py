"""Gymnasium ids for remote envs, so ``gymnasium.make`` / ``gymnasium.make_vec`` build the
adapters and every adapter carries a re-makeable ``spec`` (Gymnasium's checker makes new
envs from it to test each render mode)::

    import gymnasium
    import openenv_grpc_envs.gymnasium.adapters  # registers the ids (once per process)

    env = gymnasium.make("openenv-grpc/CartPole-v1", target="127.0.0.1:50051")
    envs = gymnasium.make_vec("openenv-grpc/CartPole-v1", num_envs=64, target="127.0.0.1:50051")
    env = gymnasium.make("openenv-grpc/Remote-v0", target="...", env_id="ALE/Pong-v5")

Without the import, Gymnasium's ``module:id`` form imports it:
``gymnasium.make("openenv_grpc_envs.gymnasium.adapters:openenv-grpc/CartPole-v1", ...)``.

Which ids: ``openenv-grpc/Remote-v0`` takes any server-side id as ``env_id=``; beside it,
every id of the local Gymnasium registry without a namespace (classic control, toy text,
Box2D, MuJoCo ...) is mirrored as ``openenv-grpc/<id>`` with that ``env_id``. (A registry
id has at most one namespace, so ``ALE/Pong-v5`` goes through ``Remote-v0``.) The specs
set no ``max_episode_steps``: the server applies the env's TimeLimit, and a second one on
the client would only cost time.
"""

from __future__ import annotations

import threading
from typing import Any

import gymnasium
from gymnasium.envs.registration import EnvSpec

__all__ = ["GENERIC_ID", "NAMESPACE", "register_envs", "remote_id", "spec_for"]

#: The namespace of the ids registered here.
NAMESPACE = "openenv-grpc"
#: The id that takes the server-side env id as ``env_id=``.
GENERIC_ID = f"{NAMESPACE}/Remote-v0"
ENTRY_POINT = "openenv_grpc_envs.gymnasium.adapters.gymnasium_env:RemoteGymnasiumEnv"
VECTOR_ENTRY_POINT = "openenv_grpc_envs.gymnasium.adapters.vector_env:RemoteGymnasiumVectorEnv"

_lock = threading.Lock()


def remote_id(env_id: str) -> str:
    """The registered id of the remote twin of ``env_id`` (``Remote-v0`` for ids that
    are namespaced or not in the local registry)."""
    mirrored = f"{NAMESPACE}/{env_id}"
    return mirrored if "/" not in env_id and mirrored in gymnasium.registry else GENERIC_ID


def register_envs() -> None:
    """Register :data:`GENERIC_ID` and the mirrored ids; idempotent, thread-safe."""
    with _lock:
        if GENERIC_ID not in gymnasium.registry:
            gymnasium.register(
                GENERIC_ID,
                entry_point=ENTRY_POINT,
                vector_entry_point=VECTOR_ENTRY_POINT,
                disable_env_checker=False,
            )
        for env_id, local in list(gymnasium.registry.items()):
            mirrored = f"{NAMESPACE}/{env_id}"
            if local.namespace is not None or mirrored in gymnasium.registry:
                continue
            gymnasium.register(
                mirrored,
                entry_point=ENTRY_POINT,
                vector_entry_point=VECTOR_ENTRY_POINT,
                reward_threshold=local.reward_threshold,
                nondeterministic=local.nondeterministic,
                kwargs={"env_id": env_id},
            )


def spec_for(env_id: str, kwargs: dict[str, Any]) -> EnvSpec:
    """The spec an adapter made directly (not by ``gymnasium.make``) carries: its remote
    id and the keyword arguments that make the same adapter again."""
    register_envs()
    spec = gymnasium.spec(remote_id(env_id))
    made = EnvSpec(
        id=spec.id,
        entry_point=spec.entry_point,
        vector_entry_point=spec.vector_entry_point,
        reward_threshold=spec.reward_threshold,
        nondeterministic=spec.nondeterministic,
        kwargs={**spec.kwargs, **kwargs},
    )
    return made
