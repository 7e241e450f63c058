"""Chaos and soak: many sessions ended in every way a client can end one, a drain under
load, and a step that hangs on the shared pool; all against real server processes.

Each test records what happened in a dict and prints one ``CHAOS <test>: {...}`` summary
line (``pytest -s`` shows it); docs/reliability.md quotes those numbers. Nothing here
asserts speed: every wait is bounded only to turn a hang into a failure.
"""

from __future__ import annotations

import asyncio
import json
import queue
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from collections import Counter
from typing import Any

import grpc
import pytest

from openenv_grpc import SessionLost
from openenv_grpc.client import aio_channel
from openenv_grpc.client.channel import channel_options
from openenv_grpc.metadata import ADMITTED_KEY
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc
from openenv_grpc_envs.echo import AsyncEchoEnv, EchoAction, EchoEnv

SESSION_PATH = "/openenv_grpc.v1.EnvService/Session"

#: How far the server's RSS may end above its post-warm-up baseline after the soak.
RSS_MARGIN_MIB = 30.0
#: How long after its grace period a draining server may take to exit (a bound, not speed).
EXIT_MARGIN_S = 20.0


def _summary(name: str, record: dict[str, Any]) -> None:
    print(f"\nCHAOS {name}: {json.dumps(record, sort_keys=True)}", flush=True)


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _settle(server, closed: int, timeout: float = 30.0) -> float:  # type: ignore[no-untyped-def]
    """Wait until ``closed`` envs are closed and no session is active; return the wait."""
    start = time.monotonic()
    server.wait_until(
        lambda: server.closed_envs() >= closed and server.active() == 0,
        timeout,
        f"{closed} envs closed and no active session "
        f"(now {server.closed_envs()} closed, {server.open_envs()} open)",
    )
    assert server.closed_envs() == closed, "more envs closed than sessions opened"
    assert server.open_envs() == 0
    assert server.created() == closed
    return round(time.monotonic() - start, 3)


# -- ways to end a session, each over a batch --------------------------------------------


async def _gather_bounded(coros: list[Any], limit: int = 100) -> list[Any]:
    gate = asyncio.Semaphore(limit)

    async def run(coro: Any) -> Any:
        async with gate:
            return await asyncio.wait_for(coro, 30)

    return await asyncio.gather(*(run(c) for c in coros))


def _with_channels(target: str, count: int, body: Any) -> Any:
    """Run ``body(channels)`` on a fresh loop with ``count`` asyncio channels."""

    async def main() -> Any:
        channels = [aio_channel(target) for _ in range(count)]
        try:
            return await body(channels)
        finally:
            for channel in channels:
                await channel.close()

    return asyncio.run(main())


def _batch_clean_close(target: str, n: int, offset: int) -> Counter[str]:
    async def one(channel: grpc.aio.Channel, i: int) -> str:
        env = AsyncEchoEnv(channel)
        await env.open()
        await env.reset(seed=i)
        message = f"clean {i}"
        result = await env.step(EchoAction(message=message))
        assert result.observation.echoed_message == message
        await env.close()
        return "closed"

    async def body(channels: list[grpc.aio.Channel]) -> Counter[str]:
        coros = [one(channels[i % len(channels)], offset + i) for i in range(n)]
        return Counter(await _gather_bounded(coros))

    return _with_channels(target, 4, body)  # type: ignore[no-any-return]


def _batch_half_close(target: str, n: int) -> Counter[str]:
    """Reset, then end the request stream without a close command (a clean half-close)."""

    async def one(stub: pb_grpc.EnvServiceStub, i: int) -> str:
        call = stub.Session()
        assert ADMITTED_KEY in dict(await call.initial_metadata())
        request = pb.SessionRequest(request_id=i + 1)
        request.reset.SetInParent()
        await call.write(request)
        response = await call.read()
        assert response.request_id == i + 1
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        assert await call.code() is grpc.StatusCode.OK
        return "half-closed"

    async def body(channels: list[grpc.aio.Channel]) -> Counter[str]:
        stubs = [pb_grpc.EnvServiceStub(c) for c in channels]
        return Counter(await _gather_bounded([one(stubs[i % 4], i) for i in range(n)]))

    return _with_channels(target, 4, body)  # type: ignore[no-any-return]


