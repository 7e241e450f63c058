"""N remote envs of the ``gymnasium`` env as one ``gymnasium.vector.VectorEnv``.

::

    from openenv_grpc_envs.gymnasium.adapters import RemoteGymnasiumVectorEnv

    with RemoteGymnasiumVectorEnv("127.0.0.1:50051", num_envs=64, env_id="CartPole-v1") as envs:
        obs, infos = envs.reset(seed=0)             # float32 (64, 4)
        obs, rewards, terminated, truncated, infos = envs.step(envs.action_space.sample())

Two transports, the same results (both equal ``SyncVectorEnv`` step for step):

* ``transport="vector"`` (the default): **one** ``VectorSession`` stream holds the N envs
  (N slots admitted all or nothing). A vector step is one message each way: the actions
  as one tensor, the observations as one tensor (numpy gets a read-only view of the
  received bytes: the one copy is protobuf's), autoreset done by the server. The server
  answers the batch natively: N gymnasium envs in one loop, or one EnvPool pool
  (``backend="envpool"``). Best whenever the N envs fit one server process (with
  ``--isolated K`` it spreads them over K env processes itself): per-message cost is
  paid once per vector step, not N times.
* ``transport="sessions"``: N ``Session`` streams over ``channels`` channels, stepped
  concurrently, autoreset on the client. Better when the envs should spread over
  several server processes or pods (``--workers``, Envoy, a swarm: they balance streams,
  and one stream lands on one process), when one env's failure must not touch the others'
  streams, or against a server that predates vector streams.

Autoreset, as Gymnasium 1.x defines it (``metadata["autoreset_mode"]``):

* ``NEXT_STEP`` (the default, like ``SyncVectorEnv``): the step that ends an episode
  returns its last observation; the next ``step`` of that sub-env ignores the action,
  resets it (unseeded: its generator continues) and returns the first observation with
  reward 0 and both flags False.
* ``SAME_STEP``: the step that ends an episode resets at once and returns the new first
  observation; the last one is in ``infos["final_obs"]`` and its info in
  ``infos["final_info"]`` (masks ``infos["_final_obs"]``, ``infos["_final_info"]``).
* ``DISABLED``: no autoreset; reset ended sub-envs with
  ``reset(options={"reset_mask": mask})``. Stepping an ended sub-env raises.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import grpc
import numpy as np
import numpy.typing as npt
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from openenv_grpc_envs.gymnasium import convert
from openenv_grpc_envs.gymnasium.adapters.gymnasium_env import (
    RENDER_MODES,
    _options_from_mapping,
    reset_options,
)
from openenv_grpc_envs.gymnasium.adapters.registration import spec_for
from openenv_grpc_envs.gymnasium.adapters.session_streams import SessionStreams
from openenv_grpc_envs.gymnasium.adapters.transport import BACKENDS, Batch, LoopThread, Transport
from openenv_grpc_envs.gymnasium.adapters.vector_stream import VectorStream
from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import (
    EnvDescription,
    GymnasiumResetOptions,
)

__all__ = ["TRANSPORTS", "RemoteGymnasiumVectorEnv"]

#: Seconds close() waits for the remote envs to close before it stops the loop anyway.
CLOSE_TIMEOUT = 30.0
#: The ways to reach the envs (see the module docstring).
TRANSPORTS = ("vector", "sessions")


class RemoteGymnasiumVectorEnv(VectorEnv[Any, Any, Any]):
    """``num_envs`` remote envs of the catalogue's ``gymnasium`` env.

    Args:
        target: ``"host:port"`` of the server.
        num_envs: How many envs (each holds one server slot).
        env_id: The registered id, e.g. ``"CartPole-v1"`` (empty: the server's default).
        max_episode_steps: A TimeLimit override; None keeps the registry's limit.
        kwargs: Keyword arguments for ``gymnasium.make`` on the server.
        autoreset_mode: ``NEXT_STEP`` (default), ``SAME_STEP`` or ``DISABLED``.
        transport: ``"vector"`` (one vector stream, the default) or ``"sessions"`` (N
            streams); see the module docstring for when each is better.
        backend: With the vector transport, what steps the envs on the server:
            ``"gymnasium"``, ``"envpool"`` (EnvPool's semantics, see the env README),
            ``"auto"`` or None (the server's ``GYM_VECTOR_BACKEND``).
        render_mode: None, or ``"rgb_array"``: :meth:`render` returns every env's frame.
        channels: The sessions transport's number of ``grpc.aio`` channels (round robin;
            more than one spreads sessions over a multi-worker server's processes).
            With one vector stream there is one channel.
        credentials: TLS channel credentials (see ``openenv_grpc.client.channel``).
        step_timeout: Seconds each remote reset/step may take (None: no limit).
        batch_size: EnvPool's asynchronous mode when below ``num_envs`` (vector
            transport only): :meth:`async_reset`, :meth:`send` and :meth:`recv` keep
            ``num_envs / batch_size`` batches in flight on the one stream, so the server
            steps one batch while the caller computes the actions of another. Default
            ``num_envs`` (only the synchronous ``reset`` / ``step``).
        session_options: Passed to each session (``token``, ``retry``, ``metadata``).

    A reset seed ``s`` (an int) seeds sub-env ``i`` with ``s + i``, a list gives one seed
    each, as ``SyncVectorEnv`` does, so the two produce the same batches for the same
    seeds and actions. Observations are read-only arrays (vector transport: views of the
    received bytes; copy them to write into them), never shared between calls. Close it
    (or use ``with``) to free the server's slots; envs left open are reclaimed only by the
    server's idle timeout.

    Raises (from the constructor): ``CapacityError`` / ``SessionRefused`` when the envs
    cannot be admitted (nothing stays open), ``EnvError`` when the server refuses the
    configuration, ``ValueError`` for ``num_envs < 1``, an unknown transport, backend
    or render mode, or an option of the other transport.
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
        transport: Literal["vector", "sessions"] = "vector",
        backend: str | None = None,
        render_mode: str | None = None,
        channels: int = 1,
        credentials: grpc.ChannelCredentials | None = None,
        step_timeout: float | None = None,
        batch_size: int | None = None,
        **session_options: Any,
    ) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        batch_size = num_envs if batch_size is None else batch_size
        if isinstance(batch_size, bool) or not isinstance(batch_size, int):
            raise ValueError(f"batch_size must be an int, got {batch_size!r}")
        if not 1 <= batch_size <= num_envs:
            raise ValueError(f"batch_size must be 1 to num_envs={num_envs}, got {batch_size}")
        if batch_size < num_envs and transport != "vector":
            raise ValueError(
                "batch_size < num_envs (EnvPool's async mode) needs transport='vector'"
            )
        #: The envs each :meth:`recv` returns (EnvPool's ``batch_size``).
        self.batch_size = batch_size
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if backend is not None and (backend not in BACKENDS or transport != "vector"):
            raise ValueError(
                f"backend must be one of {sorted(BACKENDS)} and needs transport='vector', "
                f"got {backend!r} with {transport!r}"
            )
        if render_mode is not None and render_mode not in RENDER_MODES:
            raise ValueError(f"render_mode {render_mode!r} is not one of {RENDER_MODES}")
        if channels != 1 and transport != "sessions":
            raise ValueError("channels= spreads sessions: it needs transport='sessions'")
        self.num_envs = num_envs
        self.render_mode = render_mode
        self.transport = transport
        self.autoreset_mode = (
            autoreset_mode
            if isinstance(autoreset_mode, AutoresetMode)
            else AutoresetMode(autoreset_mode)
        )
        self.metadata = {"autoreset_mode": self.autoreset_mode, "render_modes": RENDER_MODES}
        self._options = reset_options(env_id, max_episode_steps, kwargs, render_mode)
        remake: dict[str, Any] = {
            "env_id": env_id,
            "target": target,
            "transport": transport,
            "num_envs": num_envs,
            "vectorization_mode": "vector_entry_point",
        }
        if max_episode_steps is not None:
            remake["max_episode_steps"] = max_episode_steps
        if kwargs:
            remake["kwargs"] = dict(kwargs)
        if backend is not None:
            remake["backend"] = backend
        if self.autoreset_mode is not AutoresetMode.NEXT_STEP:
            remake["autoreset_mode"] = self.autoreset_mode.value
        self.spec = spec_for(env_id, remake)
        # Only N sessions need an event loop of their own; the vector stream blocks.
        self._loop = LoopThread() if transport == "sessions" else None
        try:
            self._transport: Transport = (
                SessionStreams(
                    self._loop, target, num_envs, self._options, self.autoreset_mode,
                    channels=channels, credentials=credentials, timeout=step_timeout,
                    session_options=session_options,
                )
                if self._loop is not None
                else VectorStream(
                    target, num_envs, self._options, self.autoreset_mode, backend=backend,
                    credentials=credentials, timeout=step_timeout,
                    session_options=session_options,
                )
            )  # fmt: skip
        except BaseException:
            if self._loop is not None:
                self._loop.stop()
            raise
        self._set_spaces(self._transport.description)
        # Sub-envs whose last step ended their episode (DISABLED refuses to step them).
        self._ended = np.zeros(num_envs, dtype=np.bool_)
        # The latest batch (a partial reset returns the whole batch).
        self._last: Any = None
        # async_reset() was called: send() may step.
        self._async_reset = False

    # -- setup and teardown -------------------------------------------------------------

    def _set_spaces(self, description: EnvDescription) -> None:
        self.description = description
        #: The TimeLimit the server applies (0 = none).
        self.max_episode_steps = int(description.max_episode_steps)
        self.single_observation_space = convert.build_space(description.observation_space)
        self.single_action_space = convert.build_space(description.action_space)
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        if description.render_fps:
            self.metadata["render_fps"] = description.render_fps

    def close_extras(self, **kwargs: Any) -> None:
        """Close every remote env, the streams, the channels and the loop thread."""
        try:
            self._transport.close()
        finally:
            if self._loop is not None:
                self._loop.stop()

    def __enter__(self) -> RemoteGymnasiumVectorEnv:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def remote(self) -> Transport:
        """The transport (``VectorStream`` or ``SessionStreams``: its session ids)."""
        return self._transport

    # -- the VectorEnv contract ---------------------------------------------------------

    def reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset the sub-envs (all, or those of ``options["reset_mask"]``).

        ``options`` besides ``reset_mask`` may hold ``env_id``, ``max_episode_steps`` and
        ``kwargs`` (see ``RemoteGymnasiumEnv.reset``); they must not change the spaces.

        Returns:
            ``(observations, infos)``: batched observations, Gymnasium-style batched infos.

        Raises:
            ValueError: wrong number of seeds, a bad ``reset_mask``, unknown option keys,
                or options that change the spaces. EnvError / SessionLost: from the server.
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
        indices = [int(i) for i in np.flatnonzero(mask)]
        spaces = (self.single_observation_space, self.single_action_space)
        rows = self._transport.reset(indices, [seeds[i] for i in indices], message)
        if message is not None:
            described = self._transport.description
            if (
                convert.build_space(described.observation_space),
                convert.build_space(described.action_space),
            ) != spaces:
                raise ValueError(
                    "the reset options changed the spaces; a vector env's spaces are fixed "
                    "(make a new RemoteGymnasiumVectorEnv for another env)"
                )
            self._options = message
            self.description = described
        self._ended[mask] = False
        infos = self._infos(rows)
        if self._last is None or len(indices) == self.num_envs:
            self._last = rows.observations
        else:  # a partial reset returns the whole batch: the others' last observations
            self._last = self._merge(indices, rows.observations)
        return self._last, infos

    def _merge(self, indices: Sequence[int], observations: Any) -> Any:
        """A new batch: the last one with the rows of ``indices`` replaced."""
        space = self.single_observation_space
        items = list(iterate(self.observation_space, self._last))
        fresh = iterate(batch_space(space, len(indices)), observations)
        for index, item in zip(indices, fresh, strict=True):
            items[index] = item
        out = create_empty_array(space, self.num_envs)
        assert out is not None  # None only for spaces convert cannot build
        return concatenate(space, items, out)

    def step(
        self, actions: Any
    ) -> tuple[
        Any, npt.NDArray[np.float64], npt.NDArray[np.bool_], npt.NDArray[np.bool_], dict[str, Any]
    ]:
        """Step every sub-env (resetting ended ones per the autoreset mode).

        Returns:
            ``(observations, rewards, terminations, truncations, infos)``, batched.

        Raises:
            RuntimeError: ``DISABLED`` mode and a sub-env's episode is over (reset it
                with ``reset_mask`` first), or the env is closed.
            EnvError: a remote env refused its action (INVALID_ARGUMENT) or raised.
            ConversionError: the actions are not a batch of ``single_action_space``.
            SessionLost: a stream ended.
        """
        if self.closed:
            raise RuntimeError("the vector env is closed")
        if self._last is None:
            raise RuntimeError("reset the vector env before stepping it")
        if self.autoreset_mode is AutoresetMode.DISABLED and self._ended.any():
            ended = np.flatnonzero(self._ended).tolist()
            raise RuntimeError(
                f"sub-envs {ended} ended their episodes: reset them with "
                "options={'reset_mask': mask} before stepping (autoreset is DISABLED)"
            )
        batch = self._transport.step(actions)
        self._ended = np.logical_or(batch.terminated, batch.truncated)
        self._last = batch.observations
        return (
            batch.observations,
            batch.rewards,
            batch.terminated,
            batch.truncated,
            self._infos(batch),
        )

    # -- EnvPool's asynchronous calls (batch_size < num_envs) ---------------------------

    def async_reset(self) -> None:
        """Reset every sub-env (unseeded) without waiting: one request per batch of
        ``batch_size`` envs (envs ``0..b-1``, ``b..2b-1``, ...); :meth:`recv` returns each
        batch's first observations as it comes (EnvPool's ``async_reset``).

        Raises:
            RuntimeError: the env is closed, or requests are in flight already.
            SessionLost: the stream ended.
        """
        stream = self._async_stream()
        if stream.in_flight:
            raise RuntimeError(
                f"async_reset() with {stream.in_flight} requests in flight: recv() them first"
            )
        size = self.batch_size
        stream.async_reset(
            [range(k, min(k + size, self.num_envs)) for k in range(0, self.num_envs, size)]
        )
        self._ended[:] = False
        self._async_reset = True

    def send(self, actions: Any, env_id: Any = None) -> None:
        """Step the sub-envs ``env_id`` (an array of indices, as ``info["env_id"]`` of a
        :meth:`recv`; None: all) with one action row each, without waiting for the
        answer (EnvPool's ``send``). The envs named must not be in flight already.

        Raises:
            RuntimeError: the env is closed, or was never reset.
            ValueError: ``env_id`` repeats an index or is out of range.
            ConversionError: the actions are not a batch of ``single_action_space``.
            SessionLost: the stream ended.
        """
        stream = self._async_stream()
        if self._last is None and not self._async_reset:
            raise RuntimeError("reset the vector env (async_reset) before send()")
        if env_id is None:
            indices = np.arange(self.num_envs)
        else:
            indices = np.asarray(env_id, dtype=np.int64).reshape(-1)
        order = np.argsort(indices, kind="stable")
        ordered = indices[order]
        if (
            len(ordered) == 0
            or ordered[0] < 0
            or ordered[-1] >= self.num_envs
            or (len(ordered) > 1 and (np.diff(ordered) == 0).any())
        ):
            raise ValueError(
                f"env_id must name distinct sub-envs 0..{self.num_envs - 1}, got {indices.tolist()}"
            )
        if not (order == np.arange(len(order))).all():  # the wire wants increasing indices
            actions = _take_rows(actions, order)
        stream.send(actions, ordered.tolist())

    def recv(
        self,
    ) -> tuple[
        Any, npt.NDArray[np.float64], npt.NDArray[np.bool_], npt.NDArray[np.bool_], dict[str, Any]
    ]:
        """The rows of whichever batch sent (:meth:`send` or :meth:`async_reset`) is
        answered first (EnvPool's ``recv``): ``(observations, rewards, terminations,
        truncations, infos)`` with ``infos["env_id"]``, the sub-env of each row.

        Raises:
            RuntimeError: the env is closed, or nothing is in flight.
            EnvError: the server refused the batch (e.g. FAILED_PRECONDITION: it named a
                sub-env in flight), or one of its envs failed.
            SessionLost: the stream ended.
        """
        stream = self._async_stream()
        if not stream.in_flight:
            raise RuntimeError("recv() with nothing in flight: send() or async_reset() first")
        indices, batch = stream.recv()
        ids = np.asarray(indices, dtype=np.int32)
        self._ended[ids] = np.logical_or(batch.terminated, batch.truncated)
        infos = self._infos(batch)
        infos["env_id"] = ids
        return batch.observations, batch.rewards, batch.terminated, batch.truncated, infos

    def _async_stream(self) -> VectorStream:
        if self.closed:
            raise RuntimeError("the vector env is closed")
        transport = self._transport
        if not isinstance(transport, VectorStream):
            raise RuntimeError("send/recv (EnvPool's async mode) need transport='vector'")
        return transport

    def render(self) -> tuple[Any, ...] | None:
        """Every sub-env's current frame (``render_mode="rgb_array"``), else None."""
        if self.render_mode is None:
            return None
        return self._transport.frames()

    # -- helpers ------------------------------------------------------------------------

    def _infos(self, batch: Batch) -> dict[str, Any]:
        infos: dict[str, Any] = {}
        for i, info in batch.infos:
            infos = self._add_info(infos, info, i)
        return infos

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
        if not mask.all() and self._last is None:
            raise ValueError("the first reset must reset every sub-env")
        return mask

    def __repr__(self) -> str:
        env_id = getattr(getattr(self, "description", None), "env_id", "?")
        return f"RemoteGymnasiumVectorEnv({env_id}, num_envs={self.num_envs})"


def _take_rows(actions: Any, order: npt.NDArray[np.int64]) -> Any:
    """The rows of a batch of actions (arrays, or dicts / tuples of them) in ``order``."""
    if isinstance(actions, dict):
        return {key: _take_rows(value, order) for key, value in actions.items()}
    if isinstance(actions, tuple):
        return tuple(_take_rows(value, order) for value in actions)
    return np.asarray(actions)[order]
