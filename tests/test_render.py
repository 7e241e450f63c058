"""The render command over both streams, in process and with ``--isolated``, over real gRPC
against real server processes.

Most tests use ``RenderingEchoEnv`` (tests/support/rendering.py), whose reset seed picks
how its ``render()`` answers: text, an image, no frame, a raise, UNIMPLEMENTED, a float
image. Each error is checked for its code and message, for the episode going on
unchanged (and, on a vector stream, for the neighbours' frames), and each test ends with
no env left open and no slot held.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from openenv_grpc import frame_array
from openenv_grpc.client import EnvError, Recovery, SessionLost, VectorEnvError
from openenv_grpc.client.errors import InvalidRequest
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.echo import EchoAction, EchoEnv, EchoVectorEnv
from openenv_grpc_envs.gymnasium import GymnasiumEnv, GymnasiumResetOptions, GymnasiumVectorEnv
from openenv_grpc_envs.gymnasium.convert import to_numpy
from openenv_grpc_envs.openspiel import OpenSpielEnv, OpenSpielResetOptions
from support.rendering import (
    COUNTED_WIDE,
    EMPTY_FRAME,
    EXITS,
    FLOAT_IMAGE,
    IMAGE,
    LYING_ARRAY,
    NEGATIVE_SHAPE,
    NO_FRAME,
    NOT_HERE,
    RAISES,
    SEVEN_CHANNELS,
    SHORT_PIXELS,
    WIDE,
    WIDE_TEXT,
    ZERO_SIZE,
)
from support.servers import started_together

pytestmark = pytest.mark.timeout(120)

TESTS = Path(__file__).resolve().parent
RENDERING = "support.rendering:RenderingEchoEnv"
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED
INTERNAL = grpc.StatusCode.INTERNAL
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
PLACEMENTS = ["in_process", "isolated"]


#: A uint8 image array of this shape is refused, naming it.
def _bad_shape(shape: str, dtype: str = "uint8") -> str:
    return (
        f"environment returned an image of shape {shape} and dtype {dtype} from render(); "
        "a frame is uint8, (height, width) or (height, width, 1 | 3 | 4)"
    )


#: seed -> the code and the message of its render's in-band error.
FAILURES = {
    NO_FRAME: (INTERNAL, "environment returned a int from render(), not text or an image array"),
    RAISES: (INTERNAL, "render failed: ValueError: the brush broke"),
    NOT_HERE: (
        UNIMPLEMENTED,
        "render is not supported: this configuration draws nothing; the episode goes on",
    ),
    FLOAT_IMAGE: (INTERNAL, _bad_shape("(2, 3, 3)", "float32")),
    EMPTY_FRAME: (INTERNAL, "environment returned an empty Frame from render(): no frame"),
    SHORT_PIXELS: (
        INTERNAL,
        "environment rendered 3 pixel bytes for an image of 100 x 100 x 3",
    ),
    SEVEN_CHANNELS: (
        INTERNAL,
        "environment rendered an image of 1 x 1 x 7; an image has rows, pixels per row, "
        "and 1, 3 or 4 channels",
    ),
    ZERO_SIZE: (INTERNAL, _bad_shape("(0, 0, 3)")),
    LYING_ARRAY: (INTERNAL, "environment rendered 5 pixel bytes for an image of 2 x 3 x 3"),
    NEGATIVE_SHAPE: (INTERNAL, _bad_shape("(-1, 3)")),
}


class Ledgered(ServerProcess):
    """A server whose test envs record their creation and close in ``ledger``."""

    def __init__(self, env: str, ledger: Path, *args: str) -> None:
        ledger.mkdir()
        self.ledger = ledger
        super().__init__(env, args, {"OPENENV_TEST_LEDGER": str(ledger)}, pythonpath=[TESTS])

    def settled(self) -> None:
        """Every env of the closed streams is closed and every slot free."""
        self.wait_until(lambda: self.active() == 0 and not list(self.ledger.glob("*.open")))


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """The module's servers, by role; started once."""
    root = tmp_path_factory.mktemp("render-ledgers")
    makers: dict[str, Callable[[], ServerProcess]] = {
        "in_process": lambda: Ledgered(RENDERING, root / "in_process"),
        "isolated": lambda: Ledgered(RENDERING, root / "isolated", "--isolated", "2"),
        "tight": lambda: Ledgered(RENDERING, root / "tight", "--max-message-bytes", "16384"),
        "async": lambda: Ledgered("support.envs:AsyncEchoEnv", root / "async"),
        "gym_in_process": lambda: ServerProcess("gymnasium"),
        "gym_isolated": lambda: ServerProcess("gymnasium", ["--isolated", "2"]),
    }
    with started_together(makers) as made:
        yield made