def _batch_abort(target: str, n: int) -> Counter[str]:
    """Cancel the stream: right after open, after a reset, after a step, mid-request."""

    async def one(channel: grpc.aio.Channel, i: int) -> str:
        env = AsyncEchoEnv(channel)
        await env.open()
        how = ("after-open", "after-reset", "after-step", "step-in-flight")[i % 4]
        if how != "after-open":
            await env.reset()
        if how == "after-step":
            await env.step(EchoAction(message="then cancel"))
        if how == "step-in-flight":
            # The step's request is handed to gRPC; the stream is cancelled before its answer
            # is read (the server may or may not have answered by then).
            pending = asyncio.ensure_future(env.step(EchoAction(message="in flight")))
            await asyncio.sleep(0)
            await env.abort()
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
            return how
        await env.abort()
        return how

    async def body(channels: list[grpc.aio.Channel]) -> Counter[str]:
        return Counter(await _gather_bounded([one(channels[i % 4], i) for i in range(n)]))

    return _with_channels(target, 4, body)  # type: ignore[no-any-return]


KILLED_CLIENT = textwrap.dedent(
    """
    import asyncio, sys
    from openenv_grpc.client import aio_channel
    from openenv_grpc_envs.echo import AsyncEchoEnv, EchoAction

    async def keep_stepping(env, i):
        k = 0
        while True:  # never idle: the server cannot reclaim it as idle before the kill
            k += 1
            message = f"client {i} step {k}"
            result = await env.step(EchoAction(message=message))
            assert result.observation.echoed_message == message
            await asyncio.sleep(0.05)

    async def main(target, n):
        channel = aio_channel(target)
        envs = []
        for i in range(n):
            env = AsyncEchoEnv(channel)
            await env.open()
            await env.reset(seed=i)
            envs.append(env)
        tasks = [asyncio.ensure_future(keep_stepping(env, i)) for i, env in enumerate(envs)]
        await asyncio.sleep(0.3)
        for task in tasks:
            if task.done():
                task.result()  # surface a failure before claiming readiness
        print("ready", flush=True)
        await asyncio.gather(*tasks)

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
    """
)


