"""The N-sessions transport of :class:`RemoteGymnasiumVectorEnv`: one ``Session`` stream
per env, over one ``grpc.aio`` channel or a small pool of them, stepped concurrently from
an event loop in a background thread; autoreset is done here, on the client.

Each vector step is N messages each way (one round trip of wall time, not N), and the
envs are N independent sessions: a multi-worker server (``--workers``) or Envoy spreads
them over processes or pods, and any server that predates vector streams serves them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from openenv_grpc.client.channel import AioChannelPool
from openenv_grpc.client.outcome import StepOutcome
from openenv_grpc_envs.gymnasium import convert
from openenv_grpc_envs.gymnasium.adapters.transport import Batch, LoopThread, gather
from openenv_grpc_envs.gymnasium.client import AsyncGymnasiumEnv
from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import (
    EnvDescription,
    GymnasiumAction,
    GymnasiumObservation,
    GymnasiumResetOptions,
    Value,
)

__all__ = ["SessionStreams"]

_Result = StepOutcome[GymnasiumObservation]


class SessionStreams:
    """``num_envs`` sessions; see :class:`.transport.Transport`.

    Raises (from the constructor): CapacityError / SessionRefused when a session cannot
    be opened (those already open are closed), EnvError when the server refuses the
    configuration.
    """

    def __init__(
        self,
        loop: LoopThread,
        target: str,
        num_envs: int,
        options: GymnasiumResetOptions,
        autoreset_mode: AutoresetMode,
        *,
        channels: int,
        credentials: grpc.ChannelCredentials | None,
        timeout: float | None,
        session_options: dict[str, Any],
    ) -> None:
        self._loop = loop
        self._num_envs = num_envs
        self._mode = autoreset_mode
        self._timeout = timeout
        self._sessions: list[AsyncGymnasiumEnv] = []
        self._pool: AioChannelPool | None = None
        self.description = loop.run(
            self._open(target, channels, credentials, options, session_options)
        )
        self._set_spaces()
        # Sub-envs whose last step ended their episode (NEXT_STEP resets them next step).
        self._autoreset = np.zeros(num_envs, dtype=np.bool_)

    @property
    def sessions(self) -> list[AsyncGymnasiumEnv]:
        """The sessions, one per sub-env."""
        return list(self._sessions)

    async def _open(
        self,
        target: str,
        channels: int,
        credentials: grpc.ChannelCredentials | None,
        options: GymnasiumResetOptions,
        session_options: dict[str, Any],
    ) -> EnvDescription:
        """Open every session and make one unseeded reset each, which describes the
        spaces (the Info RPC names message types only)."""
        self._pool = AioChannelPool(target, size=channels, credentials=credentials)
        self._sessions = [
            AsyncGymnasiumEnv(self._pool.next(), **session_options) for _ in range(self._num_envs)
        ]
        try:
            await gather([session.open() for session in self._sessions])
            firsts = await gather(
                [s.reset(options=options, timeout=self._timeout) for s in self._sessions]
            )
        except BaseException:
            await self._close_all()
            raise
        return firsts[0].observation.env

    def _set_spaces(self) -> None:
        self._observation_space = convert.build_space(self.description.observation_space)
        self._action_space = convert.build_space(self.description.action_space)
        self._batched_actions = batch_space(self._action_space, self._num_envs)

    def reset(
        self,
        indices: Sequence[int],
        seeds: Sequence[int | None],
        options: GymnasiumResetOptions | None,
    ) -> Batch:
        results = self._loop.run(
            gather(
                [
                    self._sessions[i].reset(seed=seed, options=options, timeout=self._timeout)
                    for i, seed in zip(indices, seeds, strict=True)
                ]
            )
        )
        if options is not None:
            self.description = results[0].observation.env
            self._set_spaces()
        self._autoreset[list(indices)] = False
        count = len(indices)
        return Batch(
            self._batch([self._decode(r) for r in results]),
            np.zeros(count, dtype=np.float64),
            np.zeros(count, dtype=np.bool_),
            np.zeros(count, dtype=np.bool_),
            [(i, dict(r.info)) for i, r in zip(indices, results, strict=True)],
        )

    def step(self, actions: Any) -> Batch:
        values = [
            convert.encode(action, self._action_space)
            for action in iterate(self._batched_actions, actions)
        ]
        outcomes = self._loop.run(
            gather([self._step_one(i, values[i]) for i in range(self._num_envs)])
        )
        n = self._num_envs
        batch = Batch(
            None,
            np.zeros(n, dtype=np.float64),
            np.zeros(n, dtype=np.bool_),
            np.zeros(n, dtype=np.bool_),
        )
        observations: list[Any] = []
        for i, (result, reset) in enumerate(outcomes):
            batch.rewards[i] = result.reward
            batch.terminated[i] = result.terminated
            batch.truncated[i] = result.truncated
            if reset is None:  # a plain step, or a NEXT_STEP reset (result is the reset's)
                observations.append(self._decode(result))
                batch.infos.append((i, dict(result.info)))
            else:  # SAME_STEP: the episode ended on this step and was reset at once
                final = {"final_obs": self._decode(result), "final_info": dict(result.info)}
                batch.infos.append((i, final))
                observations.append(self._decode(reset))
                batch.infos.append((i, dict(reset.info)))
        self._autoreset = np.logical_or(batch.terminated, batch.truncated)
        batch.observations = self._batch(observations)
        return batch

    async def _step_one(self, i: int, value: Value) -> tuple[_Result, _Result | None]:
        """Sub-env ``i``'s part of a vector step: ``(result, reset_after)``. Under
        NEXT_STEP an ended sub-env is reset instead of stepped (its action is ignored);
        under SAME_STEP a sub-env whose step ends the episode is reset right away."""
        session = self._sessions[i]
        if self._mode is AutoresetMode.NEXT_STEP and self._autoreset[i]:
            return await session.reset(timeout=self._timeout), None
        result = await session.step(GymnasiumAction(value=value), timeout=self._timeout)
        if self._mode is AutoresetMode.SAME_STEP and result.done:
            return result, await session.reset(timeout=self._timeout)
        return result, None

    def frames(self) -> tuple[Any, ...]:
        states = self._loop.run(gather([s.state(timeout=self._timeout) for s in self._sessions]))
        return tuple(
            convert.to_numpy(s.frame, writable=True, what="frame") if s.frame.dtype else None
            for s in states
        )

    def close(self) -> None:
        self._loop.run(self._close_all())

    async def _close_all(self) -> None:
        # abort() a session that was never opened is a no-op; close() of an open one sends
        # the close request, so the server closes its env before the slot is freed.
        await asyncio.gather(*(s.close() for s in self._sessions), return_exceptions=True)
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    def _decode(self, result: _Result) -> Any:
        return convert.decode(result.observation.value, self._observation_space, "observation")

    def _batch(self, observations: list[Any]) -> Any:
        """A new batch (never shared with an earlier one) from per-env observations."""
        space = self._observation_space
        out = create_empty_array(space, len(observations))
        assert out is not None  # None only for spaces convert cannot build
        return concatenate(space, observations, out)
