"""The server's step counters against the envs' own count (issue 36, round three, row 7),
on a real server process: a step an env completed is counted in Info's activity and in
``/metrics`` even when its stream ended before the answer went out.

The attack: vector streams with slow steps in flight (a thread-pool env that takes 0.15 s
per env step), ended while an env is stepping, in every way a stream ends: cancel,
channel close, half-close, a close command, SIGKILL of the client process. Before, the
steps of a stream ended mid-step were never counted (192 of 264 with 30 streams of 16).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from openenv_grpc import fetch_info
from openenv_grpc.codec import pack
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc
from openenv_grpc_envs.echo import EchoAction
from support.metrics import metrics_url
from support.raw_vector import open_metadata

TESTS = Path(__file__).resolve().parent
ENVS, IN_FLIGHT, STEP_SECONDS = 8, 4, 0.15
ENDINGS = ("cancel", "channel-close", "half-close", "close", "sigkill")
STREAMS_PER_ENDING = 2


def _requests() -> list[pb.VectorSessionRequest]:
    """A reset of all, then :data:`IN_FLIGHT` steps of 2 envs each (0.3 s per step call)."""
    action = pack(EchoAction(message=f"sleep:{STEP_SECONDS}"))
    width = ENVS // IN_FLIGHT
    steps = [
        pb.VectorSessionRequest(
            request_id=2 + k,
            step=pb.VectorStep(indices=range(k * width, (k + 1) * width), actions=[action] * width),
        )
        for k in range(IN_FLIGHT)
    ]
    return [pb.VectorSessionRequest(request_id=1, reset=pb.VectorReset()), *steps]


KILLED_CLIENT = """
import sys, time
import grpc
from openenv_grpc.v1 import session_pb2 as pb, session_pb2_grpc as pb_grpc

def requests():
    for text in sys.argv[2:]:
        yield pb.VectorSessionRequest.FromString(bytes.fromhex(text))
    time.sleep(3600)  # never half-closes: it is killed

channel = grpc.insecure_channel(sys.argv[1])
stub = pb_grpc.EnvServiceStub(channel)
call = stub.VectorSession(requests(), metadata=[("openenv-num-envs", "%d")])
next(call)  # the reset's answer
print("stepping", flush=True)
time.sleep(3600)
"""


async def _stream(target: str, ending: str) -> None:
    """One stream: reset, send the steps, let the first step call finish and the second
    start, then end the stream in the way ``ending`` says."""
    channel = grpc.aio.insecure_channel(target)
    call = pb_grpc.EnvServiceStub(channel).VectorSession(metadata=open_metadata(ENVS))
    reset, *steps = _requests()
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
        await call.write(pb.VectorSessionRequest(request_id=99, close=pb.CloseCommand()))
        while (answer := await call.read()) is not grpc.aio.EOF and answer.request_id != 99:
            pass
    await channel.close()


def _killed_stream(target: str) -> subprocess.Popen[str]:
    """A client process with a stream as in :func:`_stream`, killed (SIGKILL) mid-step."""
    script = textwrap.dedent(KILLED_CLIENT % ENVS)
    hexes = [r.SerializeToString().hex() for r in _requests()]
    return subprocess.Popen(
        [sys.executable, "-c", script, target, *hexes], stdout=subprocess.PIPE, text=True
    )


def _metrics_steps(server) -> float:  # type: ignore[no-untyped-def]
    with urllib.request.urlopen(metrics_url(server), timeout=5) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "openenv_step_seconds_count"
    )


def test_steps_of_streams_ended_mid_step_are_counted_once(start_server) -> None:
    """10 vector streams of 8 slow envs, 4 steps in flight each, ended mid-step in the
    five ways (2 streams each): Info's ``activity.steps`` and the ``/metrics`` step count
    both equal the steps the envs say they completed, and every env is closed once."""
    server = start_server(
        "support.step_ledger:SlowCountingEnv", "--metrics-port", "0", "--env-threads", "16",
        "--max-concurrent-envs", "0",
    )  # fmt: skip
    killed = [_killed_stream(server.target) for _ in range(STREAMS_PER_ENDING)]
    for client in killed:
        assert client.stdout is not None and client.stdout.readline().strip() == "stepping"

    async def kill() -> None:
        await asyncio.sleep(STEP_SECONDS * 2 * 1.5)  # as the streams below end
        for client in killed:
            client.send_signal(signal.SIGKILL)
            await asyncio.to_thread(client.wait, 10)

    async def run_streams() -> None:
        ends = [e for e in ENDINGS if e != "sigkill"] * STREAMS_PER_ENDING
        await asyncio.gather(kill(), *(_stream(server.target, ending) for ending in ends))

    asyncio.run(run_streams())
    streams = len(ENDINGS) * STREAMS_PER_ENDING
    server.wait_until(
        lambda: server.active() == 0 and server.closed_envs() == streams * ENVS,
        60, "every env closed",
    )  # fmt: skip
    ledger = Path(f"{server.ledger}.steps")

    def env_steps() -> int:
        return len(ledger.read_text().splitlines()) if ledger.exists() else 0

    counted = {"env": env_steps(), "info": fetch_info(server.target).activity.steps}
    counted["metrics"] = int(_metrics_steps(server))
    print(f"\nCOUNTERS {streams} streams x {ENVS} envs ended mid-step: {counted}")
    # Each stream's first step call was answered; its second was under way when it ended.
    assert counted["env"] >= streams * 2
    assert counted["info"] == counted["env"] == counted["metrics"]
    assert server.open_envs() == 0