def _batch_sigkill_clients(server, processes: int, per_process: int) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Client processes open sessions, keep stepping them, and are SIGKILLed mid-episode."""
    clients = [
        subprocess.Popen(
            [sys.executable, "-c", KILLED_CLIENT, server.target, str(per_process)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    try:
        for client in clients:
            assert client.stdout is not None
            line = client.stdout.readline()  # bounded by the test's timeout
            assert line.strip() == "ready", client.stderr.read() if client.stderr else ""
        # Every one of their sessions is open and stepping right now.
        active_at_kill = server.active()
        assert active_at_kill == processes * per_process
        for client in clients:
            client.send_signal(signal.SIGKILL)
        codes = [client.wait(10) for client in clients]
        assert codes == [-signal.SIGKILL] * processes
    finally:
        for client in clients:
            if client.poll() is None:
                client.kill()
                client.wait()
            for pipe in (client.stdout, client.stderr):
                if pipe is not None:
                    pipe.close()
    return {"active_at_kill": active_at_kill}


# A raw HTTP/2 client: enough of the protocol to open Session streams and tear the socket
# down in the middle of a gRPC message (no gRPC library involved on this side).


def _h2_frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload
    )


def _hpack_literal(name: str, value: str) -> bytes:
    """A header as "literal without indexing, new name", no Huffman coding."""
    raw_name, raw_value = name.encode(), value.encode()
    assert len(raw_name) < 127 and len(raw_value) < 127
    return b"\x00" + bytes([len(raw_name)]) + raw_name + bytes([len(raw_value)]) + raw_value


def _h2_read_frame(sock: socket.socket, buffer: bytearray) -> tuple[int, int, int]:
    def fill(size: int) -> None:
        while len(buffer) < size:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("server closed the connection")
            buffer.extend(chunk)

    fill(9)
    length = int.from_bytes(buffer[:3], "big")
    fill(9 + length)
    kind, flags = buffer[3], buffer[4]
    stream = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
    del buffer[: 9 + length]
    return kind, flags, stream


def _torn_connection(target: str, streams: int, reset: bool) -> int:
    """Open ``streams`` Sessions on one raw connection, wait until each is admitted, send
    the first 16 KiB of a message announced as 1 MB on each, then drop the socket
    (RST if ``reset``, else FIN). Returns how many streams the server admitted."""
    host, port = target.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=20)
    try:
        ids = [1 + 2 * k for k in range(streams)]
        headers = b"".join(
            _hpack_literal(name, value)
            for name, value in (
                (":method", "POST"),
                (":scheme", "http"),
                (":path", SESSION_PATH),
                (":authority", target),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            )
        )
        out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _h2_frame(0x4, 0, 0)  # preface, SETTINGS
        out += b"".join(_h2_frame(0x1, 0x4, sid, headers) for sid in ids)  # HEADERS
        sock.sendall(out)
        buffer = bytearray()
        admitted: set[int] = set()
        while admitted != set(ids):
            kind, flags, stream = _h2_read_frame(sock, buffer)
            if kind == 0x4 and not flags & 0x1:
                sock.sendall(_h2_frame(0x4, 0x1, 0))  # ACK the server's SETTINGS
            elif kind == 0x1 and stream in ids:  # response HEADERS: admitted, env built
                admitted.add(stream)
            elif kind == 0x3 and stream in ids:  # RST_STREAM: refused
                raise AssertionError(f"stream {stream} was reset by the server")
        # A gRPC message prefix announcing 1,000,000 bytes, then only the first 16 KiB.
        partial = b"\x00" + (1_000_000).to_bytes(4, "big") + b"\x1a" * 16_384
        sock.sendall(b"".join(_h2_frame(0x0, 0, sid, partial) for sid in ids))
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return len(admitted)
    finally:
        sock.close()


def _batch_torn_raw(target: str, connections: int, streams: int) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    for k in range(connections):
        reset = k % 2 == 0
        admitted = _torn_connection(target, streams, reset)
        outcomes["rst" if reset else "fin"] += admitted
    return outcomes


def _batch_channel_closed_mid_write(target: str, n: int) -> Counter[str]:
    """Each session on its own connection: a 256 KiB step is being written when the
    channel (and with it the connection) is closed."""
    big = pb.SessionRequest(request_id=2)
    big.step.action.Pack(EchoAction(message="w" * (256 * 1024)))

    async def one(i: int) -> str:
        options = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
        channel = grpc.aio.insecure_channel(target, options=options)
        stub = pb_grpc.EnvServiceStub(channel)
        call = stub.Session()
        assert ADMITTED_KEY in dict(await call.initial_metadata())
        reset = pb.SessionRequest(request_id=1)
        reset.reset.SetInParent()
        await call.write(reset)
        assert (await call.read()).request_id == 1
        write = asyncio.ensure_future(call.write(big))
        for _ in range(i % 3):
            await asyncio.sleep(0)  # tear at slightly different points
        await channel.close()
        results = await asyncio.gather(write, return_exceptions=True)
        return "write-finished" if results[0] is None else "write-cut"

    async def main() -> Counter[str]:
        return Counter(await _gather_bounded([one(i) for i in range(n)], limit=25))

    return asyncio.run(main())


def _batch_silent(server, n: int, closed_before: int) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Open sessions (half of them reset) and say nothing more: the idle reaper ends them;
    each client then learns DEADLINE_EXCEEDED."""

    async def body(channels: list[grpc.aio.Channel]) -> dict[str, Any]:
        envs = []
        for i in range(n):
            env = AsyncEchoEnv(channels[i % len(channels)])
            await env.open()
            if i % 2:
                await env.reset()
            envs.append(env)
        start = time.monotonic()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, lambda: _settle(server, closed_before + n, timeout=30.0))
        reaped_after = round(time.monotonic() - start, 3)
        seen: Counter[str] = Counter()
        for env in envs:
            try:
                await asyncio.wait_for(env.step(EchoAction(message="too late")), 10)
                seen["answered"] += 1
            except SessionLost as lost:
                seen[f"{lost.code.name}{' idle' if 'idle' in lost.message else ''}"] += 1
        return {"reaped_after_s": reaped_after, "client_saw": dict(seen)}

    return _with_channels(server.target, 2, body)  # type: ignore[no-any-return]


