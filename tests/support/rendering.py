"""An echo env that draws as its reset seed says, for the render tests: every way an env's
``render()`` can answer, one seed each."""

from __future__ import annotations

import numpy as np

from openenv_grpc.environment import Rendering
from support.envs import CountingEchoEnv

#: Seed -> what render() does (any other seed: the text ``steps=<step count>``).
NO_FRAME, RAISES, IMAGE, NOT_HERE, FLOAT_IMAGE, WIDE_TEXT = 1, 2, 3, 4, 5, 6
#: Characters of a WIDE_TEXT frame.
WIDE = 5_000


class RenderingEchoEnv(CountingEchoEnv):
    """The counting echo env with a ``render()`` chosen by its reset seed."""

    def render(self) -> Rendering:
        seed, steps = self._seed, self._steps
        if seed == NO_FRAME:
            return 42  # type: ignore[return-value]  # the contract broken on purpose
        if seed == RAISES:
            raise ValueError("the brush broke")
        if seed == IMAGE:  # 2 x 3 RGB, every byte the step count
            return np.full((2, 3, 3), steps, dtype=np.uint8)
        if seed == NOT_HERE:
            raise NotImplementedError("this configuration draws nothing")
        if seed == FLOAT_IMAGE:
            return np.zeros((2, 3, 3), dtype=np.float32)
        if seed == WIDE_TEXT:
            return "w" * WIDE
        return f"steps={steps}"
