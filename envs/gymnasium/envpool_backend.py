"""One EnvPool pool (``envpool`` 1.2.5, C++ batched stepping; the ``[envpool]`` extra)
serving a vector stream's N envs, for the ids EnvPool knows.

Where EnvPool differs from Gymnasium (pinned by ``tests/test_batch_envpool.py``):

* **Seeds.** A pool is seeded when it is made, one seed per env; it cannot reseed one env
  later. A seeded reset of *every* env makes a new pool with those seeds; a seeded reset
  of some envs only is refused (INVALID_ARGUMENT); an unseeded reset continues each env's
  generator. EnvPool's generators are not NumPy's: the same seed gives other episodes
  than ``gymnasium.make`` (deterministic all the same: same seeds, same episodes).
* **Autoreset.** EnvPool resets an ended env itself on its next step (NEXT_STEP: reward 0,
  flags False, the action ignored), which is Gymnasium's NEXT_STEP; SAME_STEP and an
  explicit reset go through ``reset(env_id)``, which clears that pending reset.
* **Spaces, rewards, infos.** Spaces are EnvPool's (for classic control the same as
  Gymnasium's); rewards are EnvPool's float32 values widened to float64 (Pendulum's differ
  from Gymnasium's float64 ones in the last digits); EnvPool's bookkeeping keys
  (``env_id``, ``players``, ``elapsed_step``) are dropped from infos (the wire has indices
  and step counts), so classic control has none, like Gymnasium.
* **Ids** are EnvPool's: ``Pong-v5`` is EnvPool's Atari with its own preprocessing (84x84
  grey, frame stack), not ``ALE/Pong-v5``.
* No rendering, and ``kwargs`` go to ``envpool.make_gymnasium`` (its own names), checked
  first (:func:`checked_kwargs`): EnvPool's C++ ends the whole process on many values a
  client could send (a missing ROM exits, ``stack_num=0`` or ``noop_max=0`` segfault,
  ``num_threads=-1`` or an image size 0 abort, MiniGrid corrupts its heap), so only
  Atari's preprocessing settings are taken (:data:`ALLOWED_KWARGS`, each within bounds,
  at most :data:`MAX_OBSERVATION_BYTES` of observation per env); never the server's
  (threads, affinity, asset path, task, seeds, sizes).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium
import numpy as np
import numpy.typing as npt

from openenv_grpc import AutoresetMode, InvalidAction
from openenv_grpc_envs.gymnasium.backends import Rows, rows_index
from openenv_grpc_envs.gymnasium.configuration import Config, describe, jsonable
from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import Backend

__all__ = ["EnvPoolEnvs", "RawStep", "envpool_ids", "envpool_installed"]

#: Info keys EnvPool adds for its own bookkeeping (the wire carries indices, step counts).
BOOKKEEPING_KEYS = frozenset({"env_id", "players", "elapsed_step"})
#: EnvPool takes seeds as C++ ints.
MAX_SEED = 2**31 - 1
#: The EnvPool settings a client may set, with their bounds (inclusive; None: a bool).
#: Only Atari's preprocessing: EnvPool's C++ ends the process (exit, SIGSEGV, SIGABRT,
#: heap corruption) on many values of the others -- a missing ROM for ``task`` or
#: ``base_path``, ``num_threads=-1``, MiniGrid's ``size=2`` or ``mission_bytes=1`` -- and
#: the rest are the server's (threads, CPU affinity, sizes, seeds).
ALLOWED_KWARGS: dict[str, tuple[float, float] | None] = {
    "stack_num": (1, 64),
    "frame_skip": (1, 64),
    "noop_max": (1, 1000),
    "img_height": (1, 1024),
    "img_width": (1, 1024),
    "repeat_action_probability": (0.0, 1.0),
    "episodic_life": None,
    "reward_clip": None,
    "zero_discount_on_life_loss": None,
    "use_fire_reset": None,
    "full_action_space": None,
    "use_inter_area_resize": None,
    "gray_scale": None,
}
#: Largest observation of one env a client may configure (ALE's full 210x160 RGB screen,
#: four stacked, is 403 kB; EnvPool keeps several batches of them).
MAX_OBSERVATION_BYTES = 1 << 20


def envpool_installed() -> bool:
    """Whether ``envpool`` can be imported here."""
    try:
        import envpool  # noqa: F401
    except ImportError:
        return False
    return True


def envpool_ids() -> frozenset[str]:
    """The ids EnvPool serves (empty without the extra)."""
    try:
        import envpool
    except ImportError:
        return frozenset()
    return frozenset(envpool.list_all_envs())


class EnvPoolEnvs:
    """``size`` envs in one EnvPool pool; see :class:`.backends.BatchBackend`.

    Raises (from the constructor): InvalidAction when EnvPool is missing, does not know
    the id, or refuses the kwargs, seeds or render mode.
    """

    def __init__(
        self, config: Config, size: int, autoreset: AutoresetMode, seeds: Sequence[int | None]
    ) -> None:
        try:
            import envpool
        except ImportError:
            raise InvalidAction(
                "BACKEND_ENVPOOL needs envpool on the server: pip install 'openenv-grpc[envpool]'"
            ) from None
        if config.env_id not in envpool_ids():
            raise InvalidAction(
                f"EnvPool does not serve {config.env_id!r} (its ids: envpool.list_all_envs())"
            )
        if config.render_mode:
            raise InvalidAction("the EnvPool backend does not render: leave render_mode empty")
        env_seeds = [_seed(s) for s in seeds]
        kwargs = checked_kwargs(config.env_id, config.kwargs)
        if config.max_episode_steps is not None:
            kwargs["max_episode_steps"] = config.max_episode_steps
        try:
            self._pool: Any = envpool.make_gymnasium(
                config.env_id, num_envs=size, batch_size=size, env_seed=env_seeds, **kwargs
            )
        except (TypeError, ValueError, RuntimeError, KeyError) as exc:
            raise InvalidAction(
                f"envpool cannot make {config.env_id!r} with kwargs {config.kwargs}: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        self._same_step = autoreset is AutoresetMode.SAME_STEP
        self.observation_space = self._pool.observation_space
        self.action_space = self._pool.action_space
        if not isinstance(self.observation_space, gymnasium.spaces.Box):
            self._pool.close()
            raise InvalidAction(
                f"the EnvPool backend serves Box observations; {config.env_id!r} has "
                f"{self.observation_space} (use backend gymnasium)"
            )
        self.description = describe(
            config,
            self.observation_space,
            self.action_space,
            int(self._pool.spec.config.max_episode_steps),
            Backend.BACKEND_ENVPOOL,
        )
        self._action_dtype = np.dtype(self.action_space.dtype or np.int64)
        # Each env's latest observation, one array for the pool (an element per env).
        self._last = np.zeros((size, *(self.observation_space.shape or ())),
                              dtype=self.observation_space.dtype)  # fmt: skip
        self._seen = np.zeros(size, dtype=np.bool_)
        #: The ids of every env, for a step of all of them. Never written; left writable
        #: because EnvPool's C++ ``_send`` takes only writable arrays (the wrapper's
        #: ``pool.step`` copies them; :class:`RawStep` does not).
        self._all = np.arange(size, dtype=np.int32)
        self._raw = RawStep.of(self._pool)
        #: Whether a reset has happened since the pool was made (the first may be partial).
        self.fresh = True

    def reset(self, indices: Sequence[int], seeds: Sequence[int | None]) -> Rows:
        # Seeds were applied when the pool was made (the batch makes a new pool for them).
        self.fresh = False
        ids = np.asarray(indices, dtype=np.int32)
        observations, info = self._pool.reset(ids)
        observations = self._reorder(observations, info, ids)
        count = len(indices)
        rows = Rows(
            list(indices), observations, True, [0.0] * count, [False] * count, [False] * count
        )
        rows.infos = _infos(info, count)
        self._remember(rows_index(indices), observations)
        return rows

    def step(self, indices: Sequence[int], actions: Any, resetting: Sequence[bool]) -> Rows:
        index = rows_index(indices)
        # A run of envs (all, or one half in flight): a view of the ids, no array to build.
        ids = self._all[index] if isinstance(index, slice) else index.astype(np.int32)
        raw = self._raw
        if raw is not None:
            observations, rewards, terminated, truncated, info = raw.step(actions, ids)
        else:
            batch = np.asarray(actions, dtype=self._action_dtype)
            observations, rewards, terminated, truncated, info = self._pool.step(batch, ids)
        observations = self._reorder(observations, info, ids)
        count = len(indices)
        widened = rewards.astype(np.float64)
        rows = Rows(
            list(indices),
            observations,
            True,
            widened.tolist(),
            terminated.tolist(),
            truncated.tolist(),
            columns=(widened, terminated, truncated),
        )
        rows.infos = _infos(info, count)
        if any(resetting):  # EnvPool reset those itself (its autoreset is NEXT_STEP's)
            rows.reset = list(resetting)
        if self._same_step:
            done = np.flatnonzero(np.logical_or(terminated, truncated))
            if done.size:
                self._reset_done(rows, ids, done)
        self._remember(index, rows.observations)
        return rows

    def _reset_done(self, rows: Rows, ids: npt.NDArray[np.int32], done: npt.NDArray[Any]) -> None:
        """SAME_STEP: reset the envs whose episode ended now; their last observations and
        infos become the final ones."""
        rows.final_observations = rows.observations[done].copy()
        rows.final_infos = (
            [rows.infos[j] for j in done] if rows.infos is not None else [None] * len(done)
        )
        first, info = self._pool.reset(ids[done])
        first = self._reorder(first, info, ids[done])
        observations = np.array(rows.observations)  # EnvPool's buffer may be reused
        observations[done] = first
        rows.observations = observations
        reset = np.zeros(len(ids), dtype=np.bool_)
        reset[done] = True
        rows.reset = reset.tolist()
        reset_infos = _infos(info, len(done))
        if rows.infos is not None or reset_infos is not None:
            merged = list(rows.infos or [None] * len(ids))
            for j, row in enumerate(done):
                merged[row] = reset_infos[j] if reset_infos is not None else None
            rows.infos = merged

    @staticmethod
    def _reorder(observations: Any, info: Mapping[str, Any], ids: npt.NDArray[np.int32]) -> Any:
        """Rows in the order asked (EnvPool answers in that order in sync mode; checked)."""
        answered = np.asarray(info["env_id"])
        if answered.dtype == ids.dtype and answered.tobytes() == ids.tobytes():
            return observations  # the common case: compared as bytes (both int32)
        if np.array_equal(answered, ids):
            return observations
        order = np.argsort(answered)[np.argsort(np.argsort(ids))]
        return observations[order]

    def _remember(self, index: slice | npt.NDArray[np.intp], observations: Any) -> None:
        """Keep the envs' latest observations (``index``: :func:`.backends.rows_index`)."""
        self._last[index] = observations
        self._seen[index] = True

    def last_observation(self, index: int) -> Any:
        return self._last[index] if self._seen[index] else None

    def render(self, index: int) -> Any:
        return None

    def close(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            self._pool = None
            pool.close()


class RawStep:
    """A step of an EnvPool pool through its C++ ``_send`` / ``_recv``, skipping the Python
    wrapper's per-call work (for 64 CartPoles ~25 µs of the ~60 µs ``pool.step`` costs the
    calling thread: a ``config`` dict rebuilt per call, the action dict and its checks, the
    state's pytree), for the pools whose layout is the plain one: actions ``env_id``,
    ``players.env_id``, ``action`` (one player per env), and a state with ``obs`` and
    flat ``info:`` keys. :meth:`of` gives None for any other layout (``pool.step`` then).

    Answers what ``pool.step(actions, ids)`` answers (pinned by
    ``tests/test_batch_envpool.py``): the observations, rewards, terminated
    (``done & ~trunc``), truncated, and an info mapping with ``env_id`` and the flat info
    keys (EnvPool's ``players`` and ``elapsed_step`` are bookkeeping the backend drops).
    """

    __slots__ = ("_action_dtype", "_infos", "_recv", "_send", "_slots")

    #: The action layout this path sends (EnvPool's ``_action_keys``).
    ACTION_KEYS = ("env_id", "players.env_id", "action")

    def __init__(
        self, pool: Any, action_dtype: np.dtype[Any], slots: dict[str, int],
        infos: list[tuple[str, int]],
    ) -> None:  # fmt: skip
        self._send = pool._send
        self._recv = pool._recv
        self._action_dtype = action_dtype
        self._slots = (slots["obs"], slots["reward"], slots["done"], slots["trunc"],
                       slots["info:env_id"])  # fmt: skip
        self._infos = infos

    @classmethod
    def of(cls, pool: Any) -> RawStep | None:
        """The raw step of ``pool``, or None when its layout is not the plain one (or the
        EnvPool release has other internals)."""
        try:
            action_keys = tuple(pool._action_keys)
            state_keys = list(pool._state_keys)
            action_dtype = np.dtype(pool._spec._action_spec[-1][0])
            players = int(pool.config.get("max_num_players", 1))
            send, recv = pool._send, pool._recv
        except (AttributeError, IndexError, KeyError, TypeError):
            return None
        if (
            action_keys != cls.ACTION_KEYS
            or players != 1
            or not (callable(send) and callable(recv))
        ):
            return None
        slots = {key: i for i, key in enumerate(state_keys)}
        needed = ("obs", "reward", "done", "trunc", "info:env_id")
        if len(slots) != len(state_keys) or any(key not in slots for key in needed):
            return None
        infos: list[tuple[str, int]] = []
        for key, i in slots.items():
            if key.startswith("obs:"):
                return None  # a nested observation: the wrapper unpacks it
            if not key.startswith("info:") or key == "info:env_id":
                continue
            name = key[len("info:") :]
            if name.startswith("players."):
                continue  # EnvPool's bookkeeping
            if "." in name or ":" in name or name in BOOKKEEPING_KEYS:
                return None  # a nested info: the wrapper builds it
            infos.append((name, i))  # in the state's order, as the wrapper's info dict
        return cls(pool, action_dtype, slots, infos)

    def step(self, actions: Any, ids: npt.NDArray[np.int32]) -> tuple[Any, ...]:
        """One step of envs ``ids`` (a writable int32 array, alive until this returns:
        EnvPool's C++ reads it in place): ``(obs, rewards, terminated, truncated, info)``
        as ``pool.step`` answers them."""
        batch = np.ascontiguousarray(actions, dtype=self._action_dtype)
        self._send([ids, ids, batch])
        state = self._recv()
        obs, reward, done, trunc, env_id = self._slots
        truncated = state[trunc]
        info: dict[str, Any] = {"env_id": state[env_id]}
        for name, i in self._infos:
            info[name] = state[i]
        terminated = state[done] & ~truncated
        return state[obs], state[reward], terminated, truncated, info


def checked_kwargs(env_id: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A client's EnvPool kwargs for ``env_id``, checked before EnvPool sees them.

    Raises:
        InvalidAction: a key not in :data:`ALLOWED_KWARGS` or not a setting of the id, a
            value of another type or out of its bounds, or an observation over
            :data:`MAX_OBSERVATION_BYTES` per env.
    """
    import envpool

    if not kwargs:
        return {}
    settings = set(envpool.make_spec(env_id).config._fields)
    served = sorted(key for key in ALLOWED_KWARGS if key in settings)
    for key, value in kwargs.items():
        if key not in served:
            raise InvalidAction(
                f"EnvPool kwarg {key!r} is not served for {env_id} (this server takes "
                f"{', '.join(served) or 'none'}; the Gymnasium backend takes make()'s kwargs)"
            )
        bounds = ALLOWED_KWARGS[key]
        if bounds is None:
            if not isinstance(value, bool):
                raise InvalidAction(f"EnvPool kwarg {key}={value!r} must be true or false")
            continue
        low, high = bounds
        integral = isinstance(low, int)
        number = (int,) if integral else (int, float)
        if isinstance(value, bool) or not isinstance(value, number) or not low <= value <= high:
            kind = "a whole number" if integral else "a number"
            raise InvalidAction(f"EnvPool kwarg {key}={value!r} must be {kind} in {low}..{high}")
    try:
        space = envpool.make_spec(env_id, **kwargs).observation_space
    except (TypeError, ValueError, RuntimeError, KeyError) as exc:
        raise InvalidAction(f"envpool refuses kwargs {dict(kwargs)}: {exc}") from None
    size = int(np.prod(space.shape or ())) * np.dtype(space.dtype).itemsize
    if size > MAX_OBSERVATION_BYTES:
        raise InvalidAction(
            f"EnvPool kwargs {dict(kwargs)} make {size} bytes of observation per env; at "
            f"most {MAX_OBSERVATION_BYTES} are served"
        )
    return dict(kwargs)


def _seed(seed: int | None) -> int:
    """A seed EnvPool accepts (a fresh random one for None).

    Raises:
        InvalidAction: a seed outside 0 .. 2**31 - 1.
    """
    if seed is None:
        return secrets.randbelow(MAX_SEED)
    if not 0 <= seed <= MAX_SEED:
        raise InvalidAction(f"the EnvPool backend takes seeds 0..{MAX_SEED}, got {seed}")
    return seed


def _infos(info: Mapping[str, Any], count: int) -> list[Mapping[str, Any] | None] | None:
    """Per-row infos from EnvPool's columns, without its bookkeeping keys (None if none)."""
    keys = [k for k in info if k not in BOOKKEEPING_KEYS]
    if not keys:
        return None
    columns = {k: np.asarray(info[k]) for k in keys}
    return [{k: jsonable(col[row]) for k, col in columns.items()} for row in range(count)]
