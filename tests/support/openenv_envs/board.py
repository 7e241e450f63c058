# ruff: noqa: UP006, UP035, UP045 -- typing.List/Dict/Optional, as the catalogue writes them
"""A board game written the way several of OpenEnv's catalogue envs are (connect4,
tic_tac_toe in openspiel, coding_env, textarena): ``step`` and ``reset`` annotated with
the *base* ``Action`` / ``Observation`` (the real types are named only in the app's
``create_app`` call, see apps.py), ``List[List[int]]`` boards, an ``Optional[Tuple]``,
an enum, ``Dict[str, Any]`` holding ints, an empty dict field, ``**kwargs`` reset
options used as indices, and an illegal move that *raises* (OpenEnv answers it with an
error and the game goes on)."""

from enum import Enum
from typing import Any, Dict, List, Optional, Tuple
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import BaseModel, Field


class Player(str, Enum):
    RED = "red"
    YELLOW = "yellow"


class Cell(BaseModel):
    row: int
    column: int


class Group(BaseModel):
    player: Player
    cells: List[Cell] = Field(default_factory=list)


class DropAction(Action):
    column: int = Field(..., description="Where to drop the piece")


class BoardObservation(Observation):
    board: List[List[int]] = Field(default_factory=list)
    legal_actions: List[int] = Field(default_factory=list)
    last_move: Optional[Tuple[int, int]] = None
    turn: Player = Player.RED
    groups: List[Group] = Field(default_factory=list)
    stats: Dict[str, Any] = Field(default_factory=dict)
    info: Dict[str, Any] = Field(default_factory=dict)  # empty, as textarena's often is
    seen_options: Dict[str, Any] = Field(default_factory=dict)


class BoardState(State):
    board: List[List[int]] = Field(default_factory=list)
    turn: Player = Player.RED


_PRESETS = [[0, 0, 0, 0], [1, 0, 0, 0], [0, 2, 0, 0]]


class BoardEnvironment(Environment):
    """Drop pieces into a 3-row, 4-column board."""

    ROWS, COLUMNS = 3, 4

    def __init__(self):
        self._board = [[0] * self.COLUMNS for _ in range(self.ROWS)]
        self._state = BoardState(episode_id=str(uuid4()))
        self._turn = Player.RED

    def reset(self, seed=None, episode_id=None, **kwargs) -> Observation:
        self._board = [[0] * self.COLUMNS for _ in range(self.ROWS)]
        # An option used as an index, as reset options often are: it must stay an int.
        preset = _PRESETS[kwargs.get("preset", 0)]
        self._board[-1] = list(preset)
        self._turn = Player.RED
        self._state = BoardState(
            episode_id=episode_id or str(uuid4()), board=self._board, turn=self._turn
        )
        return self._observe(None, seen=dict(kwargs, seed=seed))

    def step(self, action: Action) -> Observation:  # type: ignore[override]
        if not isinstance(action, DropAction):
            raise ValueError(f"Expected DropAction, got {type(action).__name__}")
        column = action.column
        rows = (
            [r for r in range(self.ROWS) if self._board[r][column] == 0]
            if (0 <= column < self.COLUMNS)
            else []
        )
        if not rows:
            raise ValueError(f"illegal move: column {column} is full or off the board")
        row = rows[-1]
        self._board[row][column] = 1 if self._turn is Player.RED else 2
        self._turn = Player.YELLOW if self._turn is Player.RED else Player.RED
        self._state.step_count += 1
        self._state.board, self._state.turn = self._board, self._turn
        full = all(cell for cell in self._board[0])
        return self._observe((row, column), done=full, reward=0.5 if full else 0.0)

    def _observe(
        self,
        last: Optional[Tuple[int, int]],
        done: bool = False,
        reward: float = 0.0,
        seen: Optional[Dict[str, Any]] = None,
    ) -> BoardObservation:
        groups = [
            Group(
                player=p,
                cells=[
                    Cell(row=r, column=c)
                    for r in range(self.ROWS)
                    for c in range(self.COLUMNS)
                    if self._board[r][c] == (1 if p is Player.RED else 2)
                ],
            )
            for p in Player
        ]
        return BoardObservation(
            board=[list(row) for row in self._board],
            legal_actions=[c for c in range(self.COLUMNS) if self._board[0][c] == 0],
            last_move=last,
            turn=self._turn,
            groups=groups,
            stats={
                "pieces": sum(1 for row in self._board for c in row if c),
                "ratio": 0.5,
                "big": 2**60 + 1,
                "none": None,
                "nested": [[1, 2], {"k": 3}],
            },
            seen_options=seen or {},
            done=done,
            reward=reward,
            metadata={"step": self._state.step_count, "turn": self._turn.value},
        )

    @property
    def state(self) -> State:
        return self._state
