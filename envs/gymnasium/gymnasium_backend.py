"""N ``gymnasium.make`` envs stepped in a loop, exactly as ``gymnasium.vector.SyncVectorEnv``
steps them (the same calls in the same order, autoreset included), by index."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, SupportsFloat

import gymnasium

from openenv_grpc import AutoresetMode
from openenv_grpc_envs.gymnasium.backends import Rows
from openenv_grpc_envs.gymnasium.batch_convert import rows_of
from openenv_grpc_envs.gymnasium.configuration import Config, jsonable, make_env

__all__ = ["GymnasiumEnvs"]

_Info = Mapping[str, Any] | None


def _info(info: Mapping[str, Any]) -> _Info:
    """A row's info for the wire: None when empty (classic control), so it costs nothing."""
    return jsonable(info) if info else None


class GymnasiumEnvs:
    """``size`` envs of one configuration; see :class:`.backends.BatchBackend`.

    Raises (from the constructor): InvalidAction when the configuration cannot be made
    (every env made so far is closed again).
    """

    def __init__(self, config: Config, size: int, autoreset: AutoresetMode) -> None:
        self._same_step = autoreset is AutoresetMode.SAME_STEP
        self._envs: list[gymnasium.Env[Any, Any]] = []
        try:
            first, self.description = make_env(config)
            self._envs.append(first)
            for _ in range(size - 1):
                self._envs.append(make_env(config)[0])
        except BaseException:
            self.close()
            raise
        self.observation_space = first.observation_space
        self.action_space = first.action_space
        self._last: list[Any] = [None] * size

    def reset(self, indices: Sequence[int], seeds: Sequence[int | None]) -> Rows:
        rows = Rows(list(indices), [], False, [], [], [])
        infos: list[_Info] = []
        for i, seed in zip(indices, seeds, strict=True):
            try:
                observation, info = self._envs[i].reset(seed=seed)
            except Exception as exc:  # per env: its neighbours still answer
                rows.errors[i] = exc
                continue
            self._last[i] = observation
            rows.observations.append(observation)
            rows.rewards.append(0.0)
            rows.terminated.append(False)
            rows.truncated.append(False)
            infos.append(_info(info))
        return self._finish(rows, infos)

    def step(self, indices: Sequence[int], actions: Any, resetting: Sequence[bool]) -> Rows:
        actions_rows = rows_of(actions, self.action_space, len(indices))
        rows = Rows(list(indices), [], False, [], [], [])
        infos: list[_Info] = []
        reset: list[bool] = []
        finals: list[Any] = []
        final_infos: list[_Info] = []
        envs, last, same_step = self._envs, self._last, self._same_step
        observations, rewards = rows.observations, rows.rewards
        terminated, truncated = rows.terminated, rows.truncated
        for i, action, resets in zip(indices, actions_rows, resetting, strict=True):
            env = envs[i]
            reward: SupportsFloat
            try:
                if resets:  # NEXT_STEP: the episode ended last step; the action is ignored
                    observation, info = env.reset()
                    reward, term, trunc, was_reset = 0.0, False, False, True
                else:
                    observation, reward, term, trunc, info = env.step(action)
                    was_reset = False
                    if same_step and (term or trunc):
                        finals.append(observation)
                        final_infos.append(_info(info))
                        observation, info = env.reset()
                        was_reset = True
            except Exception as exc:
                rows.errors[i] = exc
                continue
            last[i] = observation
            observations.append(observation)
            rewards.append(float(reward))
            terminated.append(bool(term))
            truncated.append(bool(trunc))
            infos.append(jsonable(info) if info else None)  # as _info(), without the call
            reset.append(was_reset)
        if any(reset):
            rows.reset = reset
        if finals:
            rows.final_observations, rows.final_infos = finals, final_infos
        return self._finish(rows, infos)

    def _finish(self, rows: Rows, infos: list[_Info]) -> Rows:
        if rows.errors:
            rows.indices = [i for i in rows.indices if i not in rows.errors]
        if infos.count(None) != len(infos):  # some row has an info
            rows.infos = infos
        return rows

    def last_observation(self, index: int) -> Any:
        return self._last[index]

    def env(self, index: int) -> gymnasium.Env[Any, Any]:
        """Env ``index`` itself: snapshots capture it and put it back."""
        return self._envs[index]

    def restored(self, index: int, last_observation: Any) -> None:
        """Env ``index`` was put back from a snapshot whose last observation this is."""
        self._last[index] = last_observation

    def render(self, index: int) -> Any:
        env = self._envs[index]
        return env.render() if env.render_mode == "rgb_array" else None

    def close(self) -> None:
        envs, self._envs = self._envs, []
        for env in envs:
            env.close()
