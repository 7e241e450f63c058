"""WORKERS=N: processes sharing one port; a channel pool spreads sessions over them."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc

from openenv_grpc import CapacityError, fetch_info
from openenv_grpc.client.channel import AioChannelPool
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc
from openenv_grpc_envs.echo import AsyncEchoEnv, EchoAction
from support.procs import running


async def _worker_of(channel) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(pid, active sessions) of the worker at the other end of ``channel``."""
    info = await pb_grpc.EnvServiceStub(channel).Info(pb.InfoRequest(), timeout=5)
    return info.server_pid, info.capacity.active_sessions


def test_the_capacity_is_split_among_workers(start_server) -> None:
    server = start_server(
        "support.envs:CountingEchoEnv", "--workers", "2", "--max-concurrent-envs", "10"
    )
    info = fetch_info(server.target)
    assert (info.capacity.workers, info.capacity.max_sessions) == (2, 5)


def test_a_channel_pool_spreads_sessions_over_the_workers(start_server) -> None:
    server = start_server("support.envs:CountingEchoEnv", "--workers", "2")

    async def main() -> Counter[int]:
        # 16 connections: all on one worker by chance is 1 in 32,768.
        async with AioChannelPool(server.target, size=16) as pool:
            envs = [AsyncEchoEnv(pool.next()) for _ in range(16)]
            for env in envs:
                await env.open()
                await env.reset()
            for i, env in enumerate(envs):
                result = await env.step(EchoAction(message=f"s{i}"))
                assert result.observation.echoed_message == f"s{i}"
            # Each channel is its own connection: ask each which worker serves it.
            workers = [await _worker_of(channel) for channel in pool.channels]
            for env in envs:
                await env.close()
        return Counter(pid for pid, _ in workers)

    pids = asyncio.run(main())
    assert len(pids) == 2, f"sessions reached only {pids}"  # both workers got connections
    assert sum(pids.values()) == 16
    server.wait_until(lambda: server.closed_envs() == 16, what="every env closed")


def test_sigterm_drains_every_worker(start_server) -> None:
    server = start_server("support.envs:CountingEchoEnv", "--workers", "2", "--grace", "1")
    assert server.terminate() == 0
    drained = [line for line in server.stdout_lines if line.startswith("openenv-grpc: drained")]
    assert len(drained) == 2


def test_a_killed_worker_is_replaced(start_server) -> None:
    import os
    import signal

    server = start_server("support.envs:CountingEchoEnv", "--workers", "2")

    async def pids() -> set[int]:
        async with AioChannelPool(server.target, size=8) as pool:
            return {pid for pid, _ in [await _worker_of(c) for c in pool.channels]}

    def replaced() -> bool:
        try:
            now = asyncio.run(pids())
        except grpc.aio.AioRpcError:
            return False  # a connection that reached the dying worker: ask again
        return now != before and len(now) == 2

    # The kernel hashes each connection to a worker: 8 may all reach one. Ask until both
    # answer, and keep that answer (asking once more could again reach only one).
    seen: set[int] = set()

    def both() -> bool:
        seen.clear()
        seen.update(asyncio.run(pids()))
        return len(seen) == 2

    server.wait_until(both, 30, "both workers serving")
    before = set(seen)
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    server.wait_until(replaced, timeout=20, what="a replacement worker serving")
    assert victim not in asyncio.run(pids())
    assert server.proc.poll() is None  # the supervisor lives on


def test_workers_do_not_outlive_a_killed_supervisor(start_server) -> None:
    import os
    import signal

    server = start_server("support.envs:CountingEchoEnv", "--workers", "2")

    async def pids() -> set[int]:
        async with AioChannelPool(server.target, size=8) as pool:
            return {pid for pid, _ in [await _worker_of(c) for c in pool.channels]}

    workers = asyncio.run(pids())
    os.kill(server.proc.pid, signal.SIGKILL)  # not the group: only the supervisor

    def gone() -> bool:
        return not any(running(pid) for pid in workers)

    server.wait_until(gone, timeout=40, what="the orphaned workers to drain and exit")


def test_reuse_port_lets_separate_servers_share_one_port(start_server) -> None:
    """REUSE_PORT=1: independent servers (swarm replicas on one host network) bind the same
    port and the kernel spreads connections over them; without it the second bind fails."""
    first = start_server("support.envs:CountingEchoEnv", "--reuse-port", "1")
    port = first.target.rsplit(":", 1)[1]
    second = start_server("support.envs:CountingEchoEnv", "--port", port, "--reuse-port", "1")
    assert second.target == first.target

    async def main() -> Counter[int]:
        async with AioChannelPool(first.target, size=16) as pool:
            return Counter([(await _worker_of(channel))[0] for channel in pool.channels])

    pids = asyncio.run(main())
    assert set(pids) == {first.proc.pid, second.proc.pid}, pids


def test_a_pool_finds_the_room_another_worker_has_left(start_server) -> None:
    """Capacity 2 over 2 workers is 1 each. Sessions opened round robin may hit the full
    worker; ``pool.open_session`` moves on to a channel whose worker has room, and only
    refuses (RESOURCE_EXHAUSTED) once every worker is full."""
    server = start_server(
        "support.envs:CountingEchoEnv", "--workers", "2", "--max-concurrent-envs", "2"
    )

    async def main() -> tuple[dict[int, int], str]:
        # A pool whose first two channels reach the same worker: plain round robin would
        # put the second session on a full worker.
        while True:
            pool = AioChannelPool(server.target, size=3)
            pids = [(await _worker_of(channel))[0] for channel in pool.channels]
            if pids[0] == pids[1] != pids[2]:
                break
            await pool.close()
        async with pool:
            first = await pool.open_session(AsyncEchoEnv)
            second = await pool.open_session(AsyncEchoEnv)  # channel 2 full: channel 3
            # Each worker now holds one session (the capacity it has).
            holders = dict([await _worker_of(channel) for channel in pool.channels])
            try:
                await pool.open_session(AsyncEchoEnv)
            except CapacityError as exc:
                refusal = exc.code.name
            else:
                refusal = "admitted"
            for env in (first, second):
                await env.reset()
                await env.close()
            return holders, refusal

    holders, refusal = asyncio.run(main())
    assert sorted(holders.values()) == [1, 1], holders
    assert refusal == "RESOURCE_EXHAUSTED"
    server.wait_until(lambda: server.closed_envs() == 2, what="both envs closed")
