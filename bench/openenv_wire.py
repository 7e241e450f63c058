"""OpenEnv's own client on OpenEnv's own server and on ours, side by side in one run
(issue 37, item 4): N concurrent ``GenericEnvClient`` sessions stepping the OpenEnv
template echo env (``tests/support/openenv_envs/echo.py``) with ``{"message": "hi"}``.

    python -m bench.openenv_wire                        # N = 1, 64, 1024; 5 s a point
    python -m bench.openenv_wire --rounds 3 --json bench/results/openenv_wire-<time>.json
    python -m bench.openenv_wire --sessions 64 --seconds 3 --systems openenv-on-loop openenv-grpc
    python -m bench.openenv_wire --grpc-commit e2841ac  # our server as that commit had it

Systems, each a fresh server process on 127.0.0.1 (a free port) for every point:

* ``openenv-default``: OpenEnv's ``create_app(EchoEnvironment, EchoAction,
  EchoObservation, max_concurrent_envs=4096)`` from the installed ``openenv`` package,
  served as its docs show: the ``uvicorn`` command line, one worker, its defaults (the sync
  env's reset/step on a one-thread executor per session, WebSocket per-message-deflate on).
* ``openenv-on-loop``: the same app around a subclass whose ``reset_async``/``step_async``
  call the sync methods on the event loop (no thread hop), with
  ``REQUIRES_SINGLE_THREAD_EXECUTOR`` (env construction and close on one shared thread
  instead of a thread per session), served with ``--ws-per-message-deflate false``:
  OpenEnv's best configuration for a cheap env.
* ``openenv-grpc``: ``python -m openenv_grpc serve
  --openenv=support.openenv_envs.echo:EchoEnvironment --openenv-port 0
  --max-concurrent-envs 0`` (unlimited); the clients use its OpenEnv door. The installed
  (editable: working-tree) package, or ``--grpc-source DIR`` / ``--grpc-commit COMMIT``.

The client is OpenEnv's ``GenericEnvClient`` (its async API over ``ws://``, one WebSocket
per session) in ``--clients`` client processes (default 2, spawned once for the run; at
N = 1 only one has a session), the sessions split evenly between them. One client process
(one GIL) costs about as much CPU per step as OpenEnv's best server, so alone it would cap
the rate near what a cheap server can answer; two let the client side take whatever the
server leaves. Client, server and everything else share the machine's 2 cores, so steps/s
is bounded by server + client CPU per step and moves with other load: **server CPU per step
is the number that compares the servers**. Client CPU per step is reported beside it (it
differs between systems only through the wire: deflate on or off, shown per row).

Per point: the server starts; one session is opened, reset, stepped and closed (lazy
imports, first-connection work), then the server's RSS is read (``before``); the clients
open their sessions (at most 32 connects in flight per process) and reset each; RSS is
read again (``open``): ``(open - before) / opened`` is the server's KiB per session and
``1 GiB / that`` its sessions per GiB (shown for N >= 64). Then every session steps in a
closed loop; after ``--warmup`` seconds the step counters (shared memory, one per client
process), the server's and the clients' CPU are sampled, and again ``--seconds`` later.
CPU = utime + stime from ``/proc/PID/stat`` (all threads) of every process in the server's
session (started with ``setsid``: workers and env children included) plus the leader's
cutime + cstime (children already reaped); client CPU likewise for the client processes.
``other_cores`` is the machine's busy CPU (``/proc/stat``) not spent by the server or the
clients (steal included): other people's work; ``bound`` names what filled up (the server's
one core, a client process, the machine, or nothing: latency). With ``--rounds R`` every
point is measured R times (the systems' order reversed every other round, N ascending
within a round); the summary takes each metric's median over the rounds, with its range,
and counts the quiet rounds (other_cores <= 0.25) without dropping the others (outside
load here did not explain the spread of CPU per step). The ratios compare those medians:
openenv-grpc against OpenEnv's best configuration, per metric. ``--report FILE``
recomputes the summary and ratios of a results file from its rows.

A system that cannot hold N sessions does not end the run: its row records how many
opened and the first distinct errors (``--openenv-capacity 50`` shows OpenEnv's refusal).
RLIMIT_NOFILE is raised to its hard limit here and in the clients (servers inherit it).
Numbers are measured and printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from openenv.core.env_server.http_server import create_app  # noqa: E402

from support.openenv_envs.echo import (  # noqa: E402
    EchoAction,
    EchoEnvironment,
    EchoObservation,
)

SYSTEMS = ("openenv-default", "openenv-on-loop", "openenv-grpc")
OPENENV_SYSTEMS = ("openenv-default", "openenv-on-loop")
ACTION = {"message": "hi"}
# OpenEnv's max_concurrent_envs, well above the largest N (--openenv-capacity sets it, through
# this variable, in the server process).
CAPACITY = int(os.environ.get("OPENENV_WIRE_CAPACITY", "4096"))
CONNECTS_IN_FLIGHT = 32  # per client process, while opening sessions
CLK_TCK = os.sysconf("SC_CLK_TCK")
URL_LINE = {
    "openenv-default": re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)"),
    "openenv-on-loop": re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)"),
    "openenv-grpc": re.compile(r"OpenEnv protocol on (http://127\.0\.0\.1:\d+)"),
}


# --- the OpenEnv apps (uvicorn ``--factory`` targets) -----------------------------------


class OnLoopEchoEnvironment(EchoEnvironment):
    """The template echo env with async methods: OpenEnv awaits them on its event loop."""

    REQUIRES_SINGLE_THREAD_EXECUTOR = True

    async def reset_async(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> EchoObservation:
        return self.reset(seed=seed, episode_id=episode_id, **kwargs)

    async def step_async(
        self, action: EchoAction, timeout_s: float | None = None, **kwargs: Any
    ) -> EchoObservation:
        return self.step(action)


def default_app() -> Any:
    """``openenv-default``: the template env as written, OpenEnv's defaults."""
    return create_app(
        EchoEnvironment, EchoAction, EchoObservation, env_name="echo", max_concurrent_envs=CAPACITY
    )


