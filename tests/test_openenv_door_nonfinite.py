"""Issue 37: the door's ``/ws`` observation frame is written strictly (no walk) when JSON
can write it, and an info holding a NaN is written as ``null`` there, never as a bare
``NaN`` token, as OpenEnv's server writes it (such an info crosses the core as a Struct, so
its numbers arrive as doubles). A real serve process of an env whose step
info carries every JSON type, plus a NaN on the message ``"nan"``."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from openenv_grpc.testing import ServerProcess

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
from test_openenv_gateway import gateway_url  # noqa: E402

from support.info_envs import BIG, HUGE, typed_info  # noqa: E402


@pytest.fixture(scope="module")
def door() -> Iterator[str]:
    process = ServerProcess(
        "support.info_envs:TypedInfoEcho", ["--openenv-port", "0"], pythonpath=[TESTS]
    )
    try:
        yield gateway_url(process)
    finally:
        process.stop()


def _steps(url: str, messages: list[str]) -> list[str]:
    """The raw text of the observation frame answering a step of each message."""

    async def run() -> list[str]:
        async with websockets.connect(url.replace("http", "ws", 1) + "/ws") as ws:
            await ws.send(json.dumps({"type": "reset", "data": {}}))
            await ws.recv()
            frames = []
            for message in messages:
                await ws.send(json.dumps({"type": "step", "data": {"message": message}}))
                frames.append(str(await ws.recv()))
            return frames

    return asyncio.run(run())


def test_a_finite_info_arrives_whole_with_its_types(door: str) -> None:
    (raw,) = _steps(door, ["hi"])
    frame: dict[str, Any] = json.loads(raw)
    assert frame["type"] == "observation"
    assert frame["data"]["metadata"] == typed_info(1)
    assert frame["data"]["metadata"]["huge"] == HUGE and frame["data"]["metadata"]["big"] == BIG


def test_a_nan_in_the_info_is_null_and_the_frame_is_strict_json(door: str) -> None:
    raw, after = _steps(door, ["nan", "hi"])
    assert "NaN" not in raw
    frame = json.loads(raw, parse_constant=lambda token: pytest.fail(f"bare {token}"))
    metadata = frame["data"]["metadata"]
    # An info JSON cannot write travels as a Struct: its numbers arrive as doubles.
    assert metadata["loss"] is None
    assert (metadata["lives"], metadata["ratio"], metadata["flag"]) == (3, 0.5, True)
    assert metadata["big"] == float(BIG)
    assert frame["data"]["observation"]["metadata"]["loss"] is None
    # The next frame takes the strict path again, with the info's own types.
    assert json.loads(after)["data"]["metadata"] == typed_info(2)
