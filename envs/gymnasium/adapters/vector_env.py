"""N remote sessions of the ``gymnasium`` env as one ``gymnasium.vector.VectorEnv``.

::

    from openenv_grpc_envs.gymnasium.adapters import RemoteGymnasiumVectorEnv

    with RemoteGymnasiumVectorEnv("127.0.0.1:50051", num_envs=16, env_id="CartPole-v1") as envs:
        obs, infos = envs.reset(seed=0)             # float32 (16, 4)
        obs, rewards, terminated, truncated, infos = envs.step(envs.action_space.sample())

How it runs: an asyncio event loop in one background thread owns a ``grpc.aio`` channel
(or a small pool of them, ``channels=``) and N ``AsyncGymnasiumEnv`` sessions; the
blocking ``reset``/``step`` hand a coroutine to that loop, which sends the N requests at
once and gathers the N answers (one round trip of wall time per vector step, not N).
Observations are decoded and batched in the caller's thread.

Autoreset, as Gymnasium 1.x defines it (``metadata["autoreset_mode"]``):

* ``NEXT_STEP`` (the default, like ``SyncVectorEnv``): the step that ends an episode
  returns its last observation; the next ``step`` of that sub-env ignores the action,
  resets it remotely (unseeded: the remote env's generator continues) and returns the
  first observation with reward 0 and both flags False.
* ``SAME_STEP``: the step that ends an episode resets at once and returns the new first
  observation; the last one is in ``infos["final_obs"]`` and its info in
  ``infos["final_info"]`` (masks ``infos["_final_obs"]``, ``infos["_final_info"]``).
* ``DISABLED``: no autoreset; reset ended sub-envs with
  ``reset(options={"reset_mask": mask})``. Stepping an ended sub-env raises.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import grpc
import numpy as np
import numpy.typing as npt
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from openenv_grpc.client.channel import AioChannelPool
from openenv_grpc.client.outcome import StepOutcome
from openenv_grpc_envs.gymnasium import convert
from openenv_grpc_envs.gymnasium.adapters.gymnasium_env import _options_from_mapping, reset_options
from openenv_grpc_envs.gymnasium.client import AsyncGymnasiumEnv
from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import (
    EnvDescription,
    GymnasiumAction,
    GymnasiumObservation,
    GymnasiumResetOptions,
    Value,
)

__all__ = ["RemoteGymnasiumVectorEnv"]

T = TypeVar("T")
_Result = StepOutcome[GymnasiumObservation]

#: Seconds close() waits for the sessions to close before it stops the loop anyway.
CLOSE_TIMEOUT = 30.0


class _LoopThread:
    """An asyncio event loop running in a daemon thread; ``run`` blocks on a coroutine."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._main, name="openenv-grpc-vector-env", daemon=True
        )
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        return future.result(timeout)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


