"""Several server processes on one port (``WORKERS=N``): fork, share, supervise.

Workers are forked before any gRPC object exists (gRPC does not survive a fork once it
runs) and bind the same address with SO_REUSEPORT; each gets an even share of
``MAX_CONCURRENT_ENVS``. The parent forwards SIGTERM/SIGINT, restarts a worker that dies
unexpectedly, and exits once all drained.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import select
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from openenv_grpc.server.config import ServerConfig

__all__ = ["serve_workers", "worker_config"]

log = logging.getLogger(__name__)


def worker_config(config: ServerConfig, index: int, port: int) -> ServerConfig:
    """Worker ``index``'s config: the shared port, its share of the capacity, and its own
    metrics port (consecutive from the configured one; 0 stays 0)."""
    share = -(-config.capacity // config.workers) if config.capacity else 0  # ceil
    metrics_port = config.metrics_port
    if metrics_port > 0:
        metrics_port += index
    return dataclasses.replace(
        config, port=port, max_concurrent_envs=share, metrics_port=metrics_port
    )


def _reserve_port(host: str) -> tuple[socket.socket, int]:
    """Pick a free port every worker can bind: a SO_REUSEPORT socket holds it meanwhile."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    holder = socket.socket(family, socket.SOCK_STREAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind((host.strip("[]"), 0))
    return holder, int(holder.getsockname()[1])


def serve_workers(
    run_worker: Callable[[ServerConfig, Callable[[], None]], Any],
    config: ServerConfig,
    announce: Callable[[int], None],
) -> int:
    """Run ``config.workers`` forked ``run_worker(worker_config, ready)``; ``announce(port)``
    once all called ``ready()``. Returns 0 when every worker drained cleanly, 1 if one
    failed or died before it ever served (restarting would only fail again)."""
    holder, port = (None, config.port) if config.port else _reserve_port(config.host)
    parent = os.getpid()
    ready_read, ready_write = os.pipe()
    stopping = False
    workers: dict[int, int] = {}  # pid -> worker index

    def spawn(index: int) -> int:
        pid = os.fork()
        if pid == 0:  # the worker: no gRPC object exists yet in this process
            # Ignored until the worker's own handlers are in place (the parent repeats it).
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            _die_with_parent(parent)  # a supervisor killed outright: its workers drain
            os.close(ready_read)
            code = 0

            def ready() -> None:
                os.write(ready_write, b".")

            try:
                run_worker(worker_config(config, index, port), ready)
            except BaseException:
                log.exception("worker %d failed", index)
                code = 1
            os._exit(code)
        return pid

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for pid in list(workers):
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.kill(pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for index in range(config.workers):
        workers[spawn(index)] = index
    os.close(ready_write)
    failed = not _wait_ready(ready_read, config.workers, workers)
    if holder is not None:
        holder.close()  # every worker has bound the port (or gave up)
    if failed:
        forward(signal.SIGTERM, None)
    else:
        announce(port)
    last_forward = time.monotonic()
    while workers:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.1)
            if stopping and time.monotonic() - last_forward > 1.0:
                forward(signal.SIGTERM, None)  # reach workers that were still starting
                last_forward = time.monotonic()
            continue
        if pid not in workers:
            continue  # not one of ours (e.g. a process an env spawned)
        index = workers.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if stopping:
            failed |= code != 0
        else:
            # A worker died on its own (crash, OOM kill): its sessions are lost; replace it.
            log.error("worker %d (pid %d) exited with %d: restarting it", index, pid, code)
            workers[spawn(index)] = index
    os.close(ready_read)
    return 1 if failed else 0


def _wait_ready(ready: int, count: int, workers: dict[int, int]) -> bool:
    seen = 0
    while seen < count:
        readable, _, _ = select.select([ready], [], [], 0.1)
        if readable:
            seen += len(os.read(ready, count - seen))
            continue
        pid, _status = os.waitpid(-1, os.WNOHANG)
        if pid in workers:
            workers.pop(pid)
            log.error("a worker exited before it could serve")
            return False
    return True


def _die_with_parent(parent: int) -> None:
    try:  # SIGTERM when the parent dies (Linux)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return  # not Linux: the supervisor's own SIGTERM forwarding still applies
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


_PR_SET_PDEATHSIG = 1