def say(n: int) -> list[EchoAction]:
    return [EchoAction(message="hi") for _ in range(n)]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_session_renders_text_and_images_without_changing_the_episode(
    servers: dict[str, Ledgered], placement: str
) -> None:
    server = servers[placement]
    with EchoEnv(server.target) as env:
        env.reset(seed=0)
        env.step(EchoAction(message="a"))
        frame = env.render()
        assert frame.WhichOneof("content") == "text" and frame.text == "steps=1"
        env.reset(seed=IMAGE)
        env.step(EchoAction(message="a"))
        env.step(EchoAction(message="b"))
        image = frame_array(env.render())
        assert image.dtype == np.uint8 and image.shape == (2, 3, 3)
        assert (image == 2).all()
        assert env.render() == env.render()  # rendering twice changes nothing either
        assert env.step(EchoAction(message="c")).step_count == 3  # the episode went on
    server.settled()


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("seed", sorted(FAILURES))
def test_a_render_that_fails_is_an_in_band_error_and_the_session_goes_on(
    servers: dict[str, Ledgered], placement: str, seed: int
) -> None:
    server = servers[placement]
    code, message = FAILURES[seed]
    with EchoEnv(server.target) as env:
        env.reset(seed=seed)
        env.step(EchoAction(message="a"))
        with pytest.raises(EnvError) as caught:
            env.render()
        assert caught.value.code == code and caught.value.message == message
        if seed == RAISES:
            assert caught.value.exception_type == "builtins.ValueError"
        outcome = env.step(EchoAction(message="b"))
        assert outcome.step_count == 2 and outcome.observation.echoed_message == "b"
    server.settled()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_vector_renders_per_env_and_a_failing_env_keeps_its_neighbours(
    servers: dict[str, Ledgered], placement: str
) -> None:
    server = servers[placement]
    seeds = [0, NO_FRAME, IMAGE, RAISES, NOT_HERE, FLOAT_IMAGE, 0]
    with EchoVectorEnv(server.target, len(seeds)) as envs:
        envs.reset(seeds=seeds)
        assert not envs.step(say(len(seeds))).errors
        frames = envs.render(indices=[0, 2, 6])
        assert [frame.WhichOneof("content") for frame in frames] == ["text", "image", "text"]
        assert frames[0].text == frames[2].text == "steps=1"
        assert (frame_array(frames[1]) == 1).all()
        with pytest.raises(VectorEnvError) as caught:
            envs.render()
        failed = caught.value
        assert failed.done == [0, 2, 6]
        assert sorted(failed.results) == [0, 2, 6]  # the neighbours' frames come along
        assert [failed.results[i] for i in (0, 2, 6)] == frames
        assert sorted(failed.errors) == [1, 3, 4, 5]
        for index, error in failed.errors.items():
            code, message = FAILURES[seeds[index]]
            assert error.code == code and message in error.message
        stepped = envs.step(say(len(seeds)))  # every episode went on, unchanged
        assert not stepped.errors and list(stepped.step_counts) == [2] * len(seeds)
    server.settled()


def test_bad_render_indices_refuse_the_request_and_the_stream_goes_on(
    servers: dict[str, Ledgered],
) -> None:
    server = servers["in_process"]
    with EchoVectorEnv(server.target, 3) as envs:
        envs.reset()
        for indices in ([3], [1, 1], [2, 0]):
            with pytest.raises(EnvError) as caught:
                envs.render(indices=indices)
            assert caught.value.code == INVALID_ARGUMENT
        for bad in ([-1], [2**32], [1.5], ["01"]):  # no env index: refused, nothing sent
            with pytest.raises(InvalidRequest, match="indices must be env indices"):
                envs.render(indices=bad)  # type: ignore[list-item]
            with pytest.raises(InvalidRequest, match="indices must be env indices"):
                envs.step(say(1), indices=bad)  # type: ignore[list-item]
        assert [frame.text for frame in envs.render()] == ["steps=0"] * 3
    server.settled()


def test_frames_over_the_message_limit_refuse_the_request_and_fewer_fit(
    servers: dict[str, Ledgered],
) -> None:
    """8 frames of 5,000 characters are over a 16 KiB message: the whole render is
    RESOURCE_EXHAUSTED (the server stops reading frames once over); two fit."""
    server = servers["tight"]
    with EchoVectorEnv(server.target, 8) as envs:
        envs.reset(seeds=[WIDE_TEXT] * 8)
        with pytest.raises(EnvError) as caught:
            envs.render()
        assert caught.value.code == RESOURCE_EXHAUSTED
        assert "the render response is at least" in caught.value.message
        assert "--max-message-bytes" in caught.value.message
        assert [len(frame.text) for frame in envs.render(indices=[3, 4])] == [WIDE, WIDE]
        assert not envs.step(say(8)).errors
    server.settled()