def on_loop_app() -> Any:
    """``openenv-on-loop``: the env's reset/step on the event loop."""
    return create_app(
        OnLoopEchoEnvironment,
        EchoAction,
        EchoObservation,
        env_name="echo",
        max_concurrent_envs=CAPACITY,
    )


# --- /proc ------------------------------------------------------------------------------


def _stat_fields(pid: int | str) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (index 0 = state), or None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _session_pids(sid: int) -> list[int]:
    """Every live process whose session id is ``sid`` (a server started with setsid)."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat_fields(name)
            if fields is not None and int(fields[3]) == sid:
                pids.append(int(name))
    return pids


def process_cpu(pid: int) -> float:
    """utime + stime of one process (all its threads), seconds; 0 if it is gone."""
    fields = _stat_fields(pid)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / CLK_TCK


def server_cpu(sid: int) -> float:
    """CPU seconds of a server: its session's live processes + the leader's reaped children."""
    total = 0.0
    for pid in _session_pids(sid):
        fields = _stat_fields(pid)
        if fields is None:
            continue
        total += int(fields[11]) + int(fields[12])
        if pid == sid:
            total += int(fields[13]) + int(fields[14])
    return total / CLK_TCK


def server_rss_kib(sid: int) -> int:
    """VmRSS of every process in the server's session, KiB."""
    total = 0
    for pid in _session_pids(sid):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
                    break
    return total


def machine_busy() -> tuple[float, float, float]:
    """(busy, total, steal) CPU seconds of the whole machine so far, from /proc/stat.

    Busy includes steal (time the hypervisor gave this VM's CPUs to someone else).
    """
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    total = sum(values[:8])  # up to steal; guest time is inside user already
    return (total - idle) / CLK_TCK, total / CLK_TCK, values[7] / CLK_TCK


# --- servers ----------------------------------------------------------------------------


