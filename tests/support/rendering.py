"""An echo env that draws as its reset seed says, for the render tests: every way an env's
``render()`` can answer, one seed each."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from openenv_grpc.environment import Rendering
from openenv_grpc.v1.session_pb2 import Frame, Image
from support.envs import CountingEchoEnv

#: Seed -> what render() does (any other seed: the text ``steps=<step count>``).
NO_FRAME, RAISES, IMAGE, NOT_HERE, FLOAT_IMAGE, WIDE_TEXT = 1, 2, 3, 4, 5, 6
EMPTY_FRAME, SHORT_PIXELS, SEVEN_CHANNELS, ZERO_SIZE, LYING_ARRAY, NEGATIVE_SHAPE = (
    7, 8, 9, 10, 11, 12,
)  # fmt: skip
#: WIDE_TEXT, and each such render appends a line to ``<ledger>.renders``.
COUNTED_WIDE = 13
#: The render ends the process (as a crashing native renderer would).
EXITS = 14
#: Characters of a WIDE_TEXT frame.
WIDE = 5_000


class _LyingArray:
    """Says it is a 2 x 3 RGB uint8 array; its bytes are 5."""

    shape = (2, 3, 3)
    dtype = np.dtype(np.uint8)

    def tobytes(self) -> bytes:
        return b"12345"


class _NegativeArray(_LyingArray):
    shape = (-1, 3)  # type: ignore[assignment]


class RenderingEchoEnv(CountingEchoEnv):
    """The counting echo env with a ``render()`` chosen by its reset seed."""

    def render(self) -> Rendering:
        seed, steps = self._seed, self._steps
        drawn: Any = {
            NO_FRAME: 42,  # the contract broken on purpose, as in the cases below
            EMPTY_FRAME: Frame(),
            SHORT_PIXELS: Frame(image=Image(height=100, width=100, channels=3, pixels=b"abc")),
            SEVEN_CHANNELS: Frame(image=Image(height=1, width=1, channels=7, pixels=b"x" * 7)),
            ZERO_SIZE: np.zeros((0, 0, 3), dtype=np.uint8),
            LYING_ARRAY: _LyingArray(),
            NEGATIVE_SHAPE: _NegativeArray(),
            FLOAT_IMAGE: np.zeros((2, 3, 3), dtype=np.float32),
            WIDE_TEXT: "w" * WIDE,
        }.get(seed)
        if drawn is not None:
            return drawn  # type: ignore[no-any-return]
        if seed == RAISES:
            raise ValueError("the brush broke")
        if seed == IMAGE:  # 2 x 3 RGB, every byte the step count
            return np.full((2, 3, 3), steps, dtype=np.uint8)
        if seed == NOT_HERE:
            raise NotImplementedError("this configuration draws nothing")
        if seed == COUNTED_WIDE:
            with open(f"{os.environ['OPENENV_TEST_LEDGER']}.renders", "a") as renders:
                renders.write("render\n")
            return "w" * WIDE
        if seed == EXITS:
            with open(f"{os.environ['OPENENV_TEST_LEDGER']}.exits", "a") as exits:
                exits.write("exit\n")
            os._exit(3)
        return f"steps={steps}"
