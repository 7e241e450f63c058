"""An env process of ``--isolated`` (the env process pool's worker), and the frames it
exchanges with the front.

An env process hosts env instances for the front (``env_process_pool.py``) and answers
one frame at a time, in the order the frames arrive, with the same request handler as the
in-process path (:class:`~openenv_grpc.server.episode.EpisodeDriver`). It talks to the
front over one socket pair with asyncio streams; nothing is pickled after start-up (only
the factory reference, once, to spawn the process).

A frame is a fixed header and a payload of ``length`` bytes::

    length: u32 | env id: u64 | operation (front) or status (worker): u8

The worker answers every frame it reads with exactly one frame, in the order it read
them, so the front matches answers to calls by their order and knows which call a worker
is busy with. The only other frame is READY, sent once when the worker is up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import socket
import struct
from collections.abc import Callable
from typing import Any

from openenv_grpc.server.backend import Answer, Outcome, UndecodableRequest
from openenv_grpc.server.episode import EpisodeDriver
from openenv_grpc.server.runner import EnvRunner
from openenv_grpc.server.snapshots import SnapshotSeal
from openenv_grpc.server.spec import EnvSpec, ExecutionMode

__all__ = ["HEADER", "READ_LIMIT", "Op", "Status", "answer_status", "answered", "worker_main"]

log = logging.getLogger(__name__)

#: Payload length, env id, operation or status.
HEADER = struct.Struct("<IQB")
#: Stream buffer size: large frames are read in big chunks, not 64 KiB ones.
READ_LIMIT = 1 << 20


class Op:
    """Front -> worker operations."""

    CREATE, REQUEST, CLOSE = 1, 2, 3


class Status:
    """Worker -> front statuses. OK: an env was created or closed; FAILED: its factory
    raised; UNDECODABLE: a request did not parse; READY: sent once, when the worker is up,
    env id 0. An answered request has status ``ANSWER + outcome`` (plus ``ENDS`` when the
    stream must end after it): the driver's :class:`~openenv_grpc.server.backend.Answer`,
    which the front rebuilds without parsing the response."""

    OK, FAILED, UNDECODABLE, READY = 0, 2, 3, 5
    ANSWER, ENDS = 16, 8


def answer_status(answer: Answer) -> int:
    """The status byte that carries ``answer``'s outcome (and whether the stream ends)."""
    return Status.ANSWER + int(answer.outcome) + (Status.ENDS if answer.ends else 0)


def answered(status: int) -> tuple[Outcome, bool]:
    """The outcome and the end-of-stream flag an answer's status byte carries."""
    code = status - Status.ANSWER
    return Outcome(code & ~Status.ENDS), bool(code & Status.ENDS)


def worker_main(
    sock: socket.socket,
    factory: Callable[[], Any],
    call_timeout: float | None,
    snapshots: SnapshotSeal | None = None,
) -> None:
    """Entry point of a worker process: serve frames until the front goes away.

    ``snapshots`` is the front's seal, key ring included: it arrives through the spawn's
    private pipe (never the environment or a command line), so every env process signs
    and verifies exactly as the front's server would.
    """
    # Ctrl-C reaches the whole process group: the front drains and then ends its workers,
    # so a worker must not die first and take its envs with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    asyncio.run(_serve(sock, factory, call_timeout, snapshots))


async def _serve(
    sock: socket.socket,
    factory: Callable[[], Any],
    call_timeout: float | None,
    snapshots: SnapshotSeal | None,
) -> None:
    spec = EnvSpec.from_factory(factory)
    if spec.mode is ExecutionMode.POOL:
        # The worker is the env's own process: blocking calls run inline, one at a time.
        spec = dataclasses.replace(spec, mode=ExecutionMode.INLINE)
    reader, writer = await asyncio.open_unix_connection(sock=sock, limit=READ_LIMIT)
    drivers: dict[int, EpisodeDriver] = {}

    async def new_runner() -> EnvRunner:
        return await EnvRunner.create(spec, pool=_NO_POOL)

    async def answer(env_id: int, status: int, payload: bytes = b"") -> None:
        writer.write(HEADER.pack(len(payload), env_id, status) + payload)
        await writer.drain()

    try:
        await answer(0, Status.READY)
        while True:
            length, env_id, op = HEADER.unpack(await reader.readexactly(HEADER.size))
            payload = await reader.readexactly(length) if length else b""
            if op == Op.REQUEST:
                try:
                    done = await drivers[env_id].handle(payload)
                except UndecodableRequest as exc:
                    await answer(env_id, Status.UNDECODABLE, str(exc).encode())
                    continue
                await answer(env_id, answer_status(done), done.response)
            elif op == Op.CREATE:
                try:
                    runner = await new_runner()
                    drivers[env_id] = EpisodeDriver(
                        spec, runner, new_runner, call_timeout, snapshots
                    )
                except Exception as exc:
                    log.exception("environment factory raised")
                    message = f"{type(exc).__name__}: {exc}".encode()
                    await answer(env_id, Status.FAILED, message)
                    continue
                await answer(env_id, Status.OK)
            elif op == Op.CLOSE:
                closing = drivers.pop(env_id, None)
                if closing is not None:
                    await closing.close()
                await answer(env_id, Status.OK)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass  # the front is gone (or ended this worker): close what is left
    finally:
        for driver in drivers.values():
            await driver.close()


class _NoPool:
    """Inline and async envs never use the pool; the worker has none."""

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("isolated workers run env calls inline")


_NO_POOL: Any = _NoPool()