class Server:
    """One system's server process, in a session of its own; ``url`` is its http:// base."""

    def __init__(
        self,
        system: str,
        grpc_source: Path | None = None,
        capacity: int = CAPACITY,
        timeout: float = 60.0,
    ) -> None:
        environ = {**os.environ, "OPENENV_WIRE_CAPACITY": str(capacity)}
        environ.pop("ENABLE_WEB_INTERFACE", None)
        if system == "openenv-grpc":
            # The installed (editable: working-tree) openenv_grpc, or --grpc-source's copy
            # ahead of it on the path; the cwd holds no openenv_grpc to shadow either.
            path = [str(grpc_source)] if grpc_source else []
            environ["PYTHONPATH"] = os.pathsep.join([*path, str(TESTS)])
            cwd = TESTS
            command = [
                sys.executable, "-m", "openenv_grpc", "serve",
                "--openenv=support.openenv_envs.echo:EchoEnvironment",
                "--host", "127.0.0.1", "--port", "0",
                "--openenv-port", "0", "--max-concurrent-envs", "0",
            ]  # fmt: skip
        else:
            environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS)])
            cwd = ROOT
            factory = "default_app" if system == "openenv-default" else "on_loop_app"
            command = [
                sys.executable, "-m", "uvicorn", f"bench.openenv_wire:{factory}", "--factory",
                "--host", "127.0.0.1", "--port", "0", "--workers", "1",
            ]  # fmt: skip
            if system == "openenv-on-loop":
                command += ["--ws-per-message-deflate", "false"]
        self.system = system
        self.command = command
        # Files, not pipes: a server logging a line per connection never blocks on us.
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115  (closed by stop())
        self.proc = subprocess.Popen(
            command, stdout=self.log, stderr=self.log, env=environ, cwd=cwd,
            start_new_session=True,
        )  # fmt: skip
        self.pid = self.proc.pid
        deadline = time.monotonic() + timeout
        while True:
            found = URL_LINE[system].search(self.output())
            if found:
                self.url = found.group(1)
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                output = self.output()
                self.stop()
                raise RuntimeError(f"{system} did not start:\n{output[-3000:]}")
            time.sleep(0.05)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):  # anything left in its group
            os.killpg(self.pid, signal.SIGKILL)
        self.log.close()


# --- clients ----------------------------------------------------------------------------


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:300]


def client_main(slot: int, counts: Any, conn: Any) -> None:
    """A client process, kept for the whole run: one point per ``("point", url, n)``.

    For each point: opens ``n`` GenericEnvClients (connect + reset), sends ``{"opened",
    "errors"}``, waits for "go", steps every session in a closed loop (adding each step to
    ``counts[slot]``) until "stop", closes its sessions and sends ``{"step_errors",
    "errors"}``. "exit" ends the process.
    """
    raise_fd_limit()
    from openenv.core.generic_client import GenericEnvClient  # noqa: F401  (import once)

    while True:
        message = conn.recv()
        if message[0] != "point":
            return
        _kind, url, sessions = message
        counts[slot] = 0
        asyncio.run(_client_point(url, sessions, slot, counts, conn))


async def _client_point(url: str, sessions: int, slot: int, counts: Any, conn: Any) -> None:
    from openenv.core.generic_client import GenericEnvClient

    errors: dict[str, int] = {}
    gate = asyncio.Semaphore(CONNECTS_IN_FLIGHT)

    def note(error: BaseException) -> None:
        key = _describe(error)
        errors[key] = errors.get(key, 0) + 1

    async def open_one() -> Any:
        env = GenericEnvClient(base_url=url)
        async with gate:
            try:
                await env.connect()
                await env.reset()
                return env
            except Exception as error:
                note(error)
                with contextlib.suppress(Exception):
                    await env.close()
                return None

    async def command() -> str:
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        loop.add_reader(conn.fileno(), lambda: readable.done() or readable.set_result(None))
        try:
            await readable
        finally:
            loop.remove_reader(conn.fileno())
        return str(conn.recv())

    opened = [env for env in await asyncio.gather(*(open_one() for _ in range(sessions))) if env]
    conn.send({"opened": len(opened), "errors": dict(errors)})
    errors.clear()
    stopping = False
    step_errors = 0

    async def drive(env: Any) -> None:
        nonlocal step_errors
        while not stopping:
            try:
                await env.step(ACTION)
            except Exception as error:
                step_errors += 1
                note(error)
                return
            counts[slot] += 1

    if await command() == "go":
        tasks = [asyncio.create_task(drive(env)) for env in opened]
        await command()  # "stop"
        stopping = True
        if tasks:
            await asyncio.wait(tasks, timeout=30)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(
            asyncio.gather(*(env.close() for env in opened), return_exceptions=True), 30
        )
    conn.send({"step_errors": step_errors, "errors": dict(errors)})


