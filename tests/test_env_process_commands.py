"""An env process runs any episode-changing command by name (issue 38): the front sends a
sub-batch the batch method's name and that method's args (``calls.batch_args`` /
``part_args``: split by env, re-keyed to local indices), the env process calls the
batch's method of that name, and the answer comes back by its type. So a new command is
its args dataclass and its batch method: ``calls.py``, ``frames.py``, ``spread.py`` and
``env_process.py`` name no command (checked here on their source), and a command none of
them knows runs over two blocks as reset, step and restore do.

The env processes here are in this process (their frame handlers, on a socket-less pool),
so what each batch was called with can be read back.
"""

from __future__ import annotations

import ast
import asyncio
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import grpc
import pytest

from openenv_grpc.environment import AutoresetMode
from openenv_grpc.server.errors import RowError
from openenv_grpc.server.isolated import env_process, spread
from openenv_grpc.server.local.batch import Autoresets, BatchOutcome
from openenv_grpc.server.local.calls import PER_ENV, ResetArgs, RestoreArgs, StepArgs
from openenv_grpc.server.local.frames import command_frame, read_command
from openenv_grpc.server.model.snapshots import Captured
from openenv_grpc.server.model.spec import EnvSpec
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import snapshot_pb2
from openenv_grpc_envs.echo import EchoAction, EchoEnvironment, EchoResetOptions

ROOT = Path(__file__).resolve().parents[1] / "openenv_grpc" / "server"
RUNNING = snapshot_pb2.SNAPSHOT_PHASE_RUNNING
ENDED = snapshot_pb2.SNAPSHOT_PHASE_TERMINATED


class _Recording:
    """A sub-batch that records each call (method, args) and answers a plain outcome."""

    native = False

    def __init__(self, calls: list[tuple[str, tuple[Any, ...]]]) -> None:
        self.calls = calls

    def __getattr__(self, method: str) -> Any:
        def run(*args: Any) -> Any:
            self.calls.append((method, args))
            if method == "restore" or method == "frob":
                return {args[0][0]: RowError(5, "no such thing")}  # its first env
            indices = args[0]
            return BatchOutcome(
                rows=list(indices), observations=[b""] * len(indices),
                rewards=[1.0] * len(indices), terminated=[False] * len(indices),
                truncated=[False] * len(indices),
            )  # fmt: skip

        return run


class _InProcessPool:
    """Hands each frame to the in-process worker's handler of its op."""

    budget = None
    call_timeout = 10.0

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.frames: list[bytes] = []

    async def call(self, worker: Any, env_id: int, op: int, frame: bytes, **_: Any) -> Any:
        self.frames.append(frame)
        return await env_process._OPS[op](self.worker, env_id, frame)


async def _two_blocks() -> tuple[spread.SpreadBatchCalls, _InProcessPool, list[list[Any]]]:
    """A stream of four envs as two blocks of two, each batch recording its calls."""
    worker = env_process._Worker(EnvSpec.from_factory(EchoEnvironment), None, 0)
    recorded: list[list[Any]] = [[], []]
    for env_id in (1, 2):
        status, _ = await worker.create(env_id, env_process.BLOCK_OPEN.pack(2, 0, 0))
        assert status == env_process.Status.OK
        worker.blocks[env_id]._batch = _Recording(recorded[env_id - 1])
    pool = _InProcessPool(worker)
    blocks = [spread._Block(None, 1, 0, 2), spread._Block(None, 2, 2, 2)]  # type: ignore[arg-type]
    calls = spread.SpreadBatchCalls(
        pool,  # type: ignore[arg-type]
        blocks, AutoresetMode.NEXT_STEP, False, spread.VECTOR_BLOCKS,
    )  # fmt: skip
    return calls, pool, recorded


def test_a_step_reaches_each_blocks_batch_with_its_actions_and_autoresets_local() -> None:
    async def run() -> None:
        calls, _, recorded = await _two_blocks()
        options = EchoResetOptions(max_steps=4)
        actions = [EchoAction(message=m) for m in "abc"]
        autoresets = Autoresets({1: "id1", 3: "id3"}, {3: options})
        outcome = await calls.step(StepArgs([0, 1, 3], actions, False, None, autoresets))
        assert outcome.rows == [0, 1, 3]
        [(method, args)] = recorded[0]
        assert method == "step"
        assert args[0] == [0, 1] and args[1] == actions[:2] and args[2] is False
        assert args[3].episode_ids == {1: "id1"} and args[3].options == {}
        [(method, args)] = recorded[1]
        assert args[0] == [1] and args[1] == actions[2:]  # env 3: local index 1
        assert args[3].episode_ids == {1: "id3"} and args[3].options == {1: options}

    asyncio.run(run())


def test_a_reset_reaches_each_blocks_batch_with_its_own_seeds_ids_and_options() -> None:
    async def run() -> None:
        calls, _, recorded = await _two_blocks()
        options = [None, EchoResetOptions(max_steps=2), None]
        outcome = await calls.reset(
            ResetArgs([0, 2, 3], [7, None, 9], ["a", "b", "c"], options, False)
        )
        assert outcome.rows == [0, 2, 3]
        assert recorded[0] == [("reset", ([0], [7], ["a"], [None], False))]
        assert recorded[1] == [("reset", ([0, 1], [None, 9], ["b", "c"], options[1:], False))]

    asyncio.run(run())


