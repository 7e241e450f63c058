"""Replays the session-path attacks of issue 16 against real servers; one JSON line each.

    python -m bench.attack_sessions                 # all four
    python -m bench.attack_sessions ids drain       # some of them

- ``ids``: 40 sessions each reset with an 8 MB episode id, then a 1-byte step: the
  server's RSS and the size of the step's answer.
- ``drain``: ``--grace 3``, one pooled env call blocked for 40 s, two held sessions:
  when the held session hears of the drain, when the process exits, envs closed.
- ``timeout``: ``--env-threads 2 --step-timeout 2``, two sessions block both threads for
  8 s, a third session's instant step: what each gets, and when.
- ``cap``: ``--max-concurrent-envs 4``, 2 s factories, 20 opens each cancelled 0.1 s
  after it was sent: opens admitted, envs built.

The test envs come from ``tests/support/envs.py`` (the server gets ``tests`` on its path).
Not a test: it checks nothing, it measures (``tests/test_reliability_sessions.py`` holds
the promises).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from openenv_grpc.testing import ServerProcess
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc
from openenv_grpc_envs.echo import EchoAction

TESTS = Path(__file__).resolve().parent.parent / "tests"
_BIG = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def _server(env: str, *args: str, ledger: Path | None = None) -> ServerProcess:
    extra = {"OPENENV_TEST_LEDGER": str(ledger)} if ledger is not None else {}
    return ServerProcess(f"support.envs:{env}", list(args), extra, pythonpath=[TESTS])


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _ledger(ledger: Path) -> tuple[int, int]:
    """Envs created and closed, from a test ledger directory."""
    return len(list(ledger.iterdir())), len(list(ledger.glob("*.closed")))


def _step(request_id: int, message: str) -> pb.SessionRequest:
    request = pb.SessionRequest(request_id=request_id)
    request.step.action.Pack(EchoAction(message=message))
    return request


def _outcome(response: Any) -> str:
    if response.WhichOneof("outcome") != "error":
        return str(response.WhichOneof("outcome"))
    return next(c.name for c in grpc.StatusCode if c.value[0] == response.error.code)


async def _open(channel: grpc.aio.Channel) -> Any:
    call = pb_grpc.EnvServiceStub(channel).Session()
    await call.initial_metadata()
    await call.write(pb.SessionRequest(request_id=1, reset=pb.ResetCommand()))
    await call.read()
    return call


async def _ids() -> dict[str, Any]:
    server = _server("CountingEchoEnv")
    try:
        await asyncio.sleep(1)
        idle = _rss_mib(server.proc.pid)
        first: set[str] = set()
        largest = 0
        async with grpc.aio.insecure_channel(server.target, options=_BIG) as channel:
            calls = []
            for _ in range(40):
                call = pb_grpc.EnvServiceStub(channel).Session()
                await call.initial_metadata()
                reset = pb.SessionRequest(request_id=1)
                reset.reset.episode_id = "x" * 8 * 1024 * 1024
                await call.write(reset)
                first.add(_outcome(await call.read()))
                await call.write(_step(2, "a"))
                answer: Any = await call.read()
                largest = max(largest, answer.ByteSize())
                calls.append(call)
            await asyncio.sleep(1)
            loaded = _rss_mib(server.proc.pid)
            for call in calls:
                call.cancel()
        return {
            "attack": "ids", "rss_idle_mib": round(idle), "rss_after_40_mib": round(loaded),
            "reset_answers": sorted(first), "largest_step_answer_bytes": largest,
        }  # fmt: skip
    finally:
        server.stop()


async def _drain() -> dict[str, Any]:
    ledger = Path(tempfile.mkdtemp())
    server = _server("FaultyEnv", "--grace", "3", ledger=ledger)
    try:
        async with grpc.aio.insecure_channel(server.target) as channel:
            hung, held, _other = [await _open(channel) for _ in range(3)]
            await hung.write(_step(2, "sleep:40"))
            await asyncio.sleep(0.3)
            signalled = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            try:
                heard = _outcome(await asyncio.wait_for(held.read(), 60))
            except grpc.aio.AioRpcError as exc:
                heard = exc.code().name
            heard_after = time.monotonic() - signalled
            code = await asyncio.to_thread(server.proc.wait, 120)
            exited_after = time.monotonic() - signalled
        return {
            "attack": "drain", "grace_s": 3, "held_session_heard": heard,
            "heard_after_s": round(heard_after, 2), "exit_code": code,
            "exited_after_s": round(exited_after, 2),
            "envs_created_closed": _ledger(ledger),
        }  # fmt: skip
    finally:
        server.stop()


async def _timeout() -> dict[str, Any]:
    server = _server("FaultyEnv", "--env-threads", "2", "--step-timeout", "2")

    async def timed(call: Any, request: pb.SessionRequest, since: float) -> list[Any]:
        await call.write(request)
        answer = _outcome(await call.read())
        return [answer, round(time.monotonic() - since, 2)]

    try:
        async with grpc.aio.insecure_channel(server.target) as channel:
            first, second, uninvolved = [await _open(channel) for _ in range(3)]
            started = time.monotonic()
            hung = [
                asyncio.create_task(timed(c, _step(2, "sleep:8"), started)) for c in (first, second)
            ]
            await asyncio.sleep(0.5)
            instant = await timed(uninvolved, _step(2, "hi"), started)
            blocked = [await task for task in hung]
            await asyncio.sleep(max(0.0, 8.5 - (time.monotonic() - started)))
            after = await timed(uninvolved, _step(3, "again"), started)
        return {
            "attack": "timeout", "step_timeout_s": 2, "blocked_steps": blocked,
            "uninvolved_instant_step_sent_at_0.5s": instant,
            "uninvolved_next_step_after_threads_free": after,
        }  # fmt: skip
    finally:
        server.stop()


async def _cap() -> dict[str, Any]:
    ledger = Path(tempfile.mkdtemp())
    server = _server(
        "SlowFactoryEnv", "--max-concurrent-envs", "4", "--env-threads", "6", ledger=ledger
    )
    try:
        admitted = refused = 0
        async with grpc.aio.insecure_channel(server.target) as channel:
            for _ in range(20):
                call = pb_grpc.EnvServiceStub(channel).Session()
                try:
                    await asyncio.wait_for(call.read(), 0.1)
                    refused += 1
                except asyncio.TimeoutError:
                    admitted += 1  # still waiting for its env: admitted
                except grpc.aio.AioRpcError:
                    refused += 1
                call.cancel()
        await asyncio.sleep(5)  # every factory done, every orphan closed
        return {
            "attack": "cap", "cap": 4, "opens_admitted": admitted, "opens_refused": refused,
            "envs_built_closed": _ledger(ledger),
        }  # fmt: skip
    finally:
        server.stop()


ATTACKS = {"ids": _ids, "drain": _drain, "timeout": _timeout, "cap": _cap}


def main() -> None:
    parser = argparse.ArgumentParser(description="Replay the session-path attacks.")
    parser.add_argument("attacks", nargs="*", help=f"some of {', '.join(ATTACKS)} (default all)")
    names = parser.parse_args().attacks or list(ATTACKS)
    unknown = sorted(set(names) - set(ATTACKS))
    if unknown:
        parser.error(f"unknown attack(s): {', '.join(unknown)}")
    for name in names:
        print(json.dumps(asyncio.run(ATTACKS[name]())), flush=True)


if __name__ == "__main__":
    main()