class Clients:
    """``count`` client processes (spawned once: importing openenv takes seconds here)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.ctx = mp.get_context("spawn")
        self.counts = self.ctx.RawArray("q", count)
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.start()

    def start(self) -> None:
        for slot in range(self.count):
            here, there = self.ctx.Pipe()
            proc = self.ctx.Process(
                target=client_main, args=(slot, self.counts, there), daemon=True
            )
            proc.start()
            self.procs.append(proc)
            self.conns.append(here)

    def stop(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("exit",))
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.procs, self.conns = [], []

    def restart(self) -> None:
        """After a point that went wrong: fresh processes, nothing left over."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        self.procs, self.conns = [], []
        self.start()

    def steps(self) -> int:
        return sum(self.counts)

    def cpu(self) -> list[float]:
        return [process_cpu(proc.pid) for proc in self.procs]


def warm_up(url: str) -> str:
    """One session opened, reset, stepped 20 times and closed: first-connection work.

    Returns the WebSocket extensions the server agreed to (per-message-deflate or none).
    """
    from openenv.core.generic_client import GenericEnvClient

    async def once() -> str:
        env = GenericEnvClient(base_url=url)
        try:
            await env.connect()
            response = env._ws.response if env._ws is not None else None
            extensions = response.headers.get("Sec-WebSocket-Extensions", "") if response else ""
            await env.reset()
            for _ in range(20):
                await env.step(ACTION)
            return str(extensions)
        finally:
            await env.close()

    return asyncio.run(once())


# --- one point --------------------------------------------------------------------------