def test_a_restore_sends_only_the_authenticated_env_bytes_and_phase() -> None:
    async def run() -> None:
        calls, pool, recorded = await _two_blocks()
        captured = [
            Captured("episode-secret-a", 41, RUNNING, b"state-a"),
            Captured("episode-secret-b", 42, ENDED, b"state-b"),
        ]
        failed = await calls.restore(RestoreArgs([1, 2], captured))
        assert recorded[0] == [("restore", ([1], [b"state-a"], [False]))]
        assert recorded[1] == [("restore", ([0], [b"state-b"], [True]))]
        # each block's error, by its local index, comes back by the env's
        assert failed == {1: RowError(5, "no such thing"), 2: RowError(5, "no such thing")}
        for frame in pool.frames:
            assert b"episode-secret" not in frame
            what, method, envs, args = read_command(frame)
            assert (what, method, envs) == ("restore", "restore", 1)
            assert all(isinstance(a, (bytes, bool, int)) for part in args for a in part)

    asyncio.run(run())


@dataclass(slots=True)
class _FrobArgs:
    """A command no module of the server knows: its args, and the batch's ``frob``."""

    indices: Sequence[int]
    values: Sequence[EchoAction] = field(metadata=PER_ENV)
    outcome: ClassVar[Any] = dict


def test_a_command_nobody_names_runs_over_the_blocks_by_its_name() -> None:
    async def run() -> None:
        calls, _, recorded = await _two_blocks()
        values = [EchoAction(message="x"), EchoAction(message="y")]
        failed = await calls.command("frob", _FrobArgs([1, 3], values))
        assert recorded[0] == [("frob", ([1], values[:1]))]
        assert recorded[1] == [("frob", ([1], values[1:]))]
        assert failed == {1: RowError(5, "no such thing"), 3: RowError(5, "no such thing")}

    asyncio.run(run())


def _literals(tree: ast.AST) -> set[str]:
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)} & {
        "step", "reset", "restore",
    }  # fmt: skip


def test_the_isolated_path_names_no_episode_changing_command() -> None:
    """Only ``calls.Commands`` names them: the driver's names for ``command``."""
    for path in ("local/frames.py", "isolated/spread.py", "isolated/env_process.py"):
        assert _literals(ast.parse((ROOT / path).read_text())) == set(), path
    tree = ast.parse((ROOT / "local/calls.py").read_text())
    for node in tree.body:
        if not (isinstance(node, ast.ClassDef) and node.name == "Commands"):
            assert _literals(node) == set(), ast.unparse(node)[:80]


def test_a_frame_rebuilds_only_data_messages_and_named_records() -> None:
    """The front's frames are JSON with blobs, read back into JSON data, bytes, messages
    of a class the process has, and the records the frames module names: a frame naming
    anything else is refused, never built (no pickle: tests/test_no_pickle.py)."""
    options = EchoResetOptions(max_steps=3)
    args = ([0, 2], [EchoAction(message="a"), EchoAction(message="b")], [b"\x00state", b""],
            {1: "id"}, Autoresets({1: "id"}, {1: options}), range(2), None)  # fmt: skip
    what, method, envs, back = read_command(command_frame("step", "step", 2, args))
    assert (what, method, envs) == ("step", "step", 2)
    assert back == ([0, 2], list(args[1]), [b"\x00state", b""], {1: "id"},
                    Autoresets({1: "id"}, {1: options}), [0, 1], None)  # fmt: skip
    with pytest.raises(TypeError, match="cannot carry a object"):
        command_frame("step", "step", 1, (object(),))
    for forged in ({"r": "StepArgs", "f": {}}, {"r": "os.system", "f": {}}):
        text = json.dumps(["step", "step", 1, [forged]]).encode()
        with pytest.raises(KeyError):
            read_command(struct.pack("<I", len(text)) + text)
    forged_message = json.dumps(["step", "step", 1, [{"m": "no.such.Message", "b": [0, 1]}]])
    with pytest.raises(KeyError):
        read_command(struct.pack("<I", len(forged_message)) + forged_message.encode() + b"x")


def test_a_frame_the_env_process_cannot_read_is_refused_and_the_process_goes_on() -> None:
    async def run() -> None:
        calls, pool, recorded = await _two_blocks()
        status, answer = await env_process._OPS[env_process.Op.REQUEST](
            pool.worker, 1, b"\x05\x00\x00\x00nope!"
        )
        refused = env_process.Status.CALL_REFUSED
        assert refused <= status < refused + env_process.REFUSAL_FLAGS
        error = pb.VectorSessionResponse.FromString(answer).error
        assert error.code == grpc.StatusCode.INTERNAL.value[0]
        assert error.message.startswith("the env process could not answer the call: ")
        # The process and its blocks go on: the next frame is answered.
        actions = [EchoAction(message=m) for m in "abc"]
        outcome = await calls.step(StepArgs([0, 1, 3], actions, False))
        assert outcome.rows == [0, 1, 3] and len(recorded[0]) == 1

    asyncio.run(run())