@pytest.mark.timeout(180)
def test_soak_thousand_sessions_ended_every_way(start_server) -> None:
    server = start_server(
        "support.envs:CountingEchoEnv", "--max-concurrent-envs", "0", "--idle-timeout", "2"
    )
    pid = server.proc.pid
    record: dict[str, Any] = {"rss_start_mib": round(_rss_mib(pid), 1)}
    closed = 0

    def batch(name: str, count: int, run: Any) -> None:
        nonlocal closed
        started = time.monotonic()
        outcome = run()
        closed += count
        release = _settle(server, closed)
        record[name] = {
            "sessions": count,
            "outcome": dict(outcome) if isinstance(outcome, Counter) else outcome,
            "batch_s": round(time.monotonic() - started, 2),
            "released_after_s": release,
        }

    target = server.target
    batch("warmup_clean_close", 100, lambda: _batch_clean_close(target, 100, 0))
    time.sleep(0.5)
    baseline = _rss_mib(pid)
    record["rss_baseline_mib"] = round(baseline, 1)

    batch("clean_close", 200, lambda: _batch_clean_close(target, 200, 100))
    batch("half_close", 50, lambda: _batch_half_close(target, 50))
    batch("client_cancel", 200, lambda: _batch_abort(target, 200))
    batch("client_sigkill", 200, lambda: _batch_sigkill_clients(server, 4, 50))
    batch("socket_torn_mid_message", 100, lambda: _batch_torn_raw(target, 10, 10))
    batch("channel_closed_mid_write", 50, lambda: _batch_channel_closed_mid_write(target, 50))
    batch("silent_idle_reaped", 100, lambda: _batch_silent(server, 100, closed))

    silent = record["silent_idle_reaped"]["outcome"]["client_saw"]
    assert silent == {"DEADLINE_EXCEEDED idle": 100}, silent
    assert record["socket_torn_mid_message"]["outcome"] == {"rst": 50, "fin": 50}

    # The books: every env created was closed exactly once, no session is left.
    assert closed == 1000
    assert server.created() == server.closed_envs() == 1000
    assert server.open_envs() == 0
    assert server.active() == 0
    assert "closed twice" not in server.stderr()
    assert server.proc.poll() is None

    time.sleep(0.5)
    final = _rss_mib(pid)
    record["rss_final_mib"] = round(final, 1)
    record["rss_growth_mib"] = round(final - baseline, 1)
    record["rss_margin_mib"] = RSS_MARGIN_MIB

    # A fresh session works after all that.
    with EchoEnv(target) as env:
        env.reset(seed=7)
        assert env.step(EchoAction(message="still here")).observation.echoed_message == (
            "still here"
        )
    _settle(server, 1001)
    record["created"] = server.created()
    record["closed"] = server.closed_envs()
    _summary("soak", record)
    assert final - baseline <= RSS_MARGIN_MIB, (
        f"server RSS grew from {baseline:.1f} MiB to {final:.1f} MiB over 900 sessions"
    )


