"""Isolated execution: env instances live in a pool of worker processes.

The gRPC front (one process) keeps the sessions; each env lives in one worker process.
A session's request bytes go to its worker, which answers them with the same request
handler as the in-process path, and the response bytes come back unchanged. So a
segfault, ``os._exit`` or runaway memory in env code ends only the sessions on that
worker (their clients get UNAVAILABLE "session lost"), the pool starts a replacement, and
CPU-heavy envs use every core even when all streams share one HTTP/2 connection.

Frames between front and worker carry protobuf bytes behind an 9-byte header (env id,
operation); nothing is pickled after start-up (only the factory reference, once, to
spawn the worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import struct
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from openenv_grpc.server.backend import (
    EnvFactoryError,
    LocalBackend,
    SessionLostError,
    UndecodableRequest,
)
from openenv_grpc.server.metrics import NO_METRICS, Metrics
from openenv_grpc.server.runner import EnvRunner
from openenv_grpc.server.spec import EnvSpec, ExecutionMode

__all__ = ["IsolatedBackend", "IsolatedPool"]

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<QB")  # env id, operation or status
# Front -> worker operations.
_CREATE, _REQUEST, _CLOSE = 1, 2, 3
# Worker -> front statuses (_STEPPED: an answered step, which the front counts).
_OK, _CLOSED, _FAILED, _UNDECODABLE, _STEPPED = 0, 1, 2, 3, 4


# -- the worker process ---------------------------------------------------------------


def _worker_main(conn: Connection, factory: Callable[[], Any], call_timeout: float | None) -> None:
    """Entry point of a worker process: serve frames until the front goes away."""
    asyncio.run(_worker_loop(conn, factory, call_timeout))


async def _worker_loop(
    conn: Connection, factory: Callable[[], Any], call_timeout: float | None
) -> None:
    spec = EnvSpec.from_factory(factory)
    if spec.mode is ExecutionMode.POOL:
        # The worker is the env's own process: blocking calls run inline, one at a time.
        spec = dataclasses.replace(spec, mode=ExecutionMode.INLINE)
    backends: dict[int, LocalBackend] = {}
    loop = asyncio.get_running_loop()
    steps = _StepFlag()

    async def new_runner() -> EnvRunner:
        return await EnvRunner.create(spec, pool=_NO_POOL)

    while True:
        try:
            frame = await loop.run_in_executor(None, conn.recv_bytes)
        except (EOFError, OSError):
            break  # the front is gone
        env_id, op = _HEADER.unpack_from(frame)
        payload = frame[_HEADER.size :]
        if op == _REQUEST:
            backend = backends[env_id]
            steps.stepped = False
            try:
                answer = await backend.handle(payload)
            except UndecodableRequest as exc:
                conn.send_bytes(_HEADER.pack(env_id, _UNDECODABLE) + str(exc).encode())
                continue
            status = _CLOSED if backend.closed else _STEPPED if steps.stepped else _OK
            conn.send_bytes(_HEADER.pack(env_id, status) + answer)
        elif op == _CREATE:
            try:
                backends[env_id] = await LocalBackend.open(spec, new_runner, call_timeout, steps)
            except Exception as exc:
                log.exception("environment factory raised")
                message = f"{type(exc).__name__}: {exc}".encode()
                conn.send_bytes(_HEADER.pack(env_id, _FAILED) + message)
                continue
            conn.send_bytes(_HEADER.pack(env_id, _OK))
        elif op == _CLOSE:
            backend_to_close = backends.pop(env_id, None)
            if backend_to_close is not None:
                await backend_to_close.close()
            conn.send_bytes(_HEADER.pack(env_id, _OK))
    for backend in backends.values():
        await backend.close()


class _StepFlag:
    """The worker's metrics sink: notes that a request was a completed step, so the front
    can count it (the front forwards request bytes without parsing them)."""

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


# -- the front ----------------------------------------------------------------------


class _Worker:
    """One worker process and the replies it owes."""

    def __init__(self, process: Any, conn: Connection) -> None:
        self.process = process
        self.conn = conn
        self.waiting: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self.envs: set[int] = set()
        self.alive = True


class IsolatedPool:
    """Worker processes that host env instances for the sessions of this server."""

    def __init__(
        self,
        factory: Callable[[], Any],
        size: int,
        call_timeout: float | None,
        metrics: Metrics = NO_METRICS,
    ) -> None:
        if size < 1:
            raise ValueError(f"isolated pool size must be >= 1, got {size}")
        self.metrics = metrics
        self._factory = factory
        self._size = size
        self._call_timeout = call_timeout
        # spawn: the front already runs gRPC, which must never be forked.
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []
        self._next_env = 1

    def start(self) -> None:
        """Start the workers; call on the server's event loop."""
        for _ in range(self._size):
            self._workers.append(self._spawn())

    def _spawn(self) -> _Worker:
        front, back = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_worker_main,
            args=(back, self._factory, self._call_timeout),
            name="openenv-env-worker",
            daemon=True,
        )
        process.start()
        back.close()
        worker = _Worker(process, front)
        asyncio.get_running_loop().add_reader(front.fileno(), self._on_readable, worker)
        return worker

    def _on_readable(self, worker: _Worker) -> None:
        try:
            frame = worker.conn.recv_bytes()
        except (EOFError, OSError):
            self._lost(worker)
            return
        env_id, status = _HEADER.unpack_from(frame)
        future = worker.waiting.pop(env_id, None)
        if future is not None and not future.done():
            future.set_result((status, frame[_HEADER.size :]))

    def _lost(self, worker: _Worker) -> None:
        """The worker died: fail what it owed, forget its envs, start a replacement."""
        if not worker.alive:
            return
        worker.alive = False
        asyncio.get_running_loop().remove_reader(worker.conn.fileno())
        worker.process.join(timeout=1)
        log.error(
            "env worker pid %s died (exit %s): %d sessions lost",
            worker.process.pid, worker.process.exitcode, len(worker.envs),
        )  # fmt: skip
        for future in worker.waiting.values():
            if not future.done():
                future.set_exception(SessionLostError("the environment's worker process died"))
        worker.waiting.clear()
        worker.conn.close()
        index = self._workers.index(worker)
        self._workers[index] = self._spawn()

    async def call(
        self, worker: _Worker, env_id: int, op: int, payload: bytes
    ) -> tuple[int, bytes]:
        """Send one frame and wait for its reply.

        Raises:
            SessionLostError: the worker is (or becomes) dead.
        """
        if not worker.alive:
            raise SessionLostError("the environment's worker process died")
        future: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        worker.waiting[env_id] = future
        try:
            worker.conn.send_bytes(_HEADER.pack(env_id, op) + payload)
        except OSError:
            worker.waiting.pop(env_id, None)
            self._lost(worker)
            raise SessionLostError("the environment's worker process died") from None
        return await future

    async def open(self) -> IsolatedBackend:
        """Create an env on the least-loaded worker.

        Raises:
            EnvFactoryError: the env factory raised in the worker (its message says what).
            SessionLostError: the worker died meanwhile.
        """
        worker = min((w for w in self._workers if w.alive), key=lambda w: len(w.envs))
        env_id = self._next_env
        self._next_env += 1
        status, payload = await self.call(worker, env_id, _CREATE, b"")
        if status == _FAILED:
            raise EnvFactoryError(payload.decode(errors="replace"))
        worker.envs.add(env_id)
        return IsolatedBackend(self, worker, env_id)

    def stop(self) -> None:
        """Stop every worker (after the sessions closed their envs)."""
        loop = asyncio.get_running_loop()
        for worker in self._workers:
            if worker.alive:
                worker.alive = False
                loop.remove_reader(worker.conn.fileno())
                worker.conn.close()  # the worker sees EOF, closes what is left, exits
        for worker in self._workers:
            worker.process.join(timeout=5)
            if worker.process.is_alive():
                worker.process.kill()


class IsolatedBackend:
    """A session's env in a worker process."""

    __slots__ = ("_env_id", "_pool", "_worker", "closed")

    def __init__(self, pool: IsolatedPool, worker: _Worker, env_id: int) -> None:
        self._pool = pool
        self._worker = worker
        self._env_id = env_id
        self.closed = False

    async def handle(self, raw: bytes) -> bytes:
        started = time.perf_counter()
        status, payload = await self._pool.call(self._worker, self._env_id, _REQUEST, raw)
        if status == _STEPPED:
            # Measured here, so the step's time includes the hop to the worker and back.
            self._pool.metrics.step(time.perf_counter() - started)
        elif status == _UNDECODABLE:
            raise UndecodableRequest(payload.decode(errors="replace"))
        self.closed = status == _CLOSED
        return payload

    async def close(self) -> None:
        worker = self._worker
        if self._env_id not in worker.envs:
            return
        worker.envs.discard(self._env_id)
        if not worker.alive:
            return  # it died with its process
        # Shielded: a server stopping must not skip the close; a dead worker took it along.
        with contextlib.suppress(SessionLostError, asyncio.CancelledError):
            await asyncio.shield(self._pool.call(worker, self._env_id, _CLOSE, b""))
