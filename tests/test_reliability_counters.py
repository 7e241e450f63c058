"""The server's step counters against the envs' own count (issue 36, round three, row 7),
on a real server process: a step an env completed is counted in Info's activity and in
``/metrics`` even when its stream ended before the answer went out.

The attack: vector streams with slow steps in flight (a thread-pool env that takes 0.15 s
per env step), ended while an env is stepping, in every way a stream ends: cancel,
channel close, half-close, a close command, SIGKILL of the client process. Before, the
steps of a stream ended mid-step were never counted (192 of 264 with 30 streams of 16).

The same under ``--isolated 2``, for vector streams spread over the env processes and for
Sessions (a block of one env): the env process's answer that comes after its stream
ended is counted by the front (before: env 68 steps, Info 38).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import grpc
import pytest

from openenv_grpc import fetch_info
from openenv_grpc.codec import pack
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc
from openenv_grpc_envs.echo import EchoAction
from support.metrics import metric
from support.raw_vector import open_metadata

TESTS = Path(__file__).resolve().parent
ENVS, IN_FLIGHT, STEP_SECONDS = 8, 4, 0.15
ENDINGS = ("cancel", "channel-close", "half-close", "close", "sigkill")
STREAMS_PER_ENDING = 2
ISOLATED = ("--isolated", "2")


def _requests(kind: str) -> list[Any]:
    """A reset, then :data:`IN_FLIGHT` slow steps (0.3 s each): of 2 envs each on a
    ``vector`` stream (one of each half: both env processes' blocks under ``--isolated``),
    of its one env (sleeping twice as long) on a ``session``."""
    if kind == "session":
        action = pack(EchoAction(message=f"sleep:{STEP_SECONDS * 2}"))
        reset = pb.SessionRequest(request_id=1)
        reset.reset.SetInParent()
        steps = [
            pb.SessionRequest(request_id=2 + k, step=pb.StepCommand(action=action))
            for k in range(IN_FLIGHT)
        ]
        return [reset, *steps]
    action = pack(EchoAction(message=f"sleep:{STEP_SECONDS}"))
    width = ENVS // IN_FLIGHT
    vector_steps = [
        pb.VectorSessionRequest(
            request_id=2 + k,
            # Envs k, k + 4: under --isolated, one env in each process's block.
            step=pb.VectorStep(indices=range(k, ENVS, IN_FLIGHT), actions=[action] * width),
        )
        for k in range(IN_FLIGHT)
    ]
    return [pb.VectorSessionRequest(request_id=1, reset=pb.VectorReset()), *vector_steps]


def _close(kind: str) -> Any:
    request = pb.SessionRequest if kind == "session" else pb.VectorSessionRequest
    return request(request_id=99, close=pb.CloseCommand())


KILLED_CLIENT = """
import sys, time
import grpc
from openenv_grpc.v1 import session_pb2 as pb, session_pb2_grpc as pb_grpc

kind = sys.argv[2]
request = pb.SessionRequest if kind == "session" else pb.VectorSessionRequest

def requests():
    for text in sys.argv[3:]:
        yield request.FromString(bytes.fromhex(text))
    time.sleep(3600)  # never half-closes: it is killed

channel = grpc.insecure_channel(sys.argv[1])
stub = pb_grpc.EnvServiceStub(channel)
if kind == "session":
    call = stub.Session(requests())
else:
    call = stub.VectorSession(requests(), metadata=[("openenv-num-envs", "%d")])
next(call)  # the reset's answer
print("stepping", flush=True)
time.sleep(3600)
"""


async def _stream(target: str, ending: str, kind: str) -> None:
    """One stream: reset, send the steps, let the first step call finish and the second
    start, then end the stream in the way ``ending`` says."""
    channel = grpc.aio.insecure_channel(target)
    stub = pb_grpc.EnvServiceStub(channel)
    call = stub.Session() if kind == "session" else stub.VectorSession(metadata=open_metadata(ENVS))
    reset, *steps = _requests(kind)
    await call.write(reset)
    assert (await call.read()).request_id == 1
    for step in steps:
        await call.write(step)
    await asyncio.sleep(STEP_SECONDS * 2 * 1.5)  # the second step call is in its env
    if ending == "cancel":
        call.cancel()
    elif ending == "channel-close":
        await channel.close()
    elif ending == "half-close":
        await call.done_writing()  # the requests in flight are answered, then the end
        while await call.read() is not grpc.aio.EOF:
            pass
    else:
        await call.write(_close(kind))
        while (answer := await call.read()) is not grpc.aio.EOF and answer.request_id != 99:
            pass
    await channel.close()


def _killed_stream(target: str, kind: str) -> subprocess.Popen[str]:
    """A client process with a stream as in :func:`_stream`, killed (SIGKILL) mid-step."""
    script = textwrap.dedent(KILLED_CLIENT % ENVS)
    hexes = [r.SerializeToString().hex() for r in _requests(kind)]
    return subprocess.Popen(
        [sys.executable, "-c", script, target, kind, *hexes], stdout=subprocess.PIPE, text=True
    )


def _metrics_steps(server) -> float:  # type: ignore[no-untyped-def]
    return metric(server, "openenv_step_seconds_count")


def _attack(server, kind: str) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Open ``STREAMS_PER_ENDING`` streams of ``kind`` per ending, end them mid-step, wait
    until every env is closed; returns the steps the envs say they completed, Info's
    ``activity.steps`` and the ``/metrics`` step count."""
    killed = [_killed_stream(server.target, kind) for _ in range(STREAMS_PER_ENDING)]
    for client in killed:
        assert client.stdout is not None and client.stdout.readline().strip() == "stepping"

    async def kill() -> None:
        await asyncio.sleep(STEP_SECONDS * 2 * 1.5)  # as the streams below end
        for client in killed:
            client.send_signal(signal.SIGKILL)
            await asyncio.to_thread(client.wait, 10)

    async def run_streams() -> None:
        ends = [e for e in ENDINGS if e != "sigkill"] * STREAMS_PER_ENDING
        await asyncio.gather(kill(), *(_stream(server.target, ending, kind) for ending in ends))

    asyncio.run(run_streams())
    envs = len(ENDINGS) * STREAMS_PER_ENDING * (1 if kind == "session" else ENVS)
    server.wait_until(
        lambda: server.active() == 0 and server.closed_envs() == envs, 60, "every env closed"
    )
    ledger = Path(f"{server.ledger}.steps")

    def env_steps() -> int:
        return len(ledger.read_text().splitlines()) if ledger.exists() else 0

    # The closes came after the steps (an env process answers in order): every step the
    # envs will complete is in the ledger by now.
    counted = {"env": env_steps(), "info": fetch_info(server.target).activity.steps}
    counted["metrics"] = int(_metrics_steps(server))
    return counted


def test_steps_of_streams_ended_mid_step_are_counted_once(start_server) -> None:
    """10 vector streams of 8 slow envs, 4 steps in flight each, ended mid-step in the
    five ways (2 streams each): Info's ``activity.steps`` and the ``/metrics`` step count
    both equal the steps the envs say they completed, and every env is closed once."""
    server = start_server(
        "support.step_ledger:SlowCountingEnv", "--metrics-port", "0", "--env-threads", "16",
        "--max-concurrent-envs", "0",
    )  # fmt: skip
    counted = _attack(server, "vector")
    streams = len(ENDINGS) * STREAMS_PER_ENDING
    print(f"\nCOUNTERS {streams} streams x {ENVS} envs ended mid-step: {counted}")
    # Each stream's first step call was answered; its second was under way when it ended.
    assert counted["env"] >= streams * 2
    assert counted["info"] == counted["env"] == counted["metrics"]
    assert server.open_envs() == 0


@pytest.mark.parametrize("kind", ["vector", "session"])
def test_isolated_steps_of_streams_ended_mid_step_are_counted_once(start_server, kind: str) -> None:
    """As above with ``--isolated 2`` (10 streams, 4 slow step calls each, ended mid-step
    in the five ways): vector streams of 8 envs spread over both env processes, and
    Sessions (a block of one env). The env processes' answers that come after a stream
    ended are counted by the front, once: the env's own count == Info's
    ``activity.steps`` == the ``/metrics`` step count."""
    server = start_server(
        "support.step_ledger:SlowCountingEnv", "--metrics-port", "0", *ISOLATED,
        "--max-concurrent-envs", "0",
    )  # fmt: skip
    counted = _attack(server, kind)
    streams = len(ENDINGS) * STREAMS_PER_ENDING
    envs = 1 if kind == "session" else ENVS
    print(
        f"\nCOUNTERS isolated 2: {streams} {kind} streams x {envs} envs ended mid-step: {counted}"
    )
    assert counted["env"] >= streams * (1 if kind == "session" else 2)
    assert counted["info"] == counted["env"] == counted["metrics"]
    assert server.open_envs() == 0