async def _gather(coroutines: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Every result; if any coroutine raised, the first error once all have finished
    (so no request of this batch is still in flight when the caller sees it)."""
    results = await asyncio.gather(*coroutines, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]


class RemoteGymnasiumVectorEnv(VectorEnv[Any, Any, Any]):
    """``num_envs`` sessions of the catalogue's ``gymnasium`` env, stepped concurrently.

    Args:
        target: ``"host:port"`` of the server.
        num_envs: How many sessions (each holds one remote env and one server slot).
        env_id: The registered id, e.g. ``"CartPole-v1"`` (empty: the server's default).
        max_episode_steps: A TimeLimit override; None keeps the registry's limit.
        kwargs: Keyword arguments for ``gymnasium.make`` on the server.
        autoreset_mode: ``NEXT_STEP`` (default), ``SAME_STEP`` or ``DISABLED``.
        channels: How many ``grpc.aio`` channels the sessions share, round robin (more
            than one spreads them over a multi-worker server's processes).
        credentials: TLS channel credentials (see ``openenv_grpc.client.channel``).
        step_timeout: Seconds each remote reset/step may take (None: no limit).
        session_options: Passed to each ``AsyncGymnasiumEnv`` (``token``, ``retry``,
            ``metadata``).

    The sub-envs run the same configuration; a reset seed ``s`` (an int) seeds sub-env
    ``i`` with ``s + i``, a list gives one seed each, as ``SyncVectorEnv`` does, so the
    two produce the same batches for the same seeds and actions. Close it (or use
    ``with``) to free the server's slots; sessions left open are reclaimed only by the
    server's idle timeout.

    Raises (from the constructor): ``CapacityError`` / ``SessionRefused`` when a session
    cannot be opened (the ones already open are closed), ``EnvError`` when the server
    refuses the configuration, ``ValueError`` for ``num_envs < 1``.
    """

    def __init__(
        self,
        target: str,
        num_envs: int,
        env_id: str = "",
        *,
        max_episode_steps: int | None = None,
        kwargs: Mapping[str, Any] | None = None,
        autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP,
        channels: int = 1,
        credentials: grpc.ChannelCredentials | None = None,
        step_timeout: float | None = None,
        **session_options: Any,
    ) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.num_envs = num_envs
        self.autoreset_mode = (
            autoreset_mode
            if isinstance(autoreset_mode, AutoresetMode)
            else AutoresetMode(autoreset_mode)
        )
        self.metadata = {"autoreset_mode": self.autoreset_mode, "render_modes": []}
        self._options = reset_options(env_id, max_episode_steps, kwargs)
        self._timeout = step_timeout
        self._sessions: list[AsyncGymnasiumEnv] = []
        self._pool: AioChannelPool | None = None
        self._loop = _LoopThread()
        try:
            description = self._loop.run(self._open(target, channels, credentials, session_options))
        except BaseException:
            self._loop.stop()
            raise
        self._set_spaces(description)
        # Sub-envs whose last step ended their episode (NEXT_STEP resets them next step).
        self._autoreset = np.zeros(num_envs, dtype=np.bool_)
        # Each sub-env's latest observation (a partial reset returns the whole batch).
        self._last_observations: list[Any] | None = None

    # -- setup and teardown -------------------------------------------------------------

    async def _open(
        self,
        target: str,
        channels: int,
        credentials: grpc.ChannelCredentials | None,
        session_options: dict[str, Any],
    ) -> EnvDescription:
        """Open every session and make one unseeded reset each, which describes the
        spaces (the Info RPC names message types only)."""
        self._pool = AioChannelPool(target, size=channels, credentials=credentials)
        self._sessions = [
            AsyncGymnasiumEnv(self._pool.next(), **session_options) for _ in range(self.num_envs)
        ]
        try:
            await _gather([session.open() for session in self._sessions])
            firsts = await _gather(
                [
                    session.reset(options=self._options, timeout=self._timeout)
                    for session in self._sessions
                ]
            )
        except BaseException:
            await self._close_all()
            raise
        return firsts[0].observation.env

    def _set_spaces(self, description: EnvDescription) -> None:
        self.description = description
        #: The TimeLimit the server applies (0 = none).
        self.max_episode_steps = int(description.max_episode_steps)
        self.single_observation_space = convert.build_space(description.observation_space)
        self.single_action_space = convert.build_space(description.action_space)
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)

    async def _close_all(self) -> None:
        # abort() a session that was never opened is a no-op; close() of an open one sends
        # the close request, so the server closes its env before the slot is freed.
        await asyncio.gather(*(s.close() for s in self._sessions), return_exceptions=True)
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    def close_extras(self, **kwargs: Any) -> None:
        """Close every remote env and session, the channels and the loop thread."""
        try:
            self._loop.run(self._close_all(), timeout=CLOSE_TIMEOUT)
        finally:
            self._loop.stop()

    def __enter__(self) -> RemoteGymnasiumVectorEnv:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def sessions(self) -> list[AsyncGymnasiumEnv]:
        """The sessions, one per sub-env (their ``session_id`` tags the server's logs)."""
        return list(self._sessions)

    # -- the VectorEnv contract ---------------------------------------------------------

    def reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset the sub-envs (all, or those of ``options["reset_mask"]``) concurrently.

        ``options`` besides ``reset_mask`` may hold ``env_id``, ``max_episode_steps`` and
        ``kwargs`` (see ``RemoteGymnasiumEnv.reset``); they must not change the spaces.

        Returns:
            ``(observations, infos)``: batched observations, Gymnasium-style batched infos.

        Raises:
            ValueError: wrong number of seeds, a bad ``reset_mask``, unknown option keys,
                or options that change the spaces. EnvError / SessionLost: from a session.
        """
        if self.closed:
            raise RuntimeError("the vector env is closed")
        seeds = self._seeds(seed)
        if isinstance(seed, int):
            super().reset(seed=seed)
        options = dict(options or {})
        mask = self._reset_mask(options.pop("reset_mask", None))
        message: GymnasiumResetOptions | None = None
        if options:
            if not mask.all():
                raise ValueError("reset options other than reset_mask need a full reset")
            message = _options_from_mapping(options, self._options)
        indices = [i for i in range(self.num_envs) if mask[i]]
        results = self._loop.run(
            _gather(
                [
                    self._sessions[i].reset(seed=seeds[i], options=message, timeout=self._timeout)
                    for i in indices
                ]
            )
        )
        if message is not None:
            self._check_spaces(results[0].observation.env)
            self._options = message
        self._autoreset[mask] = False
        infos: dict[str, Any] = {}
        observations: list[Any] = []
        for i, result in zip(indices, results, strict=True):
            infos = self._add_info(infos, dict(result.info), i)
        if self._last_observations is None or len(indices) == self.num_envs:
            observations = [self._decode(r) for r in results]
        else:
            # A partial reset returns the whole batch: the others' last observations.
            observations = list(self._last_observations)
            for i, result in zip(indices, results, strict=True):
                observations[i] = self._decode(result)
        self._last_observations = observations
        return self._batch(observations), infos

    def step(
        self, actions: Any
    ) -> tuple[
        Any, npt.NDArray[np.float64], npt.NDArray[np.bool_], npt.NDArray[np.bool_], dict[str, Any]
    ]:
        """Step every sub-env concurrently (resetting ended ones per the autoreset mode).

        Returns:
            ``(observations, rewards, terminations, truncations, infos)``, batched.

        Raises:
            RuntimeError: ``DISABLED`` mode and a sub-env's episode is over (reset it
                with ``reset_mask`` first), or the env is closed.
            EnvError: a remote env refused its action (INVALID_ARGUMENT) or raised.
            ConversionError: an action is not an element of ``single_action_space``.
            SessionLost: a stream ended.
        """
        if self.closed:
            raise RuntimeError("the vector env is closed")
        if self._last_observations is None:
            raise RuntimeError("reset the vector env before stepping it")
        mode = self.autoreset_mode
        if mode is AutoresetMode.DISABLED and self._autoreset.any():
            ended = np.flatnonzero(self._autoreset).tolist()
            raise RuntimeError(
                f"sub-envs {ended} ended their episodes: reset them with "
                "options={'reset_mask': mask} before stepping (autoreset is DISABLED)"
            )
        values = [
            convert.encode(action, self.single_action_space)
            for action in iterate(self.action_space, actions)
        ]
        resetting = self._autoreset if mode is AutoresetMode.NEXT_STEP else None
        outcomes = self._loop.run(
            _gather([self._step_one(i, values[i], resetting) for i in range(self.num_envs)])
        )
        rewards = np.zeros(self.num_envs, dtype=np.float64)
        terminations = np.zeros(self.num_envs, dtype=np.bool_)
        truncations = np.zeros(self.num_envs, dtype=np.bool_)
        observations: list[Any] = []
        infos: dict[str, Any] = {}
        for i, (result, reset) in enumerate(outcomes):
            if reset is None:  # a plain step, or a NEXT_STEP reset (result is the reset's)
                observations.append(self._decode(result))
                rewards[i] = result.reward
                terminations[i] = result.terminated
                truncations[i] = result.truncated
                infos = self._add_info(infos, dict(result.info), i)
            else:  # SAME_STEP: the episode ended on this step and was reset at once
                rewards[i] = result.reward
                terminations[i] = result.terminated
                truncations[i] = result.truncated
                final = {"final_obs": self._decode(result), "final_info": dict(result.info)}
                infos = self._add_info(infos, final, i)
                observations.append(self._decode(reset))
                infos = self._add_info(infos, dict(reset.info), i)
        self._autoreset = np.logical_or(terminations, truncations)
        self._last_observations = observations
        return self._batch(observations), rewards, terminations, truncations, infos

    async def _step_one(
        self, i: int, value: Value, resetting: npt.NDArray[np.bool_] | None
    ) -> tuple[_Result, _Result | None]:
        """Sub-env ``i``'s part of a vector step: ``(result, reset_after)``. Under
        NEXT_STEP an ended sub-env is reset instead of stepped (its action is ignored);
        under SAME_STEP a sub-env whose step ends the episode is reset right away."""
        session = self._sessions[i]
        if resetting is not None and resetting[i]:
            return await session.reset(timeout=self._timeout), None
        result = await session.step(GymnasiumAction(value=value), timeout=self._timeout)
        if self.autoreset_mode is AutoresetMode.SAME_STEP and result.done:
            return result, await session.reset(timeout=self._timeout)
        return result, None

    # -- helpers ------------------------------------------------------------------------

    def _seeds(self, seed: int | Sequence[int | None] | None) -> list[int | None]:
        if seed is None:
            return [None] * self.num_envs
        if isinstance(seed, int):
            return [seed + i for i in range(self.num_envs)]
        seeds = list(seed)
        if len(seeds) != self.num_envs:
            raise ValueError(
                f"a list of seeds must have num_envs={self.num_envs} entries, got {len(seeds)}"
            )
        return seeds

    def _reset_mask(self, mask: Any) -> npt.NDArray[np.bool_]:
        if mask is None:
            return np.ones(self.num_envs, dtype=np.bool_)
        if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_:
            raise ValueError("options['reset_mask'] must be a numpy array of dtype bool")
        if mask.shape != (self.num_envs,):
            raise ValueError(
                f"options['reset_mask'] must have shape ({self.num_envs},), got {mask.shape}"
            )
        if not mask.any():
            raise ValueError("options['reset_mask'] must select at least one sub-env")
        if not mask.all() and self._last_observations is None:
            raise ValueError("the first reset must reset every sub-env")
        return mask

    def _check_spaces(self, description: EnvDescription) -> None:
        if (
            convert.build_space(description.observation_space) != self.single_observation_space
            or convert.build_space(description.action_space) != self.single_action_space
        ):
            raise ValueError(
                "the reset options changed the spaces; a vector env's spaces are fixed "
                "(make a new RemoteGymnasiumVectorEnv for another env)"
            )

    def _decode(self, result: _Result) -> Any:
        return convert.decode(
            result.observation.value, self.single_observation_space, "observation"
        )

    def _batch(self, observations: list[Any]) -> Any:
        """A new batch (never shared with an earlier one) from per-env observations."""
        space = self.single_observation_space
        out = create_empty_array(space, self.num_envs)
        assert out is not None  # None only for spaces convert cannot build
        return concatenate(space, observations, out)

    def __repr__(self) -> str:
        env_id = getattr(getattr(self, "description", None), "env_id", "?")
        return f"RemoteGymnasiumVectorEnv({env_id}, num_envs={self.num_envs})"
