"""The openspiel environment: any OpenSpiel game, chosen by name at reset.

The agent plays one seat (``agent_player``); the other seats are played either by a
seeded uniform-random policy or by the client itself (``CONTROL_MODE_ALL_PLAYERS``).
Chance nodes are always sampled by the environment, with the episode's seeded
generator, so the same seed and the same actions give the same observations.

Games are loaded once per (name, parameters) and shared by every session of the process
(OpenSpiel games are immutable); states belong to one environment instance.
"""

from __future__ import annotations

import difflib
import math
import os
import random
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyspiel  # type: ignore[import-not-found]  # ships no type stubs

from openenv_grpc import Environment, InvalidAction, Transition
from openenv_grpc_envs import snapshot_body
from openenv_grpc_envs.openspiel.v1.openspiel_pb2 import (
    CONTROL_MODE_AGENT_VS_RANDOM,
    CONTROL_MODE_ALL_PLAYERS,
    ControlMode,
    LegalAction,
    OpenSpielAction,
    OpenSpielObservation,
    OpenSpielResetOptions,
    OpenSpielState,
    Tensor,
)

__all__ = [
    "ALLOWED_GAMES",
    "DEFAULT_GAME",
    "MAX_TENSOR_ELEMENTS",
    "LoadedGame",
    "OpenSpielEnvironment",
    "load",
]

#: The game played when the reset options name none.
DEFAULT_GAME = "tic_tac_toe"
#: Largest tensor (in elements) a game may have: parameters such as catch's rows and
#: columns are client-chosen, and a huge board would exhaust memory and the message limit.
MAX_TENSOR_ELEMENTS = 1 << 20
#: Loaded games kept per process; each distinct (name, parameters) pair takes one slot.
GAME_CACHE_SIZE = 256
#: Legal actions quoted in an error message before the rest are only counted.
QUOTED_ACTIONS = 12
#: Longest OpenSpiel error text passed on to the client.
MAX_ERROR_CHARS = 300
#: The layout of this env's snapshots (see :meth:`OpenSpielEnvironment.snapshot`).
SNAPSHOT_LAYOUT = "openspiel/1"
#: Longest game name or description a snapshot may hold.
MAX_GAME_CHARS = 4096

_TERMINAL = int(pyspiel.PlayerId.TERMINAL)
_CHANCE = int(pyspiel.PlayerId.CHANCE)
_SIMULTANEOUS = pyspiel.GameType.Dynamics.SIMULTANEOUS
_MEAN_FIELD = pyspiel.GameType.Dynamics.MEAN_FIELD
_EXPLICIT_CHANCE = pyspiel.GameType.ChanceMode.EXPLICIT_STOCHASTIC
#: Every registered game's type, by short name: its parameters and their defaults.
_GAME_TYPES: dict[str, Any] = {t.short_name: t for t in pyspiel.registered_games()}
#: Environment variable naming the only games this server plays (comma-separated);
#: unset or empty allows every registered game.
ALLOWED_GAMES_VARIABLE = "OPENSPIEL_GAMES"
_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


def _allowed_games(value: str) -> frozenset[str] | None:
    """The allowlist in ``value``, or None for every game.

    Raises:
        ValueError: it names a game that is not registered (a typo must not go unseen).
    """
    names = frozenset(n.strip() for n in value.split(",") if n.strip())
    unknown = sorted(names - _GAME_TYPES.keys())
    if unknown:
        raise ValueError(f"{ALLOWED_GAMES_VARIABLE} names unknown games: {', '.join(unknown)}")
    return names or None


#: Read once at start-up: OpenSpiel's C++ games do not check every parameter, and a few
#: values crash the process, so a server facing untrusted clients can pin its games.
ALLOWED_GAMES = _allowed_games(os.environ.get(ALLOWED_GAMES_VARIABLE, ""))


