"""Hostile HTTP/2 against real servers: each attack replayed, its bound checked.

The attackers speak raw HTTP/2 through the ``h2`` package (``bench/h2_attacks.py``), the
flood from a child process; the server is a real ``openenv-grpc serve`` on loopback with
its default limits, and its memory is ``VmRSS`` from ``/proc``. ``python -m
bench.hostile`` runs the same measurements for longer (the 30 s numbers in
docs/reliability.md, "Hostile HTTP/2").
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from bench.h2_attacks import INFO_PATH, SESSION_PATH, SlowSender, grpc_headers
from bench.hostile import (
    admission_burst_run,
    outsider_health_run,
    rapid_reset_run,
    rss_mib,
    slow_senders_run,
    stalled_readers_run,
    streams_to_outgrow,
)
from openenv_grpc.client.info import InfoUnavailable, fetch_info
from openenv_grpc.server.config import ServerConfig
from openenv_grpc_envs.echo import EchoAction, EchoEnv

#: The promise: a flood from one client (4 connections) grows the server by at most this
#: at the default settings: reset streams grpc still holds count against the pending-call
#: limit (~17 KiB each) whatever the connections' stream limits, and that limit is 4 x
#: capacity + 512 (4,608 at the default capacity; it was 32,768: up to ~560 MiB, +498 MiB
#: measured by the round-three tester). Behind deploy/envoy it stays flat (test_envoy.py).
RAPID_RESET_BOUND_MIB = 150
#: ...and once grpc holds all it may (the first seconds), the flood grows it no further
#: but for grpc/grpc#43360 (~1 MiB/s): what the peak of the flood's last third may add to
#: the peak before it. -11 to +15 MiB on a quiet machine; +33 MiB once in a CI run with
#: other tests loading both cores (a slow loop fills grpc's queue later in the flood).
#: Without the bound the flood climbs all the way (+447 MiB in 12 s at 32,768 calls).
RAPID_RESET_LATE_GROWTH_MIB = 48
FLOOD_SECONDS = 12
#: What a flood must send for the bound to mean something. How far past it a flood gets
#: is the machine's speed (12,800 to 19,800 streams beside a busy CI neighbour, 24,600 to
#: 34,800 alone), not a promise, so it is not asserted.
FLOOD_MIN_STREAMS = streams_to_outgrow(RAPID_RESET_BOUND_MIB)
#: What a stream whose answers are never taken may cost the server: its 64 KiB window,
#: the answer waiting on it and the bookkeeping, with room to spare.
STALLED_STREAM_BOUND_KIB = 512
ENHANCE_YOUR_CALM = 0xB


def _print(result: dict[str, object]) -> None:
    print(f"\nHTTP2 {result}")


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("auth", "attacker_has_token"),
    [(False, False), (True, False), (True, True)],
    ids=["no-auth", "auth-outsider", "auth-insider"],
)
def test_rapid_reset_flood_stays_within_its_memory_bound(
    start_server, auth: bool, attacker_has_token: bool
) -> None:
    token = "flood-token" if auth else None
    server = start_server(
        "support.envs:CountingEchoEnv", extra_env={"AUTH_TOKEN": token} if token else {}
    )
    result = rapid_reset_run(
        server, FLOOD_SECONDS, connections=4, token=token, settle=2.0,
        attacker_token=token if attacker_has_token else None,
    )  # fmt: skip
    _print(result)
    assert result["streams_sent"] >= FLOOD_MIN_STREAMS, "the flood did not get going"
    assert result["rss_growth_mib"] <= RAPID_RESET_BOUND_MIB
    assert result["rss_growth_last_third_mib"] <= RAPID_RESET_LATE_GROWTH_MIB
    assert result["server_alive"]
    honest = result["honest"]
    # Admitted sessions keep stepping during the attack (no speed is promised).
    assert honest["steps_min"] >= 10
    assert honest["slowest_step_s"] < 10
    active = lambda: fetch_info(server.target, token=token).capacity.active_sessions  # noqa: E731
    # Streams of the flood still queued in grpc may be admitted after a first 0: wait for
    # quiet, then every env ever made must be closed (one listing, not two racing ones).
    server.wait_until(
        lambda: active() == 0 and every_env_closed(server), 30, "every session released"
    )


def every_env_closed(server) -> bool:  # type: ignore[no-untyped-def]
    """Every env the ledger saw made is closed (read from one directory listing)."""
    return all(entry.name.endswith(".closed") for entry in server.ledger.iterdir())


@pytest.mark.timeout(120)
def test_clients_that_never_take_their_answers_park_at_most_a_window_per_stream(
    start_server,
) -> None:
    server = start_server("support.envs:CountingEchoEnv")
    result = stalled_readers_run(server, streams=64, seconds=6.0)
    _print(result)
    assert result["server_alive"]
    # Each stream got through its 64 KiB window and a few requests, no more (it was
    # 4 MiB, and BDP probing grew it to 32 MiB).
    assert result["sent_per_stream_kib"] <= 1024
    assert result["growth_per_stream_kib"] <= STALLED_STREAM_BOUND_KIB
    assert result["honest"]["steps_min"] >= 1
    server.wait_until(
        lambda: server.active() == 0 and every_env_closed(server), 30, "the stalled released"
    )


Frames = tuple[dict[int, int], set[int], set[int], dict[int, int]]


def _read_frames(sock: socket.socket, seconds: float) -> Frames:
    """Read the server's frames for ``seconds``, acknowledging SETTINGS and PINGs.

    Returns:
        The server's SETTINGS; the streams it answered with HEADERS (an admitted
        session); those it answered with HEADERS that end the stream (a trailers-only
        status: refused by the limiter); and those it reset, with their error codes.
    """
    settings: dict[int, int] = {}
    answered: set[int] = set()
    ended: set[int] = set()
    reset: dict[int, int] = {}
    buffer = bytearray()
    sock.settimeout(0.2)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        if not chunk:
            break
        buffer += chunk
        while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[:3], "big"):
            length = int.from_bytes(buffer[:3], "big")
            kind, flags = buffer[3], buffer[4]
            stream = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
            payload = bytes(buffer[9 : 9 + length])
            del buffer[: 9 + length]
            if kind == 0x4 and not flags & 0x1:  # SETTINGS: note and acknowledge
                for i in range(0, len(payload), 6):
                    settings[int.from_bytes(payload[i : i + 2], "big")] = int.from_bytes(
                        payload[i + 2 : i + 6], "big"
                    )
                sock.sendall(b"\x00\x00\x00\x04\x01\x00\x00\x00\x00")
            elif kind == 0x6 and not flags & 0x1:  # PING: answer it
                ack = len(payload).to_bytes(3, "big") + b"\x06\x01\x00\x00\x00\x00"
                sock.sendall(ack + payload)
            elif kind == 0x1:
                (ended if flags & 0x1 else answered).add(stream)
            elif kind == 0x3:
                reset[stream] = int.from_bytes(payload, "big")
    return settings, answered, ended, reset


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flags", "limit", "sessions"),
    [
        # The default: the pending-call limit (at least the capacity plus 32).
        (("--max-concurrent-envs", "200", "--max-pending-calls", "250"), 250, 200),
        (("--max-streams-per-connection", "256"), 256, 256),
    ],
    ids=["pending-limit", "explicit"],
)
def test_a_connection_gets_at_most_its_streams_even_if_it_ignores_the_setting(
    start_server, flags: tuple[str, ...], limit: int, sessions: int
) -> None:
    """A peer that ignores SETTINGS_MAX_CONCURRENT_STREAMS opens 300 Session streams on
    one connection: up to the limit the server takes them (as sessions, or refused by
    the limiter), the rest are reset, and the server lives on."""
    import h2.config
    import h2.connection

    server = start_server("support.envs:CountingEchoEnv", *flags)
    # h2 builds the frames; it never hears the server, so it does not enforce the limit.
    encoder = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding=None)
    )
    encoder.initiate_connection()
    for _ in range(300):
        encoder.send_headers(encoder.get_next_available_stream_id(), grpc_headers(server.target))
    host, port = server.target.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(encoder.data_to_send())
        settings, admitted, refused, reset = _read_frames(sock, 4.0)
        assert settings.get(0x3) == limit  # SETTINGS_MAX_CONCURRENT_STREAMS
        assert len(admitted) == sessions == server.active()
        assert len(refused) == limit - sessions
        # Beyond the limit: reset with ENHANCE_YOUR_CALM. (A refused stream's status is
        # followed by RST_STREAM NO_ERROR, as gRPC ends a stream the client still sends on.)
        calm = {stream for stream, code in reset.items() if code == ENHANCE_YOUR_CALM}
        assert len(calm) == 300 - limit
        assert {stream for stream, code in reset.items() if code != ENHANCE_YOUR_CALM} == refused
        assert calm.isdisjoint(admitted | refused)
    server.wait_until(lambda: server.active() == 0, what="the sessions of the closed socket")
    assert server.created() == server.closed_envs() == sessions


@pytest.mark.timeout(180)
def test_a_burst_of_16384_opens_is_admitted_or_refused_by_the_limiter(start_server) -> None:
    """16,384 opens at once over 64 connections: gRPC's own pending-call limit must not
    cancel any of them (at gRPC's defaults it cancels about half)."""
    server = start_server("support.envs:CountingEchoEnv", "--max-concurrent-envs", "4096")
    result = admission_burst_run(server, sessions=16_384, channels=64)
    _print(result)
    assert result["outcomes"] == {"admitted": 4096, "refused RESOURCE_EXHAUSTED: ours": 12_288}
    server.wait_until(lambda: server.active() == 0, timeout=60, what="the burst's sessions closed")
    assert server.created() == server.closed_envs() == 4096


@pytest.mark.timeout(120)
def test_opens_that_wait_over_30_s_for_a_blocked_loop_are_served_not_cancelled(
    start_server,
) -> None:
    """gRPC cancels a call the application has not taken within 30 s by default
    (server_max_unrequested_time_in_server); a loop held longer (a burst on a loaded
    machine, here an env that blocks it) cost CI 1,406 opens as CANCELLED. The opens
    that arrive meanwhile wait: the client's deadline decides, not gRPC's 30 s."""
    server = start_server("support.envs:AsyncEchoEnv")
    blocker = EchoEnv(server.target)
    blocker.open()
    blocker.reset()
    outcomes: list[str] = []

    def hold_the_loop() -> None:
        outcomes.append(blocker.step(EchoAction(message="block:34")).observation.echoed_message)

    def open_and_step(index: int) -> None:
        try:
            with EchoEnv(server.target) as env:
                env.reset()
                answer = env.step(EchoAction(message=f"open {index}"))
                outcomes.append(answer.observation.echoed_message)
        except Exception as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")

    holder = threading.Thread(target=hold_the_loop)
    holder.start()
    # Info goes unanswered once the env holds the loop.
    server.wait_until(lambda: _loop_unresponsive(server.target), 10, "the loop held")
    opens = [threading.Thread(target=open_and_step, args=(i,)) for i in range(6)]
    for thread in opens:
        thread.start()
    for thread in [holder, *opens]:
        thread.join(90)
    blocker.close()
    assert sorted(outcomes) == sorted(["block:34", *(f"open {i}" for i in range(6))])
    server.wait_until(lambda: server.active() == 0, what="every session closed")
    assert server.created() == server.closed_envs() == 7


def _loop_unresponsive(target: str) -> bool:
    """True when the server does not answer Info within 0.5 s (its loop is held)."""
    try:
        fetch_info(target, timeout=0.5)
    except InfoUnavailable:
        return True
    return False


_STOPPED_CLIENT = textwrap.dedent(
    """
    import sys, time
    from openenv_grpc_envs.echo import EchoAction, EchoEnv
    envs = [EchoEnv(sys.argv[1]) for _ in range(3)]
    for env in envs:
        env.open()
        env.reset()
        env.step(EchoAction(message="then silence"))
    print("ready", flush=True)
    time.sleep(3600)
    """
)


@pytest.mark.timeout(90)
def test_a_stopped_client_loses_its_sessions_within_keepalive_time_plus_timeout(
    start_server,
) -> None:
    keepalive_time, keepalive_timeout = 2.0, 1.0
    server = start_server(
        "support.envs:CountingEchoEnv",
        "--keepalive-time", str(keepalive_time),
        "--keepalive-timeout", str(keepalive_timeout),
    )  # fmt: skip
    client = subprocess.Popen(
        [sys.executable, "-c", _STOPPED_CLIENT, server.target], stdout=subprocess.PIPE, text=True
    )
    try:
        assert client.stdout is not None and client.stdout.readline().strip() == "ready"
        assert server.active() == 3
        client.send_signal(signal.SIGSTOP)  # its kernel still ACKs; its gRPC answers nothing
        stopped = time.monotonic()
        # grpc-core closed such a connection after its 60 s ping timeout, whatever the
        # keepalive settings said (the server now sets the ping timeout to match).
        server.wait_until(lambda: server.active() == 0, timeout=30, what="sessions reclaimed")
        reclaimed_after = time.monotonic() - stopped
        print(f"\nHTTP2 stopped client reclaimed after {reclaimed_after:.1f}s")
        assert reclaimed_after <= keepalive_time + keepalive_timeout + 3
        assert server.closed_envs() == 3
    finally:
        client.kill()
        client.wait()


#: What a stalled sender may pin per stream beyond its request: the 64 KiB window and
#: the bookkeeping, with room to spare.
SLOW_SENDER_SLACK_KIB = 512


@pytest.mark.timeout(240)
def test_slow_senders_hold_at_most_the_request_limit_and_give_it_back(start_server) -> None:
    """The issue's attack: 48 Session streams on one connection each announce a 15 MiB
    request, send all but its last KiB and go quiet. It pinned 15.1 MiB a stream (+725 MiB)
    and +578 MiB stayed after the socket closed, until the 600 s idle timeout."""
    server = start_server("support.envs:CountingEchoEnv")
    limit = ServerConfig().request_limit  # the default: 8 MiB + 1 KiB
    over = slow_senders_run(server, streams=48, message_bytes=15 * 2**20, hold=2.0)
    _print(over)
    # Past the request limit: refused at the length prefix, before its bytes are taken.
    refusal = f"status 8: SERVER: Received message larger than max (15728640 vs. {limit})"
    assert over["ended_by_server"] == {refusal: 48}
    assert over["client_sent_mib"] <= 48 * 0.125  # at most each stream's first window
    assert over["rss_growth_mib"] <= 16
    assert over["honest"]["steps_min"] >= 1
    server.wait_until(lambda: server.active() == 0, what="the refused streams gone")
    # Within the limit: held while the connection lives (gRPC buffers a request until it
    # is complete), at most the request and its window per stream; given back on close.
    under = slow_senders_run(server, streams=16, message_bytes=limit - 1024, hold=2.0)
    _print(under)
    assert under["ended_by_server"] == {}
    assert under["client_sent_mib"] >= 16 * (limit - 2048) / 2**20  # it did get them in
    assert under["growth_per_stream_kib"] <= limit / 1024 + SLOW_SENDER_SLACK_KIB
    assert under["honest"]["steps_min"] >= 1
    # The heap trimmer returns the freed buffers (they stayed until the idle timeout).
    assert under["rss_growth_after_close_mib"] <= 16
    server.wait_until(
        lambda: server.active() == 0 and every_env_closed(server), 30, "the senders' sessions"
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", [SESSION_PATH, INFO_PATH], ids=["session", "info"])
def test_an_outsider_cannot_make_the_server_buffer_a_request(start_server, path: str) -> None:
    """With AUTH_TOKEN set, 16 streams without the token each send all of a request just
    under the limit but its last KiB. A Session was refused before any read; a unary
    Info was read whole before its refusal (grpc.aio reads a unary request before the
    handler runs): +130 MiB for 16 of them. Now both are refused at once."""
    server = start_server("support.envs:CountingEchoEnv", extra_env={"AUTH_TOKEN": "s3cret"})
    pid = server.proc.pid
    fetch_info(server.target, token="s3cret")  # warm-up
    baseline = rss_mib(pid)
    limit = ServerConfig().request_limit
    sender = SlowSender(server.target, 16, limit - 1024, path=path)
    try:
        sent = sender.push(30.0)
        sender.idle(1.0)
        growth = rss_mib(pid) - baseline
    finally:
        sender.close()
    print(f"\nHTTP2 outsider {path}: sent {sent / 2**20:.1f} MiB, RSS +{growth:.1f} MiB")
    assert set(sender.ended.values()) == {"status 16: missing or invalid bearer token"}
    assert len(sender.ended) == 16
    assert sent <= 16 * 128 * 1024  # no more than each stream's first window
    assert growth <= 16
    assert fetch_info(server.target, token="s3cret").capacity.active_sessions == 0
    assert server.created() == 0


HEALTH_CHECK_PATH = "/grpc.health.v1.Health/Check"
HEALTH_WATCH_PATH = "/grpc.health.v1.Health/Watch"
REFLECTION_PATH = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", [INFO_PATH, REFLECTION_PATH], ids=["info", "reflection"])
def test_a_unary_request_that_never_completes_is_let_go_after_its_deadline(
    start_server, path: str
) -> None:
    """grpc.aio reads a unary request whole before the handler runs: 16 streams each
    sending all of an 8 MiB request but its last KiB held +1 GiB over 8 connections for as
    long as the client kept them (an outside attack on round two's fixes). Now each such
    call ends DEADLINE_EXCEEDED once its request has not arrived within
    --request-arrival-timeout, and the memory goes back. Here an insider's Info (with the
    token: no outsiders' budget); outsiders are the next test. Reflection streams read
    each request the same way (a token holder's 96 held +773 MiB for 18 s)."""
    arrival = 2.0
    server = start_server(
        "support.envs:CountingEchoEnv", "--request-arrival-timeout", str(arrival),
        extra_env={"AUTH_TOKEN": "s3cret"},
    )  # fmt: skip
    pid = server.proc.pid
    fetch_info(server.target, token="s3cret")  # warm-up
    baseline = rss_mib(pid)
    sender = SlowSender(server.target, 16, 4 * 2**20, path=path, token="s3cret")
    try:
        sender.push(arrival)
        # The connection stays up (PINGs answered): only the deadline can end the calls.
        server.wait_until(lambda: (sender.idle(0.2), len(sender.ended) == 16)[1], 60, "16 ended")
        held = rss_mib(pid) - baseline
    finally:
        sender.close()
    expected = f"status 4: the request did not arrive within {arrival:g} s"
    assert set(sender.ended.values()) == {expected}
    server.wait_until(lambda: rss_mib(pid) - baseline <= 24, 30, "the memory given back")
    print(f"\nHTTP2 unary slow sender: ended 16/16, RSS +{held:.1f} MiB before the trim")
    assert server.health() == 1  # SERVING: an honest probe is answered as before


#: What the outsiders' reads may add beyond their budget (32 MiB by default): the first
#: 64 KiB window of each of the attack's streams and the calls' bookkeeping.
OUTSIDER_MARGIN_MIB = 32
OUTSIDERS_REFUSED = "unauthenticated calls are using all of their 32 MiB; retry later"
PUSHED_OUT = (
    "the request was still arriving when a newer unauthenticated call needed its room; retry later"
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("path", "auth", "waves"),
    [
        (HEALTH_CHECK_PATH, True, False),
        (HEALTH_CHECK_PATH, True, True),
        (HEALTH_WATCH_PATH, True, False),
        (INFO_PATH, False, False),
        (REFLECTION_PATH, False, False),
        (REFLECTION_PATH, False, True),
    ],
    ids=["check", "check-waves", "watch", "info-no-auth", "reflection", "reflection-waves"],
)
def test_outsiders_hold_at_most_their_budget(
    start_server, path: str, auth: bool, waves: bool
) -> None:
    """Round three, row 2: with AUTH_TOKEN set, outsiders send health Checks (exempt from
    the token) announcing 8 MiB and sending all but the last KiB, 4 connections x 48
    streams: +3,120 MiB in 5.2 s, let go only after the 10 s arrival deadline. Now each
    outsider read first reserves the request limit from a 32 MiB budget of their own and
    gets 1 s; past the budget a newcomer pushes out the oldest read still arriving, or is
    refused at once before a byte is read. An honest probe (its request arrived with its
    headers) is answered meanwhile, also while the attacker keeps opening new streams as
    the old ones end (waves). Without AUTH_TOKEN every caller is an outsider (Info, and
    reflection: each request of its stream is read so; 4 x 48 reflection streams held
    +1,543 MiB in 5.7 s, none ended)."""
    server = start_server(
        "support.envs:CountingEchoEnv", extra_env={"AUTH_TOKEN": "s3cret"} if auth else {}
    )
    config = ServerConfig()
    budget_mib = config.outsider_held_bytes / 2**20
    result = outsider_health_run(
        server, connections=4, streams=48, message_bytes=config.request_limit - 1024,
        seconds=3.0, waves=waves, path=path,
    )  # fmt: skip
    _print(result)
    ended = result["ended_by_server"]
    timed_out = "status 4: the request did not arrive within 1 s"
    endings = {f"status 8: {OUTSIDERS_REFUSED}", f"status 8: {PUSHED_OUT}", timed_out}
    assert set(ended) <= endings, ended
    assert sum(ended.values()) >= 4 * 48
    assert result["rss_growth_mib"] <= budget_mib + OUTSIDER_MARGIN_MIB
    assert result["server_alive"]
    honest = result["honest"]
    # Honest probes are answered; one may be refused with pushback when every read in the
    # budget is younger than 5 ms and stays so (measured: 0 of 78-117 per run, with waves
    # too; 4-6 of ~150 when 32 connections churn, bench.hostile). deploy/envoy is the rest.
    probes = honest["answered"] + sum(honest["failed"].values())
    assert sum(honest["failed"].values()) <= max(1, probes // 20), honest
    assert set(honest["failed"]) <= {f"RESOURCE_EXHAUSTED: {OUTSIDERS_REFUSED}"}
    assert honest["answered"] >= 10
    assert server.health() == 1  # SERVING once the attack is over


@pytest.mark.timeout(60)
def test_a_reflection_stream_that_goes_quiet_ends_after_the_arrival_deadline(
    start_server,
) -> None:
    """A reflection client sends its requests back to back: both are answered on one
    stream; then the stream says nothing, and ends DEADLINE_EXCEEDED after the outsiders'
    1 s (no AUTH_TOKEN: every caller is an outsider) instead of living on."""
    server = start_server("support.envs:CountingEchoEnv")
    quiet = threading.Event()

    def requests():  # type: ignore[no-untyped-def]
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        yield reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="openenv_grpc.v1.EnvService"
        )
        quiet.wait(30)  # then nothing, without half-closing

    with grpc.insecure_channel(server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = stub.ServerReflectionInfo(requests(), timeout=20)
        began = time.monotonic()
        answers = []
        with pytest.raises(grpc.RpcError) as ended:
            for answer in call:
                answers.append(answer.WhichOneof("message_response"))
        waited = time.monotonic() - began
        quiet.set()
    print(f"\nHTTP2 quiet reflection stream: {answers}, ended after {waited:.1f} s")
    assert answers == ["list_services_response", "file_descriptor_response"]
    assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert ended.value.details() == "the request did not arrive within 1 s"
    assert waited < 10


#: The open-file limit the flood test gives its server (its connection limit is this less
#: 256), and how many silent connections the flood opens: well past it.
FD_LIMIT = 1024
SILENT_CONNECTIONS = 3000


def _silent_flood(host: str, port: int, count: int, opened: list[socket.socket]) -> None:
    """Opens ``count`` TCP connections that never send a byte, as fast as it can."""
    for _ in range(count):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex((host, port))  # EINPROGRESS: it completes in the kernel
        opened.append(sock)


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(65536) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


@pytest.mark.timeout(120)
def test_silent_connections_are_closed_and_cannot_take_every_file_descriptor(
    start_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round three: raw TCP connections that send nothing (or only the HTTP/2 preface)
    lived 40 s; 20,400 of them took every file descriptor of the server (20,000) and a new
    client's health Check timed out. Now a connection that has not finished its handshake
    within --handshake-timeout (3 s) is closed, and the port accepts at most the open-file
    limit less a reserve. Here a server with a 1,024-file limit and 3,000 silent
    connections: a session opened before keeps stepping, an honest health Check and a new
    session get through, and every silent connection is closed within the bound."""
    real_popen = subprocess.Popen

    def limited(*args, **kwargs):  # type: ignore[no-untyped-def]
        def lower_limit() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))

        return real_popen(*args, preexec_fn=lower_limit, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(subprocess, "Popen", limited)
        server = start_server("support.envs:CountingEchoEnv")
    pid = server.proc.pid
    host, port = server.target.rsplit(":", 1)
    opened: list[socket.socket] = []
    peak = [0]
    sampling = threading.Event()

    def sample_fds() -> None:
        while not sampling.is_set():
            with contextlib.suppress(OSError):
                peak[0] = max(peak[0], len(os.listdir(f"/proc/{pid}/fd")))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample_fds, daemon=True)
    sampler.start()
    with EchoEnv(server.target) as env:
        env.reset()
        began = time.monotonic()
        try:
            _silent_flood(host, int(port), SILENT_CONNECTIONS, opened)
            flood_s = time.monotonic() - began
            env.step(EchoAction(message="during the flood"))  # its connection was there first
            with grpc.insecure_channel(server.target) as channel:
                check = health_pb2_grpc.HealthStub(channel).Check
                # Refused while the flood holds every place: in once the silent ones go.
                status = check(health_pb2.HealthCheckRequest(), timeout=15, wait_for_ready=True)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            with EchoEnv(server.target) as fresh:
                fresh.reset()
                fresh.step(EchoAction(message="a newcomer"))
            closed_at: dict[int, float] = {}
            while len(closed_at) < len(opened) and time.monotonic() - began < 30:
                for index, sock in enumerate(opened):
                    if index not in closed_at and _closed_by_server(sock):
                        closed_at[index] = time.monotonic() - began
                time.sleep(0.2)
        finally:
            sampling.set()
            for sock in opened:
                sock.close()
        env.step(EchoAction(message="after the flood"))
    last = max(closed_at.values(), default=float("inf"))
    print(
        f"\nHTTP2 silent flood: {len(opened)} opened in {flood_s:.1f} s, server fds peak "
        f"{peak[0]} of {FD_LIMIT}, all closed by {last:.1f} s"
    )
    # Every one closed by the server (they lived 40 s before the handshake timeout, past
    # the 30 s this waits: a hang guard). How soon is printed above, not asserted.
    assert len(closed_at) == len(opened), (
        f"{len(opened) - len(closed_at)} of {len(opened)} silent connections still open 30 s on"
    )
    assert peak[0] <= FD_LIMIT - 64  # the reserve was never touched
    assert server.proc.poll() is None