def test_frames_past_small_ones_are_read_no_further_than_the_limit_allows(
    servers: dict[str, Ledgered],
) -> None:
    """Envs 0-3 draw a few bytes, 4-11 5,000 each (16 KiB limit): the first read (4 envs)
    says little of the others, so the next reads at most as many again. Four wide frames
    are made, not all eight, before the request is refused."""
    server = servers["tight"]
    renders = Path(f"{server.ledger}.renders")
    with EchoVectorEnv(server.target, 12) as envs:
        envs.reset(seeds=[0] * 4 + [COUNTED_WIDE] * 8)
        with pytest.raises(EnvError) as caught:
            envs.render()
        assert caught.value.code == RESOURCE_EXHAUSTED
        assert renders.read_text().count("render") == 4
        assert [len(frame.text) for frame in envs.render(indices=[4, 5, 6])] == [WIDE] * 3
    server.settled()


def test_a_render_that_ends_its_env_process_is_not_retried_past_two_recoveries(
    tmp_path: Path,
) -> None:
    """With recovery, a call that loses the stream is made again on a fresh one; a
    render that kills its env process each time is given up on after two recoveries
    (three exits), not repeated for ``within`` seconds. (A server of its own: envs of a
    killed process never record their close.)"""
    server = Ledgered(RENDERING, tmp_path / "ledger", "--isolated", "2")
    try:
        exits = Path(f"{server.ledger}.exits")
        with EchoEnv(server.target, recovery=Recovery(every=1, within=30)) as env:
            env.reset(seed=EXITS)
            with pytest.raises(SessionLost) as caught:
                env.render()
            assert "this call lost the stream again after 2 recoveries" in caught.value.message
            assert env.recoveries == 2
        assert exits.read_text().count("exit") == 3
        with EchoEnv(server.target) as env:  # the server goes on, env processes replaced
            env.reset(seed=0)
            assert env.render().text == "steps=0"
        server.wait_until(lambda: server.active() == 0)
    finally:
        server.stop()


def test_an_env_without_render_is_unimplemented_on_both_streams(
    servers: dict[str, Ledgered],
) -> None:
    """An asyncio env that does not override render (the async loop's path)."""
    server = servers["async"]
    expected = "render is not supported: AsyncEchoEnv does not render; the episode goes on"
    with EchoEnv(server.target) as env:
        env.reset()
        with pytest.raises(EnvError) as caught:
            env.render()
        assert caught.value.code == UNIMPLEMENTED and caught.value.message == expected
        assert env.step(EchoAction(message="a")).step_count == 1
    with EchoVectorEnv(server.target, 2) as envs:
        envs.reset()
        with pytest.raises(VectorEnvError) as vector_caught:
            envs.render()
        assert sorted(vector_caught.value.errors) == [0, 1]
        assert all(e.code == UNIMPLEMENTED for e in vector_caught.value.errors.values())
    servers["async"].settled()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_gymnasium_frames_are_the_envs_own_on_both_streams(
    servers: dict[str, ServerProcess], placement: str
) -> None:
    """CartPole made with render_mode="rgb_array": render() is the frame state() carries
    (both are the env's render() at that moment), 400 x 600 x 3; without a render mode,
    UNIMPLEMENTED naming the option; before a reset, INVALID_ARGUMENT. A vector's envs are
    the env's native batch in process (GymnasiumBatch.render), a loop when isolated."""
    server = servers[f"gym_{placement}"]
    drawing = GymnasiumResetOptions(env_id="CartPole-v1", render_mode="rgb_array")
    with GymnasiumEnv(server.target) as env:
        with pytest.raises(EnvError) as caught:
            env.render()
        assert caught.value.code == INVALID_ARGUMENT and "reset first" in caught.value.message
        env.reset(seed=3, options=GymnasiumResetOptions(env_id="CartPole-v1"))
        with pytest.raises(EnvError) as caught:
            env.render()
        assert caught.value.code == UNIMPLEMENTED
        assert 'render_mode="rgb_array"' in caught.value.message
        env.reset(seed=3, options=drawing)
        image = frame_array(env.render())
        assert image.shape == (400, 600, 3) and image.dtype == np.uint8
        assert np.array_equal(image, to_numpy(env.state().frame))
    with GymnasiumVectorEnv(server.target, 3) as envs:
        envs.reset(seeds=[1, 2, 3], options=[drawing] * 3)
        frames = [frame_array(frame) for frame in envs.render()]
        states = envs.states()
        assert len(frames) == 3
        for frame, state in zip(frames, states, strict=True):
            assert np.array_equal(frame, to_numpy(state.frame))
        assert not np.array_equal(frames[0], frames[1])  # seeded apart: carts differ


def test_openspiel_renders_the_board_as_text() -> None:
    server = ServerProcess("openspiel")
    try:
        with OpenSpielEnv(server.target) as env:
            env.reset(seed=1, options=OpenSpielResetOptions(game="tic_tac_toe"))
            frame = env.render()
            assert frame.WhichOneof("content") == "text"
            assert frame.text == env.state().state_string
            assert frame.text.count("\n") == 2  # three rows of the board
    finally:
        server.stop()
