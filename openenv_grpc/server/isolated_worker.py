"""The worker process of the isolated pool, and the frames it exchanges with the front.

A worker hosts env instances for the front (``isolated.py``) and answers one frame at a
time, in the order the frames arrive, with the same request handler as the in-process
path. It talks to the front over one socket pair with asyncio streams; nothing is
pickled after start-up (only the factory reference, once, to spawn the worker).

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

from openenv_grpc.server.backend import LocalBackend, UndecodableRequest
from openenv_grpc.server.runner import EnvRunner
from openenv_grpc.server.spec import EnvSpec, ExecutionMode

__all__ = ["HEADER", "READ_LIMIT", "Op", "Status", "worker_main"]

log = logging.getLogger(__name__)

#: Payload length, env id, operation or status.
HEADER = struct.Struct("<IQB")
#: Stream buffer size: large frames are read in big chunks, not 64 KiB ones.
READ_LIMIT = 1 << 20


class Op:
    """Front -> worker operations."""

    CREATE, REQUEST, CLOSE = 1, 2, 3


class Status:
    """Worker -> front statuses. STEPPED: an answered step, which the front counts (it
    forwards request bytes without parsing them). READY: sent once, when the
    worker is up, env id 0."""

    OK, CLOSED, FAILED, UNDECODABLE, STEPPED, READY = 0, 1, 2, 3, 4, 5


def worker_main(
    sock: socket.socket, factory: Callable[[], Any], call_timeout: float | None
) -> None:
    """Entry point of a worker process: serve frames until the front goes away."""
    # Ctrl-C reaches the whole process group: the front drains and then ends its workers,
    # so a worker must not die first and take its envs with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    asyncio.run(_serve(sock, factory, call_timeout))


async def _serve(
    sock: socket.socket, factory: Callable[[], Any], call_timeout: float | None
) -> None:
    spec = EnvSpec.from_factory(factory)
    if spec.mode is ExecutionMode.POOL:
        # The worker is the env's own process: blocking calls run inline, one at a time.
        spec = dataclasses.replace(spec, mode=ExecutionMode.INLINE)
    reader, writer = await asyncio.open_unix_connection(sock=sock, limit=READ_LIMIT)
    backends: dict[int, LocalBackend] = {}
    steps = _StepFlag()

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
                backend = backends[env_id]
                steps.stepped = False
                try:
                    response = await backend.handle(payload)
                except UndecodableRequest as exc:
                    await answer(env_id, Status.UNDECODABLE, str(exc).encode())
                    continue
                if backend.closed:
                    await answer(env_id, Status.CLOSED, response)
                else:
                    await answer(env_id, Status.STEPPED if steps.stepped else Status.OK, response)
            elif op == Op.CREATE:
                try:
                    backends[env_id] = await LocalBackend.open(
                        spec, new_runner, call_timeout, steps
                    )
                except Exception as exc:
                    log.exception("environment factory raised")
                    message = f"{type(exc).__name__}: {exc}".encode()
                    await answer(env_id, Status.FAILED, message)
                    continue
                await answer(env_id, Status.OK)
            elif op == Op.CLOSE:
                closing = backends.pop(env_id, None)
                if closing is not None:
                    await closing.close()
                await answer(env_id, Status.OK)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass  # the front is gone (or ended this worker): close what is left
    finally:
        for backend in backends.values():
            await backend.close()


class _StepFlag:
    """The worker's metrics sink: notes that a request was a completed step, so the front
    can count it."""

    __slots__ = ("stepped",)

    def __init__(self) -> None:
        self.stepped = False

    def session_refused(self, reason: str) -> None:
        pass

    def session_ended(self, seconds: float, reason: str) -> None:
        pass

    def step(self, seconds: float) -> None:
        self.stepped = True

    def request_error(self, code: str) -> None:
        pass

    def pool_saturated(self) -> None:
        pass


class _NoPool:
    """Inline and async envs never use the pool; the worker has none."""

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("isolated workers run env calls inline")


_NO_POOL: Any = _NoPool()
