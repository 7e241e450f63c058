"""The wordle README's example runs against a real server and prints what it promises."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

from openenv_grpc.testing import ServerProcess

EXPECTED = """\
Guess the secret 5-letter word. You have 6 guesses.
speed ⬜⬜🟨⬜🟨 reward=0.10
refused: INVALID_ARGUMENT: 'xyzzy' is not in the word list
bride 🟨⬜🟩🟩🟩 reward=0.25
abide 🟩🟩🟩🟩🟩 reward=1.45
Correct! You found the word in 3 guesses.
S P E E D
X X Y X Y
B R I D E
Y X G G G
A B I D E
G G G G G
turn 1: ⬜⬜⬜⬜⬜ reward=0.00
turn 2: ⬜🟨🟨🟩⬜ reward=0.20
turn 3: 🟩🟩🟩🟩🟩 reward=1.60
won=True answer=fleet
state: episode_reward=1.80
"""


def test_readme_example_runs(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("wordle")
    out = subprocess.run(
        [sys.executable, "-m", "openenv_grpc_envs.wordle.example", server.target],
        capture_output=True,
        text=True,
        encoding="utf-8",
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},  # the squares, whatever the locale
        timeout=60,
        check=True,
    ).stdout
    assert out == EXPECTED