# -- drain under load -----------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_sigterm_drain_with_500_sessions_mid_episode(start_server) -> None:
    grace = 2.0
    sessions = 500
    server = start_server("support.envs:PooledEchoEnv", "--grace", str(grace))
    record: dict[str, Any] = {"sessions": sessions, "grace_s": grace}
    stepping = asyncio.Event()
    messages: dict[str, str] = {}  # one example message per outcome

    async def client(channel: grpc.aio.Channel, i: int, ready: list[int]) -> tuple[str, int]:
        env = AsyncEchoEnv(channel)
        await asyncio.wait_for(env.open(), 30)
        steps = 0
        try:
            await asyncio.wait_for(env.reset(episode_id=f"drain-{i}"), 30)
            while True:
                message = f"{i}:{steps + 1}"
                result = await asyncio.wait_for(env.step(EchoAction(message=message)), 30)
                # An answer must be the answer to this very step.
                assert result.observation.echoed_message == message
                assert result.step_count == steps + 1
                assert result.episode_id == f"drain-{i}"
                steps += 1
                if steps == 1:
                    ready[0] += 1
                    if ready[0] == sessions:
                        stepping.set()
                await asyncio.sleep(0.01)
        except SessionLost as lost:
            if lost.message == "server is draining: session ended and environment closed":
                outcome = f"SessionLost {lost.code.name} draining"
            elif lost.message.startswith("the server ended the session before the request"):
                # The client wrote just as the server ended the stream: grpc.aio then loses
                # the server's status, and the client says so (still UNAVAILABLE).
                outcome = f"SessionLost {lost.code.name} ended before the request was sent"
            else:
                outcome = f"SessionLost {lost.code.name} other"
            messages.setdefault(outcome, lost.message)
            return outcome, steps
        except asyncio.TimeoutError:
            return "hang", steps
        finally:
            await env.abort()

    async def main() -> list[tuple[str, int]]:
        channels = [aio_channel(server.target) for _ in range(4)]
        ready = [0]
        try:
            tasks = [
                asyncio.ensure_future(client(channels[i % 4], i, ready)) for i in range(sessions)
            ]
            await asyncio.wait_for(stepping.wait(), 60)
            record["active_at_sigterm"] = server.active()
            server.proc.send_signal(signal.SIGTERM)
            record["sigterm_at"] = time.monotonic()
            return await asyncio.wait_for(asyncio.gather(*tasks), grace + 60)
        finally:
            for channel in channels:
                await channel.close()

    results = asyncio.run(main())
    sigterm_at = record.pop("sigterm_at")
    # The process must be gone within the grace plus a margin, counted from the SIGTERM.
    code = server.proc.wait(max(0.1, sigterm_at + grace + EXIT_MARGIN_S - time.monotonic()))
    record["exit_code"] = code
    record["exit_seen_after_sigterm_s"] = round(time.monotonic() - sigterm_at, 2)
    outcomes = Counter(outcome for outcome, _ in results)
    steps = [n for _, n in results]
    record["outcomes"] = dict(outcomes)
    record["messages"] = messages
    record["steps_total"] = sum(steps)
    record["steps_min_per_session"] = min(steps)
    record["created"] = server.created()
    record["closed"] = server.closed_envs()
    _summary("drain", record)

    assert record["active_at_sigterm"] == sessions
    assert "hang" not in outcomes, record
    assert code == 0
    assert server.created() == server.closed_envs() == sessions
    assert server.open_envs() == 0
    assert "closed twice" not in server.stderr()
    assert "openenv-grpc: drained, every environment closed\n" in server.stdout_lines
    # Every client stepped until the drain ended its session, and learnt it with
    # UNAVAILABLE: the server's "draining" status, or (when its next request raced the end)
    # the client's own "ended before the request was sent" — never another code or text.
    assert set(outcomes) <= {
        "SessionLost UNAVAILABLE draining",
        "SessionLost UNAVAILABLE ended before the request was sent",
    }, record
    # How many race depends on how far each client's event loop lags (machine load):
    # between 0 and 350 of 500 were seen. The server's own status must reach some.
    assert outcomes["SessionLost UNAVAILABLE draining"] > 0, record


# -- a step that hangs on the shared pool -------------------------------------------------