def measure(
    system: str, sessions: int, clients: Clients, args: argparse.Namespace
) -> dict[str, Any]:
    """Start ``system``'s server, hold ``sessions`` sessions, step them, return the row."""
    row: dict[str, Any] = {"system": system, "sessions": sessions}
    try:
        server = Server(system, args.grpc_source, args.openenv_capacity)
    except Exception as error:
        row["error"] = _describe(error)
        return row
    row["command"] = server.command
    healthy = False
    try:
        try:
            row["ws_extensions"] = warm_up(server.url)
        except Exception as error:
            row["warm_up_error"] = _describe(error)
        time.sleep(0.3)
        rss_before = server_rss_kib(server.pid)
        # One client process at N = 1 (the other gets no sessions and idles).
        active = 1 if sessions == 1 else min(clients.count, sessions)
        shares = [sessions // active + (i < sessions % active) for i in range(active)]
        shares += [0] * (clients.count - active)
        started = time.monotonic()
        for conn, share in zip(clients.conns, shares, strict=True):
            conn.send(("point", server.url, share))
        opened, open_errors = 0, {}
        for proc, conn in zip(clients.procs, clients.conns, strict=True):
            if not conn.poll(args.open_timeout):
                raise RuntimeError(f"client {proc.pid} did not open its sessions in time")
            report = conn.recv()
            opened += report["opened"]
            for key, count in report["errors"].items():
                open_errors[key] = open_errors.get(key, 0) + count
        row["open_seconds"] = round(time.monotonic() - started, 2)
        row["opened"] = opened
        if open_errors:
            row["open_errors"] = open_errors
        time.sleep(0.3)
        rss_open = server_rss_kib(server.pid)
        row["server_rss_kib_before"] = rss_before
        row["server_rss_kib_open"] = rss_open
        if opened:
            row["server_kib_per_session"] = round((rss_open - rss_before) / opened, 2)
            if rss_open > rss_before:
                row["sessions_per_gib"] = round(opened * 1024 * 1024 / (rss_open - rss_before))
        for conn in clients.conns:
            conn.send("go")
        time.sleep(args.warmup)

        def sample() -> tuple[float, int, float, list[float], tuple[float, float, float]]:
            return (
                time.perf_counter(),
                clients.steps(),
                server_cpu(server.pid),
                clients.cpu(),
                machine_busy(),
            )

        t0, steps0, server0, clients0, (busy0, total0, steal0) = sample()
        time.sleep(args.seconds)
        t1, steps1, server1, clients1, (busy1, total1, steal1) = sample()
        client0, client1 = sum(clients0), sum(clients1)
        row["server_rss_kib_stepping"] = server_rss_kib(server.pid)
        for conn in clients.conns:
            conn.send("stop")
        step_errors, late_errors = 0, {}
        for proc, conn in zip(clients.procs, clients.conns, strict=True):
            if not conn.poll(90):
                raise RuntimeError(f"client {proc.pid} did not close its sessions in time")
            report = conn.recv()
            step_errors += report["step_errors"]
            for key, count in report["errors"].items():
                late_errors[key] = late_errors.get(key, 0) + count
        healthy = True
        wall = t1 - t0
        steps = steps1 - steps0
        row.update(
            seconds=round(wall, 3),
            steps=steps,
            steps_per_s=round(steps / wall, 1),
            server_cores=round((server1 - server0) / wall, 3),
            client_cores=round((client1 - client0) / wall, 3),
            busiest_client_cores=round(
                max(b - a for a, b in zip(clients0, clients1, strict=True)) / wall, 3
            ),
            machine_busy_cores=round((busy1 - busy0) / wall, 3),
            machine_cores=round((total1 - total0) / wall, 2),
            steal_cores=round((steal1 - steal0) / wall, 3),
            client_processes=active,
        )
        row["other_cores"] = round(
            row["machine_busy_cores"] - row["server_cores"] - row["client_cores"], 3
        )
        row["bound"] = bound(row)
        if steps:
            row["server_us_per_step"] = round((server1 - server0) / steps * 1e6, 1)
            row["client_us_per_step"] = round((client1 - client0) / steps * 1e6, 1)
        if step_errors:
            row["step_errors"] = step_errors
        if late_errors:
            row["step_error_messages"] = late_errors
    except Exception as error:
        row["error"] = _describe(error)
    finally:
        server.stop()
        if not healthy:
            clients.restart()
    return row


def bound(row: dict[str, Any]) -> str:
    """What limited the closed loop: one process at a full core, or the machine's cores."""
    if row["server_cores"] >= 0.9:
        return "server"  # one event loop (one GIL) at a full core
    if row["busiest_client_cores"] >= 0.9:
        return "client"
    if row["machine_busy_cores"] >= 0.9 * row["machine_cores"]:
        return "machine"  # server + clients (+ others) fill the cores
    return "latency"  # nothing full: the loop waits on round trips (N = 1)


# --- report -----------------------------------------------------------------------------


METRICS = ("steps_per_s", "server_us_per_step", "client_us_per_step", "server_kib_per_session")


QUIET_OTHER_CORES = 0.25  # a row is quiet when the rest of the machine used at most this


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per system and N: each metric's median (and range) over the rounds that measured it."""
    out = []
    keys = list(dict.fromkeys((r["system"], r["sessions"]) for r in rows))
    for system, n in keys:
        group = [r for r in rows if r["system"] == system and r["sessions"] == n]
        opened = min(r.get("opened", 0) for r in group)
        measured = [r for r in group if "server_us_per_step" in r]
        quiet = [r for r in measured if r["other_cores"] <= QUIET_OTHER_CORES]
        group = measured
        entry: dict[str, Any] = {
            "system": system,
            "sessions": n,
            "rounds": len(measured),
            "quiet_rounds": len(quiet),
            "opened": opened,
        }
        for metric in METRICS:
            values = [r[metric] for r in group if metric in r]
            if values:
                entry[metric] = round(statistics.median(values), 1)
                if len(values) > 1:
                    entry[metric + "_range"] = [min(values), max(values)]
        if entry.get("server_kib_per_session", 0) > 0:
            entry["sessions_per_gib"] = round(1024 * 1024 / entry["server_kib_per_session"])
        out.append(entry)
    return out


def ratios(summary: list[dict[str, Any]], sessions: list[int]) -> list[dict[str, Any]]:
    """openenv-grpc over OpenEnv's best configuration (per metric) at each N."""
    out = []
    for n in sessions:
        here = {r["system"]: r for r in summary if r["sessions"] == n}
        ours = here.get("openenv-grpc")
        theirs = [here[s] for s in OPENENV_SYSTEMS if s in here and "server_us_per_step" in here[s]]
        if not ours or "server_us_per_step" not in ours or not theirs:
            continue
        fastest = max(theirs, key=lambda r: r["steps_per_s"])
        cheapest = min(theirs, key=lambda r: r["server_us_per_step"])
        entry: dict[str, Any] = {
            "sessions": n,
            "steps_per_s": round(ours["steps_per_s"] / fastest["steps_per_s"], 3),
            "steps_per_s_vs": fastest["system"],
            "server_us_per_step": round(
                ours["server_us_per_step"] / cheapest["server_us_per_step"], 3
            ),
            "server_us_per_step_vs": cheapest["system"],
        }
        dense = [r for r in theirs if r.get("sessions_per_gib")]
        if n >= 64 and ours.get("sessions_per_gib") and dense:
            densest = max(dense, key=lambda r: r["sessions_per_gib"])
            entry["sessions_per_gib"] = round(
                ours["sessions_per_gib"] / densest["sessions_per_gib"], 3
            )
            entry["sessions_per_gib_vs"] = densest["system"]
        out.append(entry)
    return out


def _fmt(value: Any, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def print_rows(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'system':<16} {'N':>5} {'round':>5} {'opened':>6} {'steps/s':>8} "
        f"{'srv µs/step':>11} {'cli µs/step':>11} {'srv cores':>9} {'cli cores':>9} "
        f"{'other':>6} {'bound':>7} {'KiB/sess':>8} {'deflate':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        dense = r["sessions"] >= 64
        deflate = "ws_extensions" in r and "deflate" in r["ws_extensions"]
        print(
            f"{r['system']:<16} {r['sessions']:>5} {r.get('round', 1):>5} "
            f"{_fmt(r.get('opened'), 'd'):>6} {_fmt(r.get('steps_per_s')):>8} "
            f"{_fmt(r.get('server_us_per_step'), '.1f'):>11} "
            f"{_fmt(r.get('client_us_per_step'), '.1f'):>11} "
            f"{_fmt(r.get('server_cores'), '.2f'):>9} {_fmt(r.get('client_cores'), '.2f'):>9} "
            f"{_fmt(r.get('other_cores'), '.2f'):>6} {r.get('bound', '-'):>7} "
            f"{_fmt(r.get('server_kib_per_session') if dense else None, '.1f'):>8} "
            f"{'on' if deflate else 'off':>7}"
        )
        for key in ("error", "warm_up_error", "open_errors", "step_errors", "step_error_messages"):
            if key in r:
                print(f"    {key}: {r[key]}")


def print_summary(summary: list[dict[str, Any]], table_ratios: list[dict[str, Any]]) -> None:
    header = (
        f"{'system':<16} {'N':>5} {'opened':>6} {'quiet':>5} {'steps/s':>8} "
        f"{'srv µs/step':>11} {'(range)':>13} {'cli µs/step':>11} {'KiB/sess':>8} "
        f"{'sess/GiB':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in summary:
        dense = r["sessions"] >= 64
        low, high = r.get("server_us_per_step_range", (None, None))
        spread = f"({low:.0f}-{high:.0f})" if low is not None else ""
        print(
            f"{r['system']:<16} {r['sessions']:>5} {_fmt(r.get('opened'), 'd'):>6} "
            f"{r['quiet_rounds']:>2}/{r['rounds']:<2} "
            f"{_fmt(r.get('steps_per_s')):>8} {_fmt(r.get('server_us_per_step'), '.1f'):>11} "
            f"{spread:>13} {_fmt(r.get('client_us_per_step'), '.1f'):>11} "
            f"{_fmt(r.get('server_kib_per_session') if dense else None, '.1f'):>8} "
            f"{_fmt(r.get('sessions_per_gib') if dense else None):>9}"
        )
    print()
    for t in table_ratios:
        line = (
            f"N={t['sessions']}: openenv-grpc / OpenEnv's best: steps/s "
            f"{t['steps_per_s']:.2f}x (vs {t['steps_per_s_vs']}), server CPU per step "
            f"{t['server_us_per_step']:.2f}x (vs {t['server_us_per_step_vs']})"
        )
        if "sessions_per_gib" in t:
            line += (
                f", sessions per GiB {t['sessions_per_gib']:.2f}x (vs {t['sessions_per_gib_vs']})"
            )
        print(line)


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in (
        "openenv", "openenv-grpc", "uvicorn", "websockets", "grpcio", "fastapi",
        "starlette", "pydantic", "uvloop", "httptools", "wsproto",
    ):  # fmt: skip
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_state() -> dict[str, Any]:
    def git(*argv: str) -> str:
        done = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip()

    changed = git("status", "--porcelain", "--", "openenv_grpc")
    return {
        "head": git("rev-parse", "HEAD"),
        "openenv_grpc_changed_files": len(changed.split("\n")) if changed else 0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 64, 1024])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured window per point")
    parser.add_argument("--warmup", type=float, default=1.0, help="stepping before the window")
    parser.add_argument("--clients", type=int, default=2, help="client processes (N > 1)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat every point; the systems' order flips each round; medians compared",
    )
    parser.add_argument("--open-timeout", type=float, default=180.0)
    parser.add_argument(
        "--openenv-capacity",
        type=int,
        default=CAPACITY,
        help="max_concurrent_envs given to OpenEnv's create_app",
    )
    parser.add_argument("--json", type=Path, help="write every number here")
    parser.add_argument(
        "--grpc-source",
        type=Path,
        help="a folder holding an openenv_grpc package to serve instead of the installed one "
        "(e.g. `git archive COMMIT openenv_grpc | tar -x -C DIR`)",
    )
    parser.add_argument(
        "--grpc-commit",
        help="serve openenv_grpc as this commit has it (exported with git archive into a "
        "temporary folder, used as --grpc-source): a fixed server while the tree changes",
    )
    parser.add_argument(
        "--report",
        type=Path,
        help="recompute a results file's summary and ratios from its rows (written back), "
        "print them, measure nothing",
    )
    args = parser.parse_args(argv)
    if args.report:
        return report(args.report)
    with tempfile.TemporaryDirectory(prefix="openenv_wire-") as folder:
        grpc_commit = None
        if args.grpc_commit:
            grpc_commit = subprocess.run(
                ["git", "rev-parse", "--verify", f"{args.grpc_commit}^{{commit}}"],
                cwd=ROOT, capture_output=True, text=True, check=True,
            ).stdout.strip()  # fmt: skip
            archive = subprocess.run(
                ["git", "archive", grpc_commit, "openenv_grpc"],
                cwd=ROOT, capture_output=True, check=True,
            ).stdout  # fmt: skip
            subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
            args.grpc_source = Path(folder)
        return run(args, grpc_commit)


def report(path: Path) -> int:
    """``--report``: the tables of a results file, summary and ratios recomputed."""
    result = json.loads(path.read_text())
    rows = result["rows"]
    sessions = list(dict.fromkeys(r["sessions"] for r in rows))
    result["summary"] = summarize(rows)
    result["ratios"] = ratios(result["summary"], sessions)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print_rows(rows)
    print()
    print_summary(result["summary"], result["ratios"])
    print(f"\nload average before {result['loadavg_before']}, after {result['loadavg_after']}")
    return 0


def run(args: argparse.Namespace, grpc_commit: str | None) -> int:
    """Every round, N and system; print the rows, the medians and the ratios."""
    fd_limit = raise_fd_limit()
    started = dt.datetime.now(dt.timezone.utc)
    result: dict[str, Any] = {
        "started": started.isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, "-m", "bench.openenv_wire", *sys.argv[1:]]),
        "loadavg_before": os.getloadavg(),
        "cpus": os.cpu_count(),
        "fd_limit": fd_limit,
        "versions": versions(),
        "git": git_state(),
        "config": {
            "seconds": args.seconds,
            "warmup": args.warmup,
            "clients": args.clients,
            "rounds": args.rounds,
            "openenv_max_concurrent_envs": args.openenv_capacity,
            "action": ACTION,
            "grpc_source": str(args.grpc_source) if args.grpc_source else None,
            "grpc_commit": grpc_commit,
        },
    }
    rows = []
    clients = Clients(max(1, args.clients))
    try:
        for round_ in range(1, args.rounds + 1):
            order = args.systems if round_ % 2 else args.systems[::-1]
            for n in args.sessions:
                for system in order:
                    row = measure(system, n, clients, args)
                    row["round"] = round_
                    error = f", {row['error']}" if "error" in row else ""
                    print(
                        f"  round {round_} {system} N={n}: {row.get('steps_per_s', '-')} "
                        f"steps/s, {row.get('server_us_per_step', '-')} µs/step server "
                        f"({row.get('opened', 0)} opened{error})",
                        flush=True,
                    )
                    rows.append(row)
    finally:
        clients.stop()
    rows.sort(key=lambda r: (r["sessions"], SYSTEMS.index(r["system"]), r["round"]))
    result["rows"] = rows
    result["summary"] = summarize(rows)
    result["ratios"] = ratios(result["summary"], args.sessions)
    result["loadavg_after"] = os.getloadavg()
    result["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    print()
    print_rows(rows)
    print()
    print_summary(result["summary"], result["ratios"])
    print(f"\nload average before {result['loadavg_before']}, after {result['loadavg_after']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