@dataclass(frozen=True, slots=True)
class LoadedGame:
    """A loaded game and what the environment asks of it on every step, read once."""

    #: The ``pyspiel.Game``; immutable, shared by every session.
    game: Any
    #: The game with all its parameters, e.g. ``catch(columns=5,rows=10)``.
    description: str
    num_players: int
    num_distinct_actions: int
    has_information_state_string: bool
    has_observation_string: bool
    #: None when the game provides no such tensor.
    information_state_shape: tuple[int, ...] | None
    observation_shape: tuple[int, ...] | None


_cache: OrderedDict[tuple[str, str], LoadedGame] = OrderedDict()
_cache_lock = threading.Lock()


def load(name: str, params: Mapping[str, Any]) -> LoadedGame:
    """The game ``name`` with typed ``params``, loaded once per process (LRU cache).

    Raises:
        InvalidAction: the game cannot be loaded with these parameters, is a mean-field
            game, or has a tensor larger than :data:`MAX_TENSOR_ELEMENTS`.
    """
    key = (name, repr(sorted(params.items())))
    with _cache_lock:
        cached = _cache.get(key)
        if cached is not None:
            _cache.move_to_end(key)
            return cached
    # Loaded outside the lock: a slow game (some take 100+ ms) must not hold up others.
    # Two sessions racing on the same new key both load it; the games are equal.
    loaded = _load(name, dict(params))
    with _cache_lock:
        _cache[key] = loaded
        while len(_cache) > GAME_CACHE_SIZE:
            _cache.popitem(last=False)
    return loaded


def _load(name: str, params: dict[str, Any]) -> LoadedGame:
    try:
        game = pyspiel.load_game(name, params)
    except Exception as exc:  # SpielError, and a few games raise IndexError & co.
        raise InvalidAction(f"cannot load game {name!r} with {params}: {_short(exc)}") from None
    game_type = game.get_type()
    if game_type.dynamics == _MEAN_FIELD:
        raise InvalidAction(f"{name} is a mean-field game; only sequential games are supported")
    if game_type.dynamics == _SIMULTANEOUS:
        # Simultaneous moves are played one player at a time, each unseen by the others.
        game = pyspiel.convert_to_turn_based(game)
        game_type = game.get_type()
    description = str(game)
    information_state_shape = _shape(
        game_type.provides_information_state_tensor, game.information_state_tensor_shape
    )
    observation_shape = _shape(game_type.provides_observation_tensor, game.observation_tensor_shape)
    for shape in (information_state_shape, observation_shape):
        if shape is None:
            continue
        # An empty or negative dimension means a degenerate board, on which some games
        # crash the process (catch with rows=0 segfaults): refuse it before playing.
        if min(shape, default=1) <= 0:
            raise InvalidAction(
                f"{description} is degenerate: its tensor shape {list(shape)} has an empty "
                "dimension"
            )
        if math.prod(shape) > MAX_TENSOR_ELEMENTS:
            raise InvalidAction(
                f"{description} is too large: a tensor of shape {list(shape)} has more than "
                f"{MAX_TENSOR_ELEMENTS} elements"
            )
    return LoadedGame(
        game=game,
        description=description,
        num_players=game.num_players(),
        num_distinct_actions=game.num_distinct_actions(),
        has_information_state_string=game_type.provides_information_state_string,
        has_observation_string=game_type.provides_observation_string,
        information_state_shape=information_state_shape,
        observation_shape=observation_shape,
    )


def _shape(provided: bool, get_shape: Any) -> tuple[int, ...] | None:
    if not provided:
        return None
    try:
        return tuple(int(n) for n in get_shape())
    except Exception:  # a few games declare a tensor but leave its shape unimplemented
        return None


