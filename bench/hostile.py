"""Hostile HTTP/2 against a real server: what each attack costs it, measured.

    python -m bench.hostile rapid-reset --seconds 30 --connections 4 [--auth]
    python -m bench.hostile stalled-readers --streams 64
    python -m bench.hostile slow-senders --streams 48 [--message-bytes 15728640]
    python -m bench.hostile admission-burst --sessions 16384 --channels 64
    python -m bench.hostile metrics-slowloris --connections 200
    python -m bench.hostile outsider-health --connections 4 --streams 48 [--waves]

Each command starts ``openenv-grpc serve`` on a loopback port (extra ``serve`` flags go
after ``--``), attacks it from a child process (``bench.h2_attacks``) while a few honest
sessions keep stepping, samples the server's resident memory (``VmRSS`` in
``/proc/PID/status``) and prints one JSON line: the baseline, the peak, the growth, what
the attacker sent and how the honest sessions fared. ``tests/test_reliability_http2.py``
runs shorter versions of the same measurements; ``docs/reliability.md`` keeps the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.h2_attacks import SlowSender, StalledReader, closed_by_peer, half_open_http
from openenv_grpc import CapacityError, SessionRefused
from openenv_grpc.client.channel import channel_options
from openenv_grpc.server.config import ServerConfig
from openenv_grpc.testing import ServerProcess
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc_envs.echo import AsyncEchoEnv, EchoAction

ROOT = Path(__file__).resolve().parent.parent
TOKEN_VAR = "OPENENV_BENCH_TOKEN"


def rss_mib(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def threads(pid: int) -> int:
    """Threads of process ``pid``."""
    return len(os.listdir(f"/proc/{pid}/task"))


class RssSampler:
    """Samples a process's resident memory every ``interval`` seconds in a thread."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.pid = pid
        self.samples: list[tuple[float, float]] = []
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic() - start, rss_mib(self.pid)))
            except (OSError, RuntimeError):
                return  # the process is gone
            self._stop.wait(self._interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak(self) -> float:
        return max(rss for _, rss in self.samples)

    def growth_after(self, seconds: float, until: float | None = None) -> float:
        """How far the peak after the first ``seconds`` (up to ``until``) rose above the
        peak before them, in MiB: a plateau gives about 0."""
        early = [rss for at, rss in self.samples if at < seconds]
        late = [rss for at, rss in self.samples if seconds <= at < (until or float("inf"))]
        return max(late, default=0.0) - max(early, default=0.0)

    def timeline(self, step: float = 5.0) -> list[float]:
        """The largest RSS of each ``step`` seconds, in MiB."""
        buckets: dict[int, float] = {}
        for at, rss in self.samples:
            index = int(at // step)
            buckets[index] = max(buckets.get(index, 0.0), rss)
        return [round(buckets[i], 1) for i in sorted(buckets)]


async def _step_for(
    target: str, sessions: int, seconds: float, token: str | None
) -> dict[str, Any]:
    """``sessions`` honest sessions on one channel step in a closed loop for ``seconds``.

    Returns:
        Steps per session (least and total) and the slowest step, in seconds.
    """
    steps = [0] * sessions
    slowest = 0.0
    action = EchoAction(message="honest")
    async with grpc.aio.insecure_channel(target, options=channel_options()) as channel:
        envs = [AsyncEchoEnv(channel, token=token) for _ in range(sessions)]
        await asyncio.gather(*(env.open() for env in envs))
        await asyncio.gather(*(env.reset() for env in envs))
        deadline = time.monotonic() + seconds

        async def run(i: int) -> None:
            nonlocal slowest
            while time.monotonic() < deadline:
                began = time.monotonic()
                await envs[i].step(action, timeout=30)
                slowest = max(slowest, time.monotonic() - began)
                steps[i] += 1

        await asyncio.gather(*(run(i) for i in range(sessions)))
        await asyncio.gather(*(env.close() for env in envs))
    return {"steps_min": min(steps), "steps_total": sum(steps), "slowest_step_s": slowest}


def _attacker(args: Sequence[str], token: str | None) -> subprocess.Popen[str]:
    environ = {**os.environ, TOKEN_VAR: token or ""}
    return subprocess.Popen(
        [sys.executable, "-m", "bench.h2_attacks", *args],
        cwd=ROOT, env=environ, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


#: What one reset stream still held by grpc costs the server (docs/reliability.md).
RESET_STREAM_KIB = 17


def streams_to_outgrow(bound_mib: int) -> int:
    """How many reset streams, each held at :data:`RESET_STREAM_KIB`, would outgrow
    ``bound_mib``: the least a flood must send for a memory bound to be tested at all."""
    return bound_mib * 1024 // RESET_STREAM_KIB + 1


def rapid_reset_run(
    server: ServerProcess,
    seconds: float,
    connections: int,
    token: str | None = None,
    honest_sessions: int = 8,
    settle: float = 5.0,
    attacker_token: str | None = None,
) -> dict[str, Any]:
    """Flood ``server`` with rapid resets from a child process for ``seconds`` while
    ``honest_sessions`` step (with ``token``, the server's, if any); then wait ``settle``
    seconds and sample again. The attacker sends ``attacker_token`` (None: an outsider
    without one).

    Returns:
        RSS baseline, peak, growth and after settling (MiB); the attacker's report; the
        honest sessions' steps and slowest step.
    """
    pid = server.proc.pid
    asyncio.run(_step_for(server.target, honest_sessions, 0.5, token))  # warm-up
    baseline = rss_mib(pid)
    args = ["rapid-reset", server.target, "--seconds", str(seconds)]
    args += ["--connections", str(connections)]
    args += ["--token-env", TOKEN_VAR if attacker_token else ""]
    with RssSampler(pid) as sampler:
        attacker = _attacker(args, attacker_token)
        honest = asyncio.run(_step_for(server.target, honest_sessions, seconds, token))
        out, _ = attacker.communicate(timeout=seconds + 60)
        time.sleep(settle)
    flood = json.loads(out.strip().splitlines()[-1])
    return {
        "attack": "rapid-reset",
        "seconds": seconds,
        "connections": connections,
        "auth": bool(token),
        "attacker_has_token": bool(attacker_token),
        "rss_baseline_mib": round(baseline, 1),
        "rss_peak_mib": round(sampler.peak, 1),
        "rss_growth_mib": round(sampler.peak - baseline, 1),
        "rss_after_settle_mib": round(rss_mib(pid), 1),
        "rss_every_5s_mib": sampler.timeline(),
        # Still climbing once the flood has filled what grpc may hold? (The last third
        # against all before it: a plateau gives about 0.)
        "rss_growth_last_third_mib": round(sampler.growth_after(seconds * 2 / 3, seconds), 1),
        "streams_sent": flood["streams"],
        "attacker_connections": flood["connections_opened"],
        "server_closed_connections": flood["goaways"],
        "honest": honest,
        "server_alive": server.proc.poll() is None,
    }


def echo_requests(message_bytes: int) -> tuple[bytes, bytes]:
    """A serialized reset request and a step request carrying ``message_bytes`` bytes."""
    reset = pb.SessionRequest(request_id=1, reset=pb.ResetCommand())
    step = pb.SessionRequest(request_id=2)
    step.step.action.Pack(EchoAction(message="x" * message_bytes))
    return reset.SerializeToString(), step.SerializeToString()


def stalled_readers_run(
    server: ServerProcess,
    streams: int,
    seconds: float = 10.0,
    message_bytes: int = 60_000,
    token: str | None = None,
    read_socket: bool = True,
) -> dict[str, Any]:
    """Open ``streams`` sessions on one connection that never take their answers (see
    :class:`StalledReader`) and push requests for ``seconds``; measure what the server
    holds for them.

    Returns:
        RSS baseline, peak and growth (MiB), per stream (KiB), what the client got
        through, and whether an honest session still steps meanwhile.
    """
    pid = server.proc.pid
    asyncio.run(_step_for(server.target, 1, 0.2, token))  # warm-up
    baseline = rss_mib(pid)
    reset, step = echo_requests(message_bytes)
    with RssSampler(pid) as sampler:
        reader = StalledReader(
            server.target, streams, step, reset, token=token, read_socket=read_socket
        )
        try:
            sent = reader.push(seconds)
            honest = asyncio.run(_step_for(server.target, 1, 1.0, token))
        finally:
            reader.close()
    growth = sampler.peak - baseline
    return {
        "attack": "stalled-readers",
        "reads_socket": read_socket,
        "streams": streams,
        "message_bytes": message_bytes,
        "rss_baseline_mib": round(baseline, 1),
        "rss_peak_mib": round(sampler.peak, 1),
        "rss_growth_mib": round(growth, 1),
        "growth_per_stream_kib": round(growth * 1024 / streams, 1),
        "client_sent_mib": round(sent / 2**20, 1),
        "sent_per_stream_kib": round(sent / 1024 / streams, 1),
        "honest": honest,
        "server_alive": server.proc.poll() is None,
    }


def slow_senders_run(
    server: ServerProcess,
    streams: int,
    message_bytes: int,
    hold: float = 3.0,
    settle: float = 30.0,
    token: str | None = None,
) -> dict[str, Any]:
    """``streams`` Session streams on one connection each send all of a
    ``message_bytes`` request but its last KiB (:class:`SlowSender`), then stay quiet
    for ``hold`` seconds while an honest session steps; then the socket closes and the
    server gets up to ``settle`` seconds to give the memory back.

    Returns:
        RSS baseline, growth while held (in all and per stream), how the server ended
        the streams, and the growth left after the close (with the seconds it took).
    """
    pid = server.proc.pid
    asyncio.run(_step_for(server.target, 1, 0.2, token))  # warm-up
    baseline = rss_mib(pid)
    sender = SlowSender(server.target, streams, message_bytes, token=token)
    try:
        sent = sender.push(60.0)
        sender.idle(hold / 2)
        held = rss_mib(pid)
        honest = asyncio.run(_step_for(server.target, 1, hold / 2, token))
        sender.idle(0.1)
        ended = Counter(sender.ended.values())
    finally:
        sender.close()
    closed = time.monotonic()
    after = rss_mib(pid)
    while after - baseline > 16 and time.monotonic() - closed < settle:
        time.sleep(0.2)
        after = rss_mib(pid)
    growth = held - baseline
    return {
        "attack": "slow-senders",
        "streams": streams,
        "message_bytes": message_bytes,
        "client_sent_mib": round(sent / 2**20, 1),
        "ended_by_server": dict(ended),
        "rss_baseline_mib": round(baseline, 1),
        "rss_held_mib": round(held, 1),
        "rss_growth_mib": round(growth, 1),
        "growth_per_stream_kib": round(growth * 1024 / streams, 1),
        "rss_growth_after_close_mib": round(after - baseline, 1),
        "given_back_after_s": round(time.monotonic() - closed, 1),
        "honest": honest,
        "server_alive": server.proc.poll() is None,
    }


HEALTH_CHECK_PATH = "/grpc.health.v1.Health/Check"


def _outsider_attack(
    target: str, path: str, connections: int, streams: int, message_bytes: int,
    seconds: float, waves: bool, report: Any,
) -> None:  # fmt: skip
    """The attacker's process: ``connections`` threads, each a :class:`SlowSender` of
    ``streams`` calls to ``path`` (no token). With ``waves``, a thread opens a new connection
    of them as soon as the server has ended every stream of the last, until ``seconds``
    pass. Sends the count of how the server ended the streams to ``report`` (a pipe)."""
    ended: Counter[str] = Counter()
    sent = [0]
    deadline = time.monotonic() + seconds

    def attack() -> None:
        while True:
            sender = SlowSender(target, streams, message_bytes, path=path)
            try:
                sender.push(max(0.0, deadline - time.monotonic()))
                while len(sender.ended) < streams and time.monotonic() < deadline + 15:
                    sender.idle(0.2)
            finally:
                sender.close()
            ended.update(sender.ended.values())
            ended["left open"] += streams - len(sender.ended)
            sent[0] += sender.sent
            if not waves or time.monotonic() >= deadline:
                return

    workers = [threading.Thread(target=attack) for _ in range(connections)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    ended += Counter()  # drops a zero "left open"
    report.send({"ended": dict(ended), "sent": sent[0]})


def _probe_health(target: str, until: threading.Event, every: float = 0.05) -> dict[str, Any]:
    """Honest health Checks, one every ``every`` seconds until ``until`` is set.

    Returns:
        How many were SERVING, how the others failed, and the latencies (p50, p99, max).
    """
    latencies: list[float] = []
    failed: Counter[str] = Counter()
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not until.is_set():
            began = time.monotonic()
            try:
                answer = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                if answer.status != health_pb2.HealthCheckResponse.SERVING:
                    failed[f"status {answer.status}"] += 1
                latencies.append(time.monotonic() - began)
            except grpc.RpcError as error:
                failed[f"{error.code().name}: {error.details()}"] += 1
            until.wait(every)
    latencies.sort()

    def at(q: float) -> float:
        return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 4)

    return {
        "answered": len(latencies),
        "failed": dict(failed),
        "p50_s": at(0.5) if latencies else None,
        "p99_s": at(0.99) if latencies else None,
        "max_s": round(latencies[-1], 4) if latencies else None,
    }


def outsider_health_run(
    server: ServerProcess, connections: int, streams: int, message_bytes: int,
    seconds: float = 5.0, waves: bool = False, path: str = HEALTH_CHECK_PATH,
) -> dict[str, Any]:  # fmt: skip
    """Row 2 of round three: ``connections`` x ``streams`` calls to ``path`` (health
    Check) without a token, each announcing ``message_bytes`` and sending all but its
    last KiB, from a child process, while an honest prober checks health every 50 ms.

    Returns:
        RSS baseline, peak and growth (MiB), how the server ended the attack's streams,
        and the honest probes' outcomes and latencies during the attack.
    """
    pid = server.proc.pid
    until = threading.Event()
    until.set()
    _probe_health(server.target, until)  # warm-up: one honest probe before the baseline
    baseline = rss_mib(pid)
    receive, send = multiprocessing.get_context("spawn").Pipe(duplex=False)
    attacker = multiprocessing.get_context("spawn").Process(
        target=_outsider_attack,
        args=(server.target, path, connections, streams, message_bytes, seconds, waves, send),
    )
    honest: dict[str, Any] = {}
    until.clear()
    prober = threading.Thread(target=lambda: honest.update(_probe_health(server.target, until)))
    with RssSampler(pid, interval=0.05) as sampler:
        attacker.start()
        prober.start()
        attack = receive.recv() if receive.poll(seconds + 60) else {"ended": "no report"}
        until.set()
        prober.join()
        attacker.join(10)
    return {
        "attack": "outsider-health",
        "path": path,
        "connections": connections,
        "streams": streams,
        "message_bytes": message_bytes,
        "waves": waves,
        "rss_baseline_mib": round(baseline, 1),
        "rss_peak_mib": round(sampler.peak, 1),
        "rss_growth_mib": round(sampler.peak - baseline, 1),
        "client_sent_mib": round(attack.get("sent", 0) / 2**20, 1),
        "ended_by_server": attack["ended"],
        "honest": honest,
        "server_alive": server.proc.poll() is None,
    }


async def _burst(target: str, sessions: int, channels: int) -> Counter[str]:
    options = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
    pool = [grpc.aio.insecure_channel(target, options=options) for _ in range(channels)]
    opened: list[AsyncEchoEnv] = []

    async def one(i: int) -> str:
        env = AsyncEchoEnv(pool[i % channels])
        try:
            await asyncio.wait_for(env.open(), 120)
        except CapacityError as refused:
            return (
                f"refused {refused.code.name}: ours"
                if "capacity" in refused.message
                else (f"refused {refused.code.name}: {refused.message[:60]}")
            )
        except SessionRefused as refused:
            return f"refused {refused.code.name}: {refused.message[:60]}"
        opened.append(env)
        return "admitted"

    try:
        return Counter(await asyncio.gather(*(one(i) for i in range(sessions))))
    finally:
        await asyncio.gather(*(env.close() for env in opened), return_exceptions=True)
        for channel in pool:
            await channel.close()


def admission_burst_run(server: ServerProcess, sessions: int, channels: int) -> dict[str, Any]:
    """``sessions`` opens at once over ``channels`` connections.

    Returns:
        How many were admitted, refused by the limiter, or ended otherwise, and the
        server's peak RSS.
    """
    with RssSampler(server.proc.pid) as sampler:
        began = time.monotonic()
        outcomes = asyncio.run(_burst(server.target, sessions, channels))
        wall = time.monotonic() - began
    return {
        "attack": "admission-burst",
        "sessions": sessions,
        "channels": channels,
        "outcomes": dict(outcomes),
        "wall_s": round(wall, 1),
        "rss_peak_mib": round(sampler.peak, 1),
    }


def metrics_slowloris_run(server: ServerProcess, connections: int) -> dict[str, Any]:
    """``connections`` half-open HTTP connections to the metrics endpoint (started with
    ``--metrics-port 0``), then a scrape.

    Returns:
        The server's threads before and with them, the scrape's status and time, and how
        long until the server had closed every one.
    """
    line = next(line for line in server.stdout_lines if "metrics on http://" in line)
    url = line.split("metrics on ", 1)[1].strip()
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    pid = server.proc.pid
    before = threads(pid)
    sockets = half_open_http(host.strip("[]"), int(port), connections)
    opened = time.monotonic()
    try:
        time.sleep(0.5)
        held = threads(pid)
        began = time.monotonic()
        with urllib.request.urlopen(url, timeout=30) as response:
            status = response.status
        scrape_s = time.monotonic() - began
        while not all(closed_by_peer(s) for s in sockets) and time.monotonic() - opened < 120:
            time.sleep(0.1)
        all_closed_s = time.monotonic() - opened
        left_open = sum(not closed_by_peer(s) for s in sockets)
    finally:
        for sock in sockets:
            sock.close()
    return {
        "attack": "metrics-slowloris",
        "connections": connections,
        "threads_before": before,
        "threads_while_held": held,
        "scrape_status": status,
        "scrape_s": round(scrape_s, 3),
        "all_closed_after_s": round(all_closed_s, 1),
        "left_open": left_open,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "command",
        choices=[
            "rapid-reset",
            "stalled-readers",
            "slow-senders",
            "admission-burst",
            "metrics-slowloris",
            "outsider-health",
        ],
    )
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--auth", action="store_true", help="serve with AUTH_TOKEN set")
    parser.add_argument(
        "--attacker-token", action="store_true", help="rapid reset: the attacker has the token"
    )
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument(
        "--no-read", action="store_true", help="stalled readers: never read the socket at all"
    )
    parser.add_argument(
        "--message-bytes",
        type=int,
        default=15 * 2**20,
        help="slow senders: the request each stream announces (all but 1 KiB is sent)",
    )
    parser.add_argument("--sessions", type=int, default=16384)
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument(
        "--waves", action="store_true", help="outsider health: reopen as streams end"
    )
    parser.add_argument("--env", default="echo")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])  # what follows "--" goes to `serve`
    token = "bench-token" if args.auth or args.command == "outsider-health" else None
    extra_env = {"AUTH_TOKEN": token} if token else {}
    serve_args = argv[split + 1 :]
    if args.command == "admission-burst":
        serve_args = ["--max-concurrent-envs", str(args.sessions // 4), *serve_args]
    if args.command == "metrics-slowloris":
        serve_args = ["--metrics-port", "0", *serve_args]
    server = ServerProcess(args.env, serve_args, extra_env)
    try:
        if args.command == "rapid-reset":
            result = rapid_reset_run(
                server, args.seconds, args.connections, token,
                attacker_token=token if args.attacker_token else None,
            )  # fmt: skip
        elif args.command == "stalled-readers":
            result = stalled_readers_run(
                server, args.streams, min(args.seconds, 10.0), token=token,
                read_socket=not args.no_read,
            )  # fmt: skip
        elif args.command == "slow-senders":
            result = slow_senders_run(server, args.streams, args.message_bytes, token=token)
        elif args.command == "admission-burst":
            result = admission_burst_run(server, args.sessions, args.channels)
        elif args.command == "outsider-health":
            limit = ServerConfig().request_limit  # the default; all but a KiB of it is sent
            result = outsider_health_run(
                server, args.connections, args.streams, limit - 1024, args.seconds, args.waves
            )
        else:
            result = metrics_slowloris_run(server, args.connections)
    finally:
        server.stop()
    result["load_average"] = os.getloadavg()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
