"""An OpenEnv env with nested models, lists, dicts, enums, literals, optionals and an
``Any`` field, written as OpenEnv's docs teach (generic base, pydantic models, a typed
reset). Pick items into a basket; the episode ends when the order is complete. Not
declared concurrency-safe (OpenEnv's default): it gets capacity 1."""

import random
from enum import Enum
from typing import Any, Literal

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import BaseModel, Field


class Size(str, Enum):
    SMALL = "small"
    LARGE = "large"


class Item(BaseModel):
    sku: str
    size: Size = Size.SMALL
    tags: list[str] = Field(default_factory=list)


class Line(BaseModel):
    item: Item
    quantity: int = 1


class PickAction(Action):
    """Put items in the basket (or take them out)."""

    lines: list[Line] = Field(..., description="What to pick")
    mode: Literal["add", "remove"] = "add"
    note: str | None = None
    hints: dict[str, float] = Field(default_factory=dict)


class PickObservation(Observation):
    basket: list[Line] = Field(default_factory=list)
    counts: dict[str, int] = Field(default_factory=dict)
    missing: list[str] = Field(default_factory=list)
    last_note: str | None = None
    extra: Any = None
    weights: list[float] = Field(default_factory=list)


class WarehouseState(State):
    order: dict[str, int] = Field(default_factory=dict)
    difficulty: int = 1


class WarehouseEnvironment(Environment[PickAction, PickObservation, WarehouseState]):
    """Pick the order's items into the basket."""

    def __init__(self) -> None:
        super().__init__()
        self._state = WarehouseState()
        self._basket: dict[str, Line] = {}

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        difficulty: int = 1,
        skus: list[str] | None = None,
    ) -> PickObservation:
        rng = random.Random(seed)
        names = skus or ["apple", "bolt", "cable", "drill"]
        order = {
            sku: rng.randint(1, 3) for sku in rng.sample(names, min(difficulty + 1, len(names)))
        }
        self._state = WarehouseState(episode_id=episode_id, order=order, difficulty=difficulty)
        self._basket = {}
        return self._observe(note=None, reward=0.0)

    def step(self, action: PickAction) -> PickObservation:  # type: ignore[override]
        self._state.step_count += 1
        for line in action.lines:
            held = self._basket.get(line.item.sku)
            change = line.quantity if action.mode == "add" else -line.quantity
            quantity = (held.quantity if held else 0) + change
            if quantity > 0:
                self._basket[line.item.sku] = Line(item=line.item, quantity=quantity)
            else:
                self._basket.pop(line.item.sku, None)
        missing = self._missing()
        return self._observe(
            note=action.note, reward=1.0 if not missing else -0.1, done=not missing
        )

    def _missing(self) -> list[str]:
        counts = {sku: line.quantity for sku, line in self._basket.items()}
        return sorted(sku for sku, n in self._state.order.items() if counts.get(sku, 0) < n)

    def _observe(self, note: str | None, reward: float, done: bool = False) -> PickObservation:
        lines = [self._basket[sku] for sku in sorted(self._basket)]
        return PickObservation(
            basket=lines,
            counts={line.item.sku: line.quantity for line in lines},
            missing=self._missing(),
            last_note=note,
            extra={
                "order_size": sum(self._state.order.values()),
                "skus": sorted(self._state.order),
            },
            weights=[0.5 * line.quantity for line in lines],
            reward=reward,
            done=done,
            metadata={"step": self._state.step_count, "difficulty": self._state.difficulty},
        )

    @property
    def state(self) -> WarehouseState:
        return self._state