def game_request(options: OpenSpielResetOptions) -> tuple[str, dict[str, Any]]:
    """The game name and typed parameters that ``options`` ask for.

    Raises:
        InvalidAction: unknown game or parameter, or a value of the wrong type.
    """
    text = options.game.strip() or DEFAULT_GAME
    params: dict[str, Any] = {}
    if "(" in text:
        try:
            parsed = dict(pyspiel.game_parameters_from_string(text))
        except Exception as exc:
            raise InvalidAction(f"cannot parse game string {text!r}: {_short(exc)}") from None
        name = str(parsed.pop("name", ""))
        params.update(parsed)
    else:
        name = text
    game_type = _GAME_TYPES.get(name)
    if game_type is None:
        raise InvalidAction(_unknown_game(name))
    spec: dict[str, Any] = game_type.parameter_specification
    for key, raw in sorted(options.params.items()):
        if key not in spec:
            known = ", ".join(f"{k} (default {v!r})" for k, v in sorted(spec.items()))
            raise InvalidAction(
                f"unknown parameter {key!r} for {name}; its parameters are: {known or 'none'}"
            )
        params[key] = _parse_param(name, key, raw, spec[key])
    if ALLOWED_GAMES is not None:
        _check_allowed(name, params)
    return name, params


def _check_allowed(name: str, params: Mapping[str, Any]) -> None:
    """Refuse ``name``, or any game nested in its parameters, outside the allowlist."""
    assert ALLOWED_GAMES is not None
    if name not in ALLOWED_GAMES:
        raise InvalidAction(
            f"game {name!r} is not played on this server ({ALLOWED_GAMES_VARIABLE}); "
            f"allowed: {', '.join(sorted(ALLOWED_GAMES))}"
        )
    for value in params.values():
        if isinstance(value, Mapping) and "name" in value:  # a nested game parameter
            _check_allowed(str(value["name"]), value)


def _parse_param(game: str, key: str, raw: str, default: Any) -> Any:
    """``raw`` converted to the type of the parameter's default value."""
    text = raw.strip()
    try:
        if isinstance(default, bool):  # before int: bool is an int subclass
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError(text)
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
        if isinstance(default, dict):  # a nested game, e.g. game=goofspiel(num_cards=4)
            return dict(pyspiel.game_parameters_from_string(text))
    except Exception:
        kind = {bool: "a boolean (true/false)", int: "an integer", float: "a number"}.get(
            type(default), "a game string such as goofspiel(num_cards=4)"
        )
        raise InvalidAction(f"parameter {key!r} of {game} must be {kind}, got {raw!r}") from None
    return raw


