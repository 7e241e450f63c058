"""Stable-Baselines3 on one vector stream (``pip install 'openenv-grpc[sb3]'``).

::

    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import VecMonitor
    from openenv_grpc.integrations.sb3 import RemoteVecEnv

    env = VecMonitor(RemoteVecEnv("127.0.0.1:50051", num_envs=8, env_id="CartPole-v1"))
    PPO("MlpPolicy", env, seed=0).learn(100_000)
    env.close()                                   # frees the server's 8 slots

SB3 takes its own ``VecEnv`` type, not Gymnasium's ``VectorEnv``, and its ``DummyVecEnv``
of N remote sessions pays N round trips per step. :class:`RemoteVecEnv` is an SB3
``VecEnv`` over one ``VectorSession`` stream of the server's ``gymnasium`` env
(:class:`~openenv_grpc_envs.gymnasium.adapters.RemoteGymnasiumVectorEnv` underneath):
one round trip per vector step whatever N, the server resets ended envs in the same step
(``SAME_STEP``), and the step answers with SB3's conventions -- ``dones`` =
terminated or truncated, the ended episode's last observation in
``infos[i]["terminal_observation"]`` and ``infos[i]["TimeLimit.truncated"]`` for a
time-limit end. Seeds follow ``DummyVecEnv``'s: ``seed(s)`` (which SB3's ``PPO(seed=s)``
calls) seeds env ``i`` with ``s + i`` at the next reset, so the same seed and actions
give what a ``DummyVecEnv`` of local ``gymnasium.make`` envs gives.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import gymnasium
import numpy as np
from gymnasium.vector import AutoresetMode
from stable_baselines3.common.vec_env.base_vec_env import (
    VecEnv,
    VecEnvIndices,
    VecEnvObs,
    VecEnvStepReturn,
)

from openenv_grpc_envs.gymnasium.adapters import RemoteGymnasiumVectorEnv

__all__ = ["RemoteVecEnv"]

#: Keys of Gymnasium's vector infos that this class turns into SB3's per-env keys.
_FINAL = ("final_obs", "final_info", "_final_obs", "_final_info")


class RemoteVecEnv(VecEnv):
    """``num_envs`` remote envs of a ``gymnasium`` server as one SB3 ``VecEnv``.

    Args:
        target: ``"host:port"`` of a server of the ``gymnasium`` env.
        num_envs: How many envs the stream holds (admitted all or nothing).
        env_id: The registered id, e.g. ``"CartPole-v1"``.
        **options: Passed to ``RemoteGymnasiumVectorEnv`` (``max_episode_steps``,
            ``kwargs``, ``backend``, ``credentials``, ``step_timeout``, ``token``...).

    Raises (from the constructor): ``CapacityError`` when the server has no room for
    ``num_envs`` envs, ``EnvError`` when it refuses the configuration.
    """

    def __init__(self, target: str, num_envs: int, env_id: str = "", **options: Any) -> None:
        options.pop("autoreset_mode", None)  # SB3 wants the reset in the same step
        options.pop("transport", None)
        self.venv = RemoteGymnasiumVectorEnv(
            target,
            num_envs,
            env_id,
            autoreset_mode=AutoresetMode.SAME_STEP,
            transport="vector",
            **options,
        )
        self.render_mode = self.venv.render_mode
        super().__init__(
            num_envs, self.venv.single_observation_space, self.venv.single_action_space
        )
        self._actions: np.ndarray[Any, Any] | None = None

    def reset(self) -> VecEnvObs:
        """Reset every env (seeded once after :meth:`seed`, as ``DummyVecEnv`` does)."""
        seeds = [None if s is None else int(s) for s in self._seeds] if self._seeds else None
        if seeds is not None and all(s is None for s in seeds):
            seeds = None
        observations, infos = self.venv.reset(seed=seeds)
        self._reset_seeds()
        self.reset_infos = _per_env(infos, self.num_envs)
        return np.array(observations)  # SB3 may write into it; the stream's are read-only

    def step_async(self, actions: np.ndarray[Any, Any]) -> None:
        self._actions = actions

    def step_wait(self) -> VecEnvStepReturn:
        if self._actions is None:
            raise RuntimeError("step_wait() without step_async()")
        actions, self._actions = self._actions, None
        observations, rewards, terminated, truncated, infos = self.venv.step(actions)
        dones = np.logical_or(terminated, truncated)
        per_env = _per_env(infos, self.num_envs)
        if dones.any():
            final_obs = infos.get("final_obs")
            final_info = _per_env(infos.get("final_info") or {}, self.num_envs)
            for i in np.flatnonzero(dones):
                per_env[i].update(final_info[i])
                if final_obs is not None:
                    per_env[i]["terminal_observation"] = np.array(final_obs[i])
                per_env[i]["TimeLimit.truncated"] = bool(truncated[i] and not terminated[i])
        return (
            np.array(observations),
            np.asarray(rewards, dtype=np.float32),
            dones,
            per_env,
        )

    def close(self) -> None:
        """Close the stream: the server closes the envs and frees their slots."""
        self.venv.close()

    def render(self, mode: str | None = None) -> np.ndarray[Any, Any] | None:
        frames = self.venv.render()
        if not frames:
            return None
        return np.array(frames[0])

    def get_images(self) -> Sequence[np.ndarray[Any, Any] | None]:
        return list(self.venv.render() or [None] * self.num_envs)

    # -- what SB3 asks of every VecEnv (no env object lives in this process) -------------

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        if attr_name == "render_mode":
            return [self.render_mode for _ in self._indices(indices)]
        value = getattr(self.venv, attr_name)
        return [value for _ in self._indices(indices)]

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        raise AttributeError(f"the remote envs have no settable {attr_name!r} here")

    def env_method(
        self, method_name: str, *method_args: Any, indices: VecEnvIndices = None, **kwargs: Any
    ) -> list[Any]:
        raise AttributeError(f"the remote envs' {method_name!r} cannot be called from here")

    def env_is_wrapped(
        self,
        wrapper_class: type[gymnasium.Wrapper[Any, Any, Any, Any]],
        indices: VecEnvIndices = None,
    ) -> list[bool]:
        return [False for _ in self._indices(indices)]  # wrappers live on the server

    def _indices(self, indices: VecEnvIndices) -> Iterable[int]:
        if indices is None:
            return range(self.num_envs)
        if isinstance(indices, int):
            return [indices]
        return list(indices)


def _per_env(infos: dict[str, Any], num_envs: int) -> list[dict[str, Any]]:
    """Gymnasium's vector infos (arrays plus ``_key`` masks) as one dict per env."""
    out: list[dict[str, Any]] = [{} for _ in range(num_envs)]
    for key, values in infos.items():
        if key.startswith("_") or key in _FINAL:
            continue
        mask = infos.get(f"_{key}")
        for i in range(num_envs):
            if mask is None or mask[i]:
                out[i][key] = values[i] if not isinstance(values, dict) else _row(values, i)
    return out


def _row(infos: dict[str, Any], i: int) -> dict[str, Any]:
    return {k: v[i] for k, v in infos.items() if not k.startswith("_")}
