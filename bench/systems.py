"""The systems under test, their server processes, and the load-client processes.

* ``openenv-grpc``: ``openenv-grpc serve`` (this project), unlimited capacity.
* ``bare-grpc``: ``bench.bare_echo``, grpc.aio with no framework (the floor).
* ``openenv-default`` / ``openenv-tuned``: ``bench/openenv_server.py`` run by the Python
  of a virtualenv of its own (``build/bench-openenv-venv``) that holds openenv-core.

Servers print one "serving ... on HOST:PORT" line; CPU time and RSS are read from
``/proc`` for the server process and any children it has.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OPENENV_VENV = ROOT / "build" / "bench-openenv-venv"
#: What the OpenEnv venv gets: the pinned competitor, and the ASGI server and WebSocket
#: library its docs use (both are openenv-core dependencies; named to be explicit).
OPENENV_REQUIREMENTS = ["openenv-core==0.3.0", "uvicorn", "websockets"]
#: The OpenEnv releases the benchmarks run against, each in a venv of its own: 0.3.0
#: (``openenv-core``, the first peer, kept for continuity) and 0.10.0 (``openenv``, the
#: renamed successor, the current release; same ``create_app`` + uvicorn serving).
OPENENV_PEERS: dict[str, tuple[Path, list[str]]] = {
    "0.3.0": (OPENENV_VENV, OPENENV_REQUIREMENTS),
    "0.10.0": (
        ROOT / "build" / "bench-openenv-0.10.0-venv",
        ["openenv==0.10.0", "uvicorn", "websockets"],
    ),
}
_SERVING = re.compile(r"serving \S+ on (\S+):(\d+)")
_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class System:
    name: str
    label: str
    kind: str  # "grpc" (AsyncEchoEnv client) or "openenv" (WebSocket client)
    description: str
    variant: str = ""  # OpenEnv: "default" or "tuned"
    peer: str = "0.3.0"  # OpenEnv: the release (a key of OPENENV_PEERS)

    @property
    def compression(self) -> bool:
        return self.variant == "default"


SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System(
            "openenv-grpc",
            "openenv-grpc",
            "grpc",
            "this project: `openenv-grpc serve`, one bidi gRPC stream per session, "
            "`--max-concurrent-envs 0`; sessions share channels (HTTP/2 connections)",
        ),
        System(
            "bare-grpc",
            "bare grpc.aio (floor)",
            "grpc",
            "`bench/bare_echo.py`: grpc.aio bidi echo with no framework, same messages",
        ),
        System(
            "openenv-default",
            "OpenEnv default",
            "openenv",
            "openenv-core 0.3.0 `create_app` + uvicorn (1 worker), sync `reset`/`step` "
            "(a thread per session), WebSocket per-message-deflate on (uvicorn and "
            "websockets defaults)",
            variant="default",
        ),
        System(
            "openenv-tuned",
            "OpenEnv tuned",
            "openenv",
            "same, with `reset_async`/`step_async` (on the event loop), "
            "`REQUIRES_SINGLE_THREAD_EXECUTOR` (no thread per session) and "
            "per-message-deflate off on server and client",
            variant="tuned",
        ),
    )
}


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (children inherit it); returns it."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


# -- the OpenEnv virtualenv ----------------------------------------------------------------


def openenv_python(peer: str = "0.3.0") -> Path:
    return OPENENV_PEERS[peer][0] / "bin" / "python"


def ensure_openenv_venv(log: Any = print, peer: str = "0.3.0") -> dict[str, Any]:
    """Create (once) the venv that holds OpenEnv release ``peer``; returns its package
    versions."""
    venv, requirements = OPENENV_PEERS[peer]
    stamp = venv / ".bench-installed"
    wanted = " ".join(requirements)
    started = time.monotonic()
    python = openenv_python(peer)
    if not (stamp.exists() and stamp.read_text().strip() == wanted and python.exists()):
        log(f"bench: creating {venv.relative_to(ROOT)} ({wanted}) ...")
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                *requirements,
            ],
            check=True,
        )
        stamp.write_text(wanted + "\n")
    versions = json.loads(
        subprocess.run(
            [
                str(python),
                "-c",
                "import json, importlib.metadata as m\n"
                "def v(p):\n"
                "    try: return m.version(p)\n"
                "    except m.PackageNotFoundError: return None\n"
                "names = ('openenv-core', 'openenv', 'uvicorn', 'websockets', 'fastapi', "
                "'starlette', 'pydantic')\n"
                "print(json.dumps({p: v(p) for p in names if v(p)}))",
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    versions["setup_s"] = round(time.monotonic() - started, 1)
    return versions


# -- /proc ------------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids.extend(int(x) for x in f.read().split())
    except OSError:
        pass
    return kids


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (uvicorn with one worker has none; counted if any)."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(_children(p))
    return tree


def cpu_seconds(pid: int, tree: bool = True) -> float:
    """User + system CPU time of the process (all its threads), and of its children."""
    total = 0
    for p in process_tree(pid) if tree else [pid]:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / _CLK_TCK


def rss_kib(pid: int) -> int:
    """Resident set size in KiB of the process and its children."""
    total = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            continue
    return total


def machine_busy() -> float:
    """CPU-seconds all CPUs of the machine have spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal (guest time is inside user)
    return (sum(fields[:8]) - fields[3] - fields[4]) / _CLK_TCK


def threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


# -- servers ----------------------------------------------------------------------------------

_GRPC_ENVS = {
    "echo": "echo",
    "sleep": "bench.envs:SleepEnvironment",
    "cpu": "bench.envs:CpuEnvironment",
}


def server_command(system: System, env: str, cpu_loops: int) -> tuple[list[str], dict[str, str]]:
    environ = dict(os.environ, PYTHONUNBUFFERED="1")
    if system.name == "openenv-grpc":
        environ["BENCH_CPU_LOOPS"] = str(cpu_loops)
        cmd = [
            sys.executable,
            "-m",
            "openenv_grpc",
            "serve",
            _GRPC_ENVS[env],
            "--port",
            "0",
            "--max-concurrent-envs",
            "0",
            "--grace",
            "0",
            "--log-level",
            "WARNING",
        ]
    elif system.name == "bare-grpc":
        cmd = [sys.executable, "-m", "bench.bare_echo", "0", "--mode", env]
        cmd += ["--cpu-loops", str(cpu_loops)]
    else:
        cmd = [str(openenv_python(system.peer)), str(ROOT / "bench" / "openenv_server.py")]
        cmd += ["--variant", system.variant, "--env", env, "--cpu-loops", str(cpu_loops)]
    return cmd, environ


class Server:
    """A server child process; ``target`` is its "host:port"."""

    def __init__(self, system: System, env: str, cpu_loops: int) -> None:
        self.system = system
        self.env = env
        cmd, environ = server_command(system, env, cpu_loops)
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=environ,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # a Ctrl-C reaches the orchestrator, which stops us
        )
        self.output: collections.deque[str] = collections.deque(maxlen=50)
        self.target = ""
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line.rstrip())
            match = _SERVING.search(line)
            if match and not self.target:
                self.target = f"{match.group(1)}:{match.group(2)}"
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float = 120.0) -> None:
        if not self._ready.wait(timeout) or not self.target:
            self.stop()
            tail = "\n".join(self.output)
            raise RuntimeError(f"{self.system.name} ({self.env}) did not start:\n{tail}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    def rss(self) -> int:
        return rss_kib(self.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # only our own process group
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)


def start_servers(systems: list[System], env: str, cpu_loops: int) -> dict[str, Server]:
    """Start one server per system at once (they idle while another is measured)."""
    servers = {s.name: Server(s, env, cpu_loops) for s in systems}
    try:
        for server in servers.values():
            server.wait_ready()
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: dict[str, Server]) -> None:
    for server in servers.values():
        server.stop()


# -- load clients -----------------------------------------------------------------------------


@dataclass
class Client:
    """A ``bench/load_client.py`` process; JSON lines in, JSON lines out."""

    system: System
    config: dict[str, Any]
    proc: subprocess.Popen[str] = field(init=False)
    events: queue.Queue[dict[str, Any] | None] = field(init=False)
    stderr: collections.deque[str] = field(init=False)

    def __post_init__(self) -> None:
        python = (
            sys.executable if self.system.kind == "grpc" else str(openenv_python(self.system.peer))
        )
        self.proc = subprocess.Popen(
            [python, str(ROOT / "bench" / "load_client.py")],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self.events = queue.Queue()
        self.stderr = collections.deque(maxlen=30)
        threading.Thread(target=self._pump_out, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()
        self.send(json.dumps({"system": self.system.kind, **self.config}))

    def _pump_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except json.JSONDecodeError:
                self.stderr.append(line.rstrip())
        self.events.put(None)

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line.rstrip())

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def expect(self, event: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"client: no {event!r} within {timeout:.0f}s")
            try:
                message = self.events.get(timeout=remaining)
            except queue.Empty:
                continue
            if message is None:
                tail = "\n".join(self.stderr)
                raise RuntimeError(f"client exited before {event!r}:\n{tail}")
            if message.get("event") == event:
                return message

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)


def start_clients(system: System, configs: list[dict[str, Any]]) -> list[Client]:
    return [Client(system, cfg) for cfg in configs]


def stop_clients(clients: list[Client]) -> None:
    for client in clients:
        client.stop()