def _unknown_game(name: str) -> str:
    close = difflib.get_close_matches(name, _GAME_TYPES, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return (
        f"unknown game {name!r}: not one of the {len(_GAME_TYPES)} games in "
        f"pyspiel.registered_names() (e.g. catch, connect_four, kuhn_poker, leduc_poker, "
        f"tic_tac_toe){hint}"
    )


def _short(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


def _tensor(target: Tensor, values: Sequence[float], shape: tuple[int, ...]) -> None:
    target.data = np.asarray(values, dtype="<f4").tobytes()
    target.shape.extend(shape)
    target.dtype = "float32"


class _Episode:
    """One game in progress: its state, generators and who plays whom."""

    __slots__ = (
        "agent",
        "chance_rng",
        "control",
        "legal",
        "legal_names",
        "loaded",
        "max_steps",
        "observer",
        "opponent_rng",
        "request",
        "seed",
        "state",
        "steps",
    )

    def __init__(
        self,
        request: tuple[str, dict[str, Any]],
        loaded: LoadedGame,
        agent: int,
        control: ControlMode.ValueType,
        max_steps: int,
        seed: int,
    ) -> None:
        #: The game's name and parameters as the reset asked for them.
        self.request = request
        self.loaded = loaded
        self.agent = agent
        self.control = control
        self.max_steps = max_steps
        self.seed = seed
        # Separate streams, so a deal is the same whoever plays the other seats.
        self.chance_rng = random.Random(f"{seed}/chance")
        self.opponent_rng = random.Random(f"{seed}/opponents")
        self.state: Any = loaded.game.new_initial_state()
        self.steps = 0
        #: The observer's legal actions and their names, as last observed.
        self.legal: list[int] = []
        self.legal_names: list[str] = []
        self.observer = agent

    def advance(self) -> None:
        """Play chance and (against random) opponents until the client must act."""
        state = self.state
        while not state.is_terminal():
            player = state.current_player()
            if player == _CHANCE:
                actions, probs = zip(*state.chance_outcomes(), strict=True)
                action = self.chance_rng.choices(actions, weights=probs)[0]
            elif player < 0:
                raise RuntimeError(f"unexpected player id {player} in {self.loaded.description}")
            elif self.control == CONTROL_MODE_ALL_PLAYERS or player == self.agent:
                return
            else:
                action = self.opponent_rng.choice(state.legal_actions())
            state.apply_action(action)

    def returns(self) -> list[float]:
        return [float(r) for r in self.state.returns()]

    def note_turn(self) -> tuple[bool, int]:
        """Note who observes now and the legal actions it may take (``observer``,
        ``legal``, ``legal_names``); returns whether the game is over and who moves."""
        state = self.state
        terminal = bool(state.is_terminal())
        current = _TERMINAL if terminal else int(state.current_player())
        observer = self.agent if terminal or self.control != CONTROL_MODE_ALL_PLAYERS else current
        self.observer = observer
        self.legal = [] if terminal else list(state.legal_actions())
        self.legal_names = [state.action_to_string(observer, a) for a in self.legal]
        return terminal, current

    def observe(self, rewards: list[float]) -> OpenSpielObservation:
        """The observation for the observer, and the legal actions it may take now."""
        terminal, current = self.note_turn()
        state, loaded, observer = self.state, self.loaded, self.observer
        observation = OpenSpielObservation(
            current_player=current,
            observer=observer,
            legal_actions=[
                LegalAction(id=a, name=n) for a, n in zip(self.legal, self.legal_names, strict=True)
            ],
            rewards=rewards,
            returns=self.returns(),
            terminal=terminal,
        )
        if loaded.has_information_state_string:
            observation.information_state_string = state.information_state_string(observer)
        if loaded.has_observation_string:
            observation.observation_string = state.observation_string(observer)
        if loaded.information_state_shape is not None:
            _tensor(
                observation.information_state_tensor,
                state.information_state_tensor(observer),
                loaded.information_state_shape,
            )
        if loaded.observation_shape is not None:
            _tensor(
                observation.observation_tensor,
                state.observation_tensor(observer),
                loaded.observation_shape,
            )
        return observation

    def resolve(self, action: OpenSpielAction) -> int:
        """The id of ``action`` if the observer may take it now.

        Raises:
            InvalidAction: no action set, an unknown name, an id out of range or illegal.
        """
        which = action.WhichOneof("action")
        if which == "name":
            try:
                return self.legal[self.legal_names.index(action.name)]
            except ValueError:
                raise InvalidAction(
                    f"{action.name!r} is not a legal action of player {self.observer} now; "
                    f"legal: {self._quote_legal()}"
                ) from None
        if which != "id":
            raise InvalidAction(
                f"the action sets neither id nor name; legal: {self._quote_legal()}"
            )
        action_id = action.id
        if action_id in self.legal:
            return action_id
        limit = self.loaded.num_distinct_actions
        if not 0 <= action_id < limit:
            raise InvalidAction(
                f"invalid action id {action_id}: {self.loaded.description} has action ids "
                f"0..{limit - 1}; legal: {self._quote_legal()}"
            )
        try:  # names of actions that are not legal here are best-effort in some games
            label = f" ({self.state.action_to_string(self.observer, action_id)})"
        except Exception:
            label = ""
        raise InvalidAction(
            f"illegal action {action_id}{label} for player {self.observer} now; "
            f"legal: {self._quote_legal()}"
        )

    def _quote_legal(self) -> str:
        pairs = [f"{a}={n}" for a, n in zip(self.legal, self.legal_names, strict=True)]
        more = len(pairs) - QUOTED_ACTIONS
        quoted = ", ".join(pairs[:QUOTED_ACTIONS])
        return f"{quoted} (+{more} more)" if more > 0 else quoted


class OpenSpielEnvironment(
    Environment[OpenSpielAction, OpenSpielObservation, OpenSpielState, OpenSpielResetOptions]
):
    """Any OpenSpiel game; the agent plays one seat against random players or all seats."""

    name = "openspiel"
    version = "1.0.0"
    description = (
        "Any OpenSpiel game by name; the agent plays one seat against seeded random "
        "players, or every seat."
    )
    # Steps of small games take microseconds, but a first load can take 100+ ms
    # (colored_trails) and some games' steps take milliseconds (bridge, go, shogi):
    # the thread pool keeps one session's slow call from stalling every other.
    runs_inline = False

    def __init__(self) -> None:
        self._episode: _Episode | None = None

    def reset(
        self, *, seed: int | None, episode_id: str, options: OpenSpielResetOptions | None
    ) -> Transition[OpenSpielObservation]:
        options = options if options is not None else OpenSpielResetOptions()
        request = game_request(options)
        loaded = load(*request)
        agent = options.agent_player
        if not 0 <= agent < loaded.num_players:
            raise InvalidAction(
                f"agent_player {agent} is out of range: {loaded.description} has "
                f"{loaded.num_players} player(s), 0..{loaded.num_players - 1}"
            )
        control = options.control or CONTROL_MODE_AGENT_VS_RANDOM
        if control not in (CONTROL_MODE_AGENT_VS_RANDOM, CONTROL_MODE_ALL_PLAYERS):
            raise InvalidAction(f"unknown control mode {control}")
        if seed is None:
            seed = random.SystemRandom().getrandbits(64)
        # Built aside and committed last: an invalid reset leaves the previous episode.
        try:
            episode = _Episode(request, loaded, agent, control, options.max_steps, seed)
            episode.advance()  # opponents and chance may move before the agent's first turn
            returns = episode.returns()
            observation = episode.observe(returns)
        except Exception as exc:  # e.g. crossword has no legal-action ids at all
            raise InvalidAction(
                f"{loaded.description} cannot be played here: {type(exc).__name__}: {_short(exc)}"
            ) from None
        self._episode = episode
        return Transition(
            observation,
            reward=returns[agent],
            terminated=observation.terminal,
        )

    def step(self, action: OpenSpielAction) -> Transition[OpenSpielObservation]:
        episode = self._episode
        if episode is None:  # the server never steps before a reset; be explicit anyway
            raise InvalidAction("step before reset: call reset first")
        action_id = episode.resolve(action)  # raises before anything changes
        before = episode.returns()
        episode.state.apply_action(action_id)
        episode.steps += 1
        episode.advance()
        rewards = [after - b for after, b in zip(episode.returns(), before, strict=True)]
        observation = episode.observe(rewards)
        terminated = observation.terminal
        return Transition(
            observation,
            reward=rewards[episode.agent],
            terminated=terminated,
            truncated=not terminated and 0 < episode.max_steps <= episode.steps,
        )

    def state(self) -> OpenSpielState:
        episode = self._episode
        if episode is None:
            return OpenSpielState()
        state = episode.state
        terminal = bool(state.is_terminal())
        return OpenSpielState(
            game=episode.loaded.description,
            history=state.history(),
            current_player=_TERMINAL if terminal else int(state.current_player()),
            state_string=str(state),
            agent_player=episode.agent,
            control=episode.control,
            seed=episode.seed,
            returns=episode.returns(),
            terminal=terminal,
        )

    def render(self) -> str:
        """The board as OpenSpiel prints it (``str(state)``).

        Raises:
            InvalidAction: no game runs yet (reset first).
        """
        if self._episode is None:
            raise InvalidAction("no game runs yet: reset first, then render")
        return str(self._episode.state)

    def snapshot(self) -> bytes:
        """The episode as JSON: the game's name and parameters, who plays which seat, the
        seed and step count, the generators' states (chance, for games with explicit
        chance nodes; opponents, against random players) and the game state in
        OpenSpiel's own serialization (``State.serialize()``: for most games the action
        history, chance outcomes included).

        Raises:
            InvalidAction: no episode yet, or this game's state does not round-trip
                through OpenSpiel's serialization (checked on every snapshot, so that
                every snapshot handed out restores).
        """
        episode = self._episode
        if episode is None:  # the server never asks before a reset; be explicit anyway
            raise InvalidAction("no episode to snapshot: call reset first")
        state, loaded = episode.state, episode.loaded
        text = state.serialize()
        try:
            same = str(loaded.game.deserialize_state(text)) == str(state)
        except Exception as exc:  # SpielError from a game's own deserializer
            raise NotImplementedError(  # UNIMPLEMENTED: this game cannot, others can
                f"{loaded.description} cannot snapshot: its state does not deserialize in "
                f"OpenSpiel: {_short(exc)}"
            ) from None
        if not same:
            raise NotImplementedError(
                f"{loaded.description} cannot snapshot: its state does not round-trip "
                "through OpenSpiel's serialization"
            )
        name, params = episode.request
        return snapshot_body.dump(
            SNAPSHOT_LAYOUT,
            {
                "game": name,
                "params": params,
                "description": loaded.description,
                "agent": episode.agent,
                "control": int(episode.control),
                "max_steps": episode.max_steps,
                "seed": episode.seed,
                "steps": episode.steps,
                # Each generator only where it draws (2.5 KB of state each).
                "chance_rng": (
                    snapshot_body.random_state(episode.chance_rng)
                    if loaded.game.get_type().chance_mode == _EXPLICIT_CHANCE
                    else None
                ),
                "opponent_rng": (
                    snapshot_body.random_state(episode.opponent_rng)
                    if episode.control == CONTROL_MODE_AGENT_VS_RANDOM
                    else None
                ),
                "state": text,
            },
        )

    def restore(self, snapshot: bytes) -> None:
        """Continue from :meth:`snapshot`'s bytes: the game is loaded through the same
        checks as a reset (this server's ``OPENSPIEL_GAMES`` allowlist included) and the
        state deserialized by OpenSpiel.

        Raises:
            InvalidAction: a field is malformed, the game is not played here or loads
                differently, or the state is not one where the client moves (the episode
                is unchanged).
        """
        self._episode = _restored(snapshot_body.load(SNAPSHOT_LAYOUT, snapshot))

    def close(self) -> None:
        self._episode = None


def _restored(body: snapshot_body.Body) -> _Episode:
    """The episode a snapshot describes.

    Raises:
        InvalidAction: see :meth:`OpenSpielEnvironment.restore`.
    """
    name = body.string("game", max_chars=MAX_GAME_CHARS)
    params = body.mapping("params")
    if name not in _GAME_TYPES:
        raise InvalidAction(_unknown_game(name))
    if ALLOWED_GAMES is not None:
        _check_allowed(name, params)
    loaded = load(name, params)
    description = body.string("description", max_chars=MAX_GAME_CHARS)
    if loaded.description != description:
        raise body.invalid("description", f"{description!r} differs from {loaded.description} here")
    agent = body.integer("agent", low=0, high=loaded.num_players - 1)
    control = body.integer("control")
    if control not in (CONTROL_MODE_AGENT_VS_RANDOM, CONTROL_MODE_ALL_PLAYERS):
        raise body.invalid("control", f"is {control}, not a control mode")
    episode = _Episode(
        (name, params),
        loaded,
        agent,
        ControlMode.ValueType(control),
        body.integer("max_steps", low=0, high=(1 << 32) - 1),
        body.integer("seed", low=0, high=snapshot_body.MAX_SEED),
    )
    episode.steps = body.integer("steps", low=0)
    # A generator left out never draws in this episode: the seeded one stands in.
    if body.has("chance_rng"):
        episode.chance_rng = snapshot_body.random_from(body.child("chance_rng"))
    if body.has("opponent_rng"):
        episode.opponent_rng = snapshot_body.random_from(body.child("opponent_rng"))
    try:
        episode.state = loaded.game.deserialize_state(body.string("state"))
    except Exception as exc:  # SpielError: the text is not a state of this game
        raise body.invalid("state", f"is not a state of {description}: {_short(exc)}") from None
    terminal, current = episode.note_turn()
    if not terminal and (current < 0 or (current != agent and control != CONTROL_MODE_ALL_PLAYERS)):
        raise body.invalid("state", f"waits for player {current}, not the client")
    return episode