@pytest.mark.timeout(60)
def test_hanging_steps_on_the_pool_do_not_stall_other_sessions(start_server) -> None:
    """Three sessions block a pool thread each for 3 s (pool of 4, idle timeout 1 s):
    the other sessions keep stepping meanwhile, and the hung sessions are not reaped as
    idle (they wait on their env, not on their client) and get their answers."""
    server = start_server("support.envs:FaultyEnv", "--env-threads", "4", "--idle-timeout", "1")
    hung, others = 3, 8
    record: dict[str, Any] = {"hung_sessions": hung, "stepping_sessions": others}

    async def hanger(channel: grpc.aio.Channel) -> tuple[str, float]:
        async with AsyncEchoEnv(channel) as env:
            await env.reset()
            started = time.monotonic()
            result = await asyncio.wait_for(env.step(EchoAction(message="sleep:3")), 30)
            assert result.observation.echoed_message == "sleep:3"
            return "answered", time.monotonic() - started

    async def stepper(channel: grpc.aio.Channel, i: int, hung_done: asyncio.Event) -> int:
        steps_while_hung = 0
        async with AsyncEchoEnv(channel) as env:
            await env.reset()
            while not hung_done.is_set():
                message = f"other {i} {steps_while_hung}"
                result = await asyncio.wait_for(env.step(EchoAction(message=message)), 10)
                assert result.observation.echoed_message == message
                if not hung_done.is_set():
                    steps_while_hung += 1
                await asyncio.sleep(0.02)
        return steps_while_hung

    async def main() -> None:
        channel = aio_channel(server.target)
        try:
            hung_done = asyncio.Event()
            steppers = [
                asyncio.ensure_future(stepper(channel, i, hung_done)) for i in range(others)
            ]
            await asyncio.sleep(0.2)
            hangers = await asyncio.gather(*(hanger(channel) for _ in range(hung)))
            hung_done.set()
            counts = await asyncio.gather(*steppers)
            record["hung_outcomes"] = dict(Counter(outcome for outcome, _ in hangers))
            record["hung_step_s_min"] = round(min(t for _, t in hangers), 2)
            record["other_steps_while_hung"] = counts
        finally:
            await channel.close()

    asyncio.run(main())
    _settle(server, hung + others)
    _summary("hang", record)
    assert record["hung_outcomes"] == {"answered": hung}
    assert record["hung_step_s_min"] >= 2.9  # they really hung (a lower bound, not speed)
    # Every other session made progress while the three pool threads were blocked.
    assert all(count >= 5 for count in record["other_steps_while_hung"]), record
    assert "closed twice" not in server.stderr()


# -- a client that stops reading -------------------------------------------------------------


@pytest.mark.timeout(60)
def test_client_that_stops_reading_is_reclaimed_by_idle_timeout(start_server) -> None:
    """A client keeps its stream open and writes requests but never reads the answers.

    The server ends up blocked writing answers the client will not take: it waits on its
    client just as much as a session waiting for the next request does, so the idle
    timeout must reclaim it (env closed, slot freed) like any silent session.
    """
    server = start_server("support.envs:CountingEchoEnv", "--idle-timeout", "1")
    record: dict[str, Any] = {"idle_timeout_s": 1.0}
    requests: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
    with grpc.insecure_channel(server.target) as channel:
        call = pb_grpc.EnvServiceStub(channel).Session(iter(requests.get, None), timeout=60)
        try:
            assert ADMITTED_KEY in dict(call.initial_metadata())
            reset = pb.SessionRequest(request_id=1)
            reset.reset.SetInParent()
            requests.put(reset)
            # 60 KB answers: ~36 MB in all, far beyond any flow-control window.
            for request_id in range(2, 600):
                request = pb.SessionRequest(request_id=request_id)
                request.step.action.Pack(EchoAction(message="r" * 60_000))
                requests.put(request)
            start = time.monotonic()
            try:
                server.wait_until(
                    lambda: server.closed_envs() == 1, 10.0, "the stuck session reaped"
                )
                record["reaped_after_s"] = round(time.monotonic() - start, 2)
            finally:
                record["active_after_wait"] = server.active()
                record["open_envs_after_wait"] = server.open_envs()
                _summary("stops_reading", record)
        finally:
            requests.put(None)
            call.cancel()
    _settle(server, 1)
