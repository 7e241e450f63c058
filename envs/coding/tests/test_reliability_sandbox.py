"""Hostile code against the coding sandbox: what it may leave behind, and how far it reaches.

Every test drives real ``openenv-grpc serve`` processes on loopback (or, for owners that
die, a real process that opens a sandbox and is SIGKILLed) and checks the host itself
afterwards: its processes, SysV IPC tables, shared directories, cgroups and registry.

Two kinds of host are tested. ``full`` is this VM as it is (root: namespaces, a cgroup
v1 memory hierarchy, seccomp). ``degraded`` is the same server made into a root process
without namespaces, mounts or cgroup file systems, like a default Docker container (see
``degraded/sitecustomize.py``): there the sandbox falls back to removing what the uid
left, and to per-process memory limits, which these tests check as documented.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from openenv_grpc import EnvError, SessionRefused
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.coding import (
    CodingAction,
    CodingEnv,
    CodingLimits,
    CodingObservation,
    CodingResetOptions,
    CodingState,
    Limit,
)
from openenv_grpc_envs.coding.environment import CodingEnvironment
from openenv_grpc_envs.coding.limits import CodingSettings
from openenv_grpc_envs.coding.tests.orphan_helper import HOSTILE

HERE = Path(__file__).resolve().parent
DEGRADED = {"CODING_TEST_DEGRADED": "1"}
REGISTRY = Path("/run/openenv-coding")

if os.geteuid() != 0:  # pragma: no cover - the CI VM runs as root
    pytest.fail("these tests need a root server (sandbox uids, namespaces, cgroups)")


# -- servers --------------------------------------------------------------------------


def _serve(extra_env: dict[str, str], *args: str, degraded: bool = False) -> ServerProcess:
    return ServerProcess(
        "coding",
        ["--max-concurrent-envs", "0", *args],
        {**(DEGRADED if degraded else {}), **extra_env},
        pythonpath=[HERE / "degraded"] if degraded else [],
    )


@pytest.fixture(scope="module")
def full() -> Iterator[ServerProcess]:
    """This VM's root server, default settings (no network allowed)."""
    server = _serve({})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def degraded() -> Iterator[ServerProcess]:
    """A root server on a host without namespaces and cgroups; network allowed (else it
    refuses every session, see test_a_host_that_cannot_cut_the_network_refuses_sessions)."""
    server = _serve({"CODING_ALLOW_NETWORK": "1"}, degraded=True)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def limited() -> Iterator[ServerProcess]:
    """A root server whose operator set every maximum low, and allows the network."""
    server = _serve(
        {
            "CODING_MAX_CPU_SECONDS": "2",
            "CODING_MAX_WALL_MS": "3000",
            "CODING_MAX_MEMORY_MB": "256",
            "CODING_MAX_SANDBOX_MEMORY_MB": "192",
            "CODING_MAX_OUTPUT_BYTES": "1024",
            "CODING_MAX_PROCESSES": "16",
            "CODING_MAX_FILE_SIZE_MB": "2",
            "CODING_ALLOW_NETWORK": "1",
        }
    )
    yield server
    server.stop()


@pytest.fixture(params=["full", "degraded"])
def host(request: pytest.FixtureRequest) -> ServerProcess:
    """Each kind of host in turn."""
    server: ServerProcess = request.getfixturevalue(request.param)
    return server


def run(env: CodingEnv, code: str) -> CodingObservation:
    return env.step(CodingAction(code=code)).observation


def facts(obs: CodingObservation) -> Any:
    """The JSON the code printed last."""
    assert obs.stdout, (obs.exit_code, obs.limit, obs.stderr)
    return json.loads(obs.stdout.splitlines()[-1])


# -- what the host shows --------------------------------------------------------------


def live_pids(uid: int) -> list[int]:
    """Live (not zombie) processes of ``uid``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_bytes()
            status = Path(f"/proc/{name}/status").read_bytes()
        except OSError:
            continue
        if stat.rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
            continue
        if int(status.split(b"\nUid:")[1].split()[0]) == uid:
            found.append(int(name))
    return found


def in_namespace(link: str, kind: str = "ipc") -> list[int]:
    """Processes of the host in the namespace ``link`` (e.g. ``ipc:[4026532]``)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.readlink(f"/proc/{name}/ns/{kind}") == link:
                    found.append(int(name))
            except OSError:
                continue
    return found


def host_segments(uid: int) -> list[str]:
    """Rows of the host's SysV shared memory table owned or created by ``uid``."""
    lines = Path("/proc/sysvipc/shm").read_text().splitlines()
    header = lines[0].split()
    at_uid, at_cuid = header.index("uid"), header.index("cuid")
    return [
        line for line in lines[1:] if uid in (int(line.split()[at_uid]), int(line.split()[at_cuid]))
    ]


def files_of(uid: int, *folders: str) -> list[str]:
    """Entries ``uid`` owns at the top of ``folders``."""
    found = []
    for folder in folders:
        for entry in os.scandir(folder):
            try:
                if entry.stat(follow_symlinks=False).st_uid == uid:
                    found.append(entry.path)
            except FileNotFoundError:
                continue
    return found


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])


def report(line: str) -> None:
    """One summary line per measurement (run with ``-s`` to see them)."""
    print(f"SANDBOX {line}")


def wait_until(predicate: Any, what: str, timeout: float = 10) -> None:
    ServerProcess.wait_until(predicate, timeout=timeout, what=what)


def host_kind(state: CodingState) -> str:
    return "full" if state.ipc_isolated else "degraded"


def isolated_state(state: CodingState, *, full: bool) -> None:
    """The features the probe found, as ``state()`` reports them."""
    assert state.sandbox_uid >= 1_600_000_000
    assert state.syscall_filter
    assert (state.ipc_isolated, state.private_tmpfs, state.memory_cgroup) == (full,) * 3
    assert state.network_isolated == full


def test_each_host_reports_what_its_sandbox_has(
    full: ServerProcess, degraded: ServerProcess
) -> None:
    with CodingEnv(full.target) as env:
        env.reset()
        isolated_state(env.state(), full=True)
    with CodingEnv(degraded.target) as env:
        env.reset()
        isolated_state(env.state(), full=False)
    # The CI VM offers cgroup v1 (memory + pids hierarchies); the log says which path ran.
    assert "features: ipc_namespace, mount_namespace, network_namespace, seccomp, cgroup v" in (
        full.stderr()
    )
    log = degraded.stderr()
    assert "features: seccomp\n" in log
    for missing in ("no cgroup", "no ipc namespace", "no mount namespace", "no network namespace"):
        assert missing in log


# -- 1. SysV shared memory ------------------------------------------------------------

SHM_BOMB = """\
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
made = []
for _ in range(4):  # four 256 MiB segments, as in the issue
    shmid = libc.shmget(0, 256 << 20, 0o1000 | 0o600)
    if shmid < 0:
        break
    made.append(shmid)
print(json.dumps({"made": len(made), "errno": ctypes.get_errno(),
                  "ipc_ns": os.readlink("/proc/self/ns/ipc")}))
"""
#: How many SysV segments of this uid the run sees.
SHM_TABLE = """\
import os
print(sum(f" {os.getuid()} " in row for row in open("/proc/sysvipc/shm").readlines()[1:]))
"""


def test_sysv_shared_memory_does_not_outlive_the_run(host: ServerProcess) -> None:
    with CodingEnv(host.target) as env:
        env.reset(options=CodingResetOptions(limits=CodingLimits(memory_mb=512)))
        state = env.state()
        uid = state.sandbox_uid
        made = facts(run(env, SHM_BOMB))
        if state.ipc_isolated:
            # Its own IPC namespace, whose SysV limits are the memory budget: two fit.
            assert made["made"] == 2 and made["errno"] == 28  # ENOSPC
            # Nothing of the run is left in that namespace, so the kernel freed it.
            wait_until(lambda: not in_namespace(made["ipc_ns"]), "the run's IPC namespace gone")
        else:
            assert made["made"] == 4  # the host's limits: the segments exist until the run ends
        assert host_segments(uid) == []  # removed after the run
        report(
            f"{host_kind(state)} sysv: 4 x 256 MiB asked, {made['made']} made, "
            f"{len(host_segments(uid))} left on the host after the run"
        )
        assert run(env, SHM_TABLE).stdout == "0\n"  # the next run starts with none
        facts(run(env, SHM_BOMB))
        assert host_segments(uid) == []
    assert host_segments(uid) == []


# -- 2. /dev/shm and /run/lock --------------------------------------------------------

SHARED_FILES = """\
import json, os
for folder in ("/dev/shm", "/run/lock"):
    with open(os.path.join(folder, "left-behind"), "w") as out:
        out.write("x")
print(json.dumps({"shm": sorted(os.listdir("/dev/shm")), "lock": sorted(os.listdir("/run/lock"))}))
"""
#: Fills /dev/shm with 8 MiB files until something stops it, printing how far it got
#: (each line is out before the next write, which the kernel may kill it in).
FILL_SHM = """\
for i in range(128):  # up to 1 GiB
    with open(f"/dev/shm/fill-{i}", "wb") as out:
        out.write(b"x" * (8 << 20))
    print((i + 1) * 8, flush=True)
"""


def test_dev_shm_and_run_lock_are_private_or_swept_per_run(host: ServerProcess) -> None:
    with CodingEnv(host.target) as env:
        env.reset(options=CodingResetOptions(limits=CodingLimits(memory_mb=256)))
        state = env.state()
        uid = state.sandbox_uid
        seen = facts(run(env, SHARED_FILES))
        assert "left-behind" in seen["shm"] and "left-behind" in seen["lock"]
        if state.private_tmpfs:
            # The run saw its own empty tmpfs, not the host's entries.
            assert seen["shm"] == ["left-behind"] and seen["lock"] == ["left-behind"]
        assert files_of(uid, "/dev/shm", "/run/lock") == []  # gone once the run ended
        again = facts(
            run(env, "import json, os\nprint(json.dumps({'shm': os.listdir('/dev/shm')}))")
        )
        assert "left-behind" not in again["shm"]
        if state.private_tmpfs:
            # 1 GiB into /dev/shm stops at the sandbox's 256 MiB budget (tmpfs size and
            # cgroup), and the RAM is freed with the run, not held until the session ends.
            obs = run(env, FILL_SHM)
            written = int(obs.stdout.split()[-1])
            report(
                f"full /dev/shm: 1 GiB asked under memory_mb=256, {written} MiB written, "
                f"limit {Limit.Name(obs.limit)}, exit {obs.exit_code}"
            )
            assert written < 256
            # Stopped by the tmpfs size (ENOSPC) or by the cgroup (an OOM kill).
            assert obs.limit == Limit.LIMIT_MEMORY or "No space left" in obs.stderr, obs
            assert files_of(uid, "/dev/shm") == []
    assert files_of(uid, "/dev/shm", "/run/lock", "/tmp", "/var/tmp") == []


# -- 3. one memory budget -------------------------------------------------------------


def _children(count: int, mb: int) -> str:
    """Code forking ``count`` children that each hold ``mb`` MiB for a second."""
    return f"""\
import json, os, time
kids = []
for _ in range({count}):
    pid = os.fork()
    if pid == 0:
        try:
            block = b"x" * ({mb} << 20)
            time.sleep(1)
            os._exit(0)
        except MemoryError:
            os._exit(3)
    kids.append(pid)
print(json.dumps([os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) for k in kids]))
"""


def test_children_share_the_sandboxs_memory_budget(full: ServerProcess) -> None:
    with CodingEnv(full.target) as env:
        env.reset(options=CodingResetOptions(limits=CodingLimits(memory_mb=512)))
        assert env.state().memory_cgroup
        obs = run(env, _children(6, 400))  # 2.4 GB asked in all, under one 512 MiB budget
        statuses = facts(obs)
        report(
            f"full memory: 6 children x 400 MiB under memory_mb=512: exit codes {statuses}, "
            f"limit {Limit.Name(obs.limit)}"
        )
        assert statuses.count(0) <= 1, statuses  # at most one 400 MiB child fits
        assert statuses.count(-9) >= 5, statuses  # the others: killed by the cgroup's OOM
        assert obs.limit == Limit.LIMIT_MEMORY


def test_without_a_cgroup_memory_is_bounded_per_process(degraded: ServerProcess) -> None:
    with CodingEnv(degraded.target) as env:
        env.reset(options=CodingResetOptions(limits=CodingLimits(memory_mb=128, processes=8)))
        assert not env.state().memory_cgroup
        # The documented fallback: each process alone is bounded (RLIMIT_AS) ...
        assert facts(run(env, _children(1, 200))) == [3]  # MemoryError
        # ... but not the children together: 4 x 80 MiB all fit under memory_mb=128.
        together = facts(run(env, _children(4, 80)))
        report(f"degraded memory: 4 children x 80 MiB under memory_mb=128: exit codes {together}")
        assert together == [0, 0, 0, 0]
        # So memory_mb x processes is what a sandbox may hold, and the server bounds it.
        with pytest.raises(EnvError) as refused:
            env.reset(
                options=CodingResetOptions(limits=CodingLimits(memory_mb=4096, processes=256))
            )
        assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.message == (
            "limits.memory_mb x limits.processes is 1048576 MiB; this host bounds memory per "
            "process only, and the server's maximum for one sandbox is 16384 MiB "
            "(CODING_MAX_SANDBOX_MEMORY_MB)"
        )
        # Left to their defaults, processes shrink to fit: 16384 / 1024 = 16.
        env.reset(options=CodingResetOptions(limits=CodingLimits(memory_mb=1024)))
        assert env.state().limits.processes == 16


# -- 4. server-side maxima ------------------------------------------------------------


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        (
            CodingLimits(cpu_seconds=3),
            "limits.cpu_seconds is 3; the server's maximum is 2 (CODING_MAX_CPU_SECONDS)",
        ),
        (
            CodingLimits(wall_ms=3001),
            "limits.wall_ms is 3001; the server's maximum is 3000 (CODING_MAX_WALL_MS)",
        ),
        (
            CodingLimits(memory_mb=257),
            "limits.memory_mb is 257; the server's maximum is 256 (CODING_MAX_MEMORY_MB)",
        ),
        (
            CodingLimits(memory_mb=256),
            "limits.memory_mb is 256; the server's maximum for one sandbox is 192 MiB "
            "(CODING_MAX_SANDBOX_MEMORY_MB)",
        ),
        (
            CodingLimits(output_bytes=1025),
            "limits.output_bytes is 1025; the server's maximum is 1024 (CODING_MAX_OUTPUT_BYTES)",
        ),
        (
            CodingLimits(processes=17),
            "limits.processes is 17; the server's maximum is 16 (CODING_MAX_PROCESSES)",
        ),
        (
            CodingLimits(file_size_mb=3),
            "limits.file_size_mb is 3; the server's maximum is 2 (CODING_MAX_FILE_SIZE_MB)",
        ),
    ],
)
def test_a_client_asking_beyond_the_servers_maxima_is_refused(
    limited: ServerProcess, limits: CodingLimits, message: str
) -> None:
    with CodingEnv(limited.target) as env:
        env.reset()
        with pytest.raises(EnvError) as refused:
            env.reset(options=CodingResetOptions(limits=limits))
        assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.message == message
        assert run(env, "print('the episode stands')").stdout == "the episode stands\n"


def test_defaults_are_lowered_to_the_servers_maxima(limited: ServerProcess) -> None:
    with CodingEnv(limited.target) as env:
        state = env.state()
        assert state.maximums == CodingLimits(
            cpu_seconds=2, wall_ms=3000, memory_mb=256, output_bytes=1024, processes=16,
            file_size_mb=2,
        )  # fmt: skip
        assert state.max_sandbox_memory_mb == 192 and state.network_allowed
        # The defaults (5 s, 10 s, 512 MiB, 64 KiB, 32, 16 MiB) do not exceed the maxima.
        assert state.limits == CodingLimits(
            cpu_seconds=2, wall_ms=3000, memory_mb=192, output_bytes=1024, processes=16,
            file_size_mb=2,
        )  # fmt: skip
        env.reset()
        assert run(env, "print(1)").stdout == "1\n"


def test_maxima_can_come_from_the_factory_instead() -> None:
    server = ServerProcess(
        "openenv_grpc_envs.coding.tests.factories:strict", extra_env={"CODING_MAX_WALL_MS": "9"}
    )
    try:
        with CodingEnv(server.target) as env:
            assert env.state().maximums.wall_ms == 2000  # the factory's, not the variable's
            assert env.state().maximums.processes == 8
            with pytest.raises(EnvError) as refused:
                env.reset(options=CodingResetOptions(limits=CodingLimits(wall_ms=2001)))
            assert refused.value.message == (
                "limits.wall_ms is 2001; the server's maximum is 2000 (CODING_MAX_WALL_MS)"
            )
    finally:
        server.stop()


def test_allow_network_is_refused_unless_the_server_allows_it(full: ServerProcess) -> None:
    with CodingEnv(full.target) as env:
        env.reset()
        assert not env.state().network_allowed
        with pytest.raises(EnvError) as refused:
            env.reset(options=CodingResetOptions(allow_network=True))
        assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.message == (
            "allow_network is true, but this server does not allow the sandbox network "
            "(CODING_ALLOW_NETWORK=0)"
        )
        assert env.state().network_isolated  # the episode stands, isolated


@pytest.mark.parametrize(
    ("env_var", "value", "message"),
    [
        ("CODING_MAX_WALL_MS", "abc", "CODING_MAX_WALL_MS='abc' is not a whole number"),
        ("CODING_MAX_MEMORY_MB", "1e3", "CODING_MAX_MEMORY_MB='1e3' is not a whole number"),
        ("CODING_MAX_PROCESSES", "-4", "CODING_MAX_PROCESSES='-4' is not a whole number"),
        ("CODING_MAX_PROCESSES", "1", "CODING_MAX_PROCESSES=1 must be in 2..2147483647"),
        ("CODING_MAX_MEMORY_MB", "32", "CODING_MAX_MEMORY_MB=32 must be in 64..2147483647"),
        ("CODING_MAX_CPU_SECONDS", "0", "CODING_MAX_CPU_SECONDS=0 must be in 1..2147483647"),
        ("CODING_ALLOW_NETWORK", "yes", "CODING_ALLOW_NETWORK='yes' must be 0 or 1"),
    ],
)
def test_bad_settings_are_refused_naming_the_variable(
    env_var: str, value: str, message: str
) -> None:
    with pytest.raises(ValueError) as refused:
        CodingSettings.from_env({env_var: value})
    assert str(refused.value) == message


def test_a_server_with_a_bad_setting_says_which() -> None:
    """A bad CODING_* value stops the server at start (the env's check_settings), exit 2,
    naming the variable -- instead of failing every session."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "openenv_grpc", "serve", "coding", "--port", "0"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "CODING_MAX_WALL_MS": "10s"},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "CODING_MAX_WALL_MS='10s' is not a whole number" in done.stderr
    assert "openenv-grpc: serving" not in done.stdout


# -- 5. user namespaces and mounts ----------------------------------------------------

ESCAPES = """\
import ctypes, json, os, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
CLONE_NEWUSER, CLONE_NEWNS, SIGCHLD = 0x10000000, 0x00020000, 17

def call(result):
    if result < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return "ok"

def clone_user():
    pid = libc.syscall(56, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)  # clone(2) on x86-64
    if pid == 0:
        os._exit(0)
    return call(pid)

def mount_100g():  # what the issue did: a user + mount namespace, then a big tmpfs
    call(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS))
    return call(libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, b"size=100g"))

def attempt(escape):
    # Each in a fresh child, so that one that works does not change the next.
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            outcome = escape()
        except OSError as exc:
            outcome = exc.strerror
        os.write(write, outcome.encode())
        os._exit(0)
    os.close(write)
    outcome = os.read(read, 200).decode()
    os.waitpid(pid, 0)
    return outcome

seen = {
    "unshare(NEWUSER)": attempt(lambda: call(libc.unshare(CLONE_NEWUSER))),
    "clone(NEWUSER)": attempt(clone_user),
    "unshare(NEWUSER|NEWNS) + mount tmpfs size=100g": attempt(mount_100g),
    "mount tmpfs": attempt(lambda: call(libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, b"size=1m"))),
}
if hasattr(os, "unshare"):  # Python 3.12+
    seen["os.unshare"] = attempt(lambda: os.unshare(os.CLONE_NEWUSER) or "ok")
seen["unshare -Urm"] = subprocess.run(["unshare", "-Urm", "true"], capture_output=True).returncode
thread = threading.Thread(target=lambda: None)
thread.start()
thread.join()
seen["subprocess"] = subprocess.run(["true"]).returncode
print(json.dumps(seen))
"""


def test_user_namespaces_and_mounts_fail_inside(host: ServerProcess) -> None:
    with CodingEnv(host.target) as env:
        env.reset()
        seen = facts(run(env, ESCAPES))
        report(f"{host_kind(env.state())} escapes: {seen}")
    refused = "Operation not permitted"
    assert seen.pop("os.unshare", refused) == refused
    assert seen == {
        "unshare(NEWUSER)": refused,
        "clone(NEWUSER)": refused,
        "unshare(NEWUSER|NEWNS) + mount tmpfs size=100g": refused,
        "mount tmpfs": refused,
        "unshare -Urm": 1,
        "subprocess": 0,  # threads and child processes still work under the filter
    }


# -- 6. the network -------------------------------------------------------------------


def _connect(target: str) -> str:
    host, port = target.split(":")
    return (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(({host!r}, {port}), timeout=2).close()\n"
        "    print('connected')\n"
        "except OSError as exc:\n"
        "    print(exc.errno)\n"
    )


def test_network_is_off_unless_the_server_allows_it(
    full: ServerProcess, limited: ServerProcess
) -> None:
    # Not allowed: an empty network namespace, not even loopback (ENETUNREACH).
    with CodingEnv(full.target) as env:
        env.reset()
        assert run(env, _connect(full.target)).stdout == "101\n"
    with CodingEnv(limited.target) as env:
        env.reset()  # allowed, but not asked for: still isolated
        assert env.state().network_isolated
        assert run(env, _connect(limited.target)).stdout == "101\n"
        # Asked for and allowed: the server's own network namespace, which reaches the
        # server's own port (and anything else the server reaches).
        env.reset(options=CodingResetOptions(allow_network=True))
        assert not env.state().network_isolated
        assert run(env, _connect(limited.target)).stdout == "connected\n"


def test_a_host_that_cannot_cut_the_network_refuses_sessions() -> None:
    server = _serve({}, degraded=True)
    try:
        with pytest.raises(SessionRefused) as refused, CodingEnv(server.target):
            pass
        assert refused.value.code is grpc.StatusCode.INTERNAL
        assert "this host cannot cut the sandbox's network" in refused.value.message
        assert "set CODING_ALLOW_NETWORK=1" in refused.value.message
    finally:
        server.stop()


# -- 7. owners that die ---------------------------------------------------------------


@pytest.fixture
def orphans() -> Iterator[Any]:
    """Starts helper processes that each own a sandbox running hostile code (see
    ``orphan_helper.py``); returns (process, sandbox, what the code made). All are killed
    and their sandboxes reclaimed at the end."""
    helpers: list[subprocess.Popen[str]] = []

    def start(env: dict[str, str]) -> tuple[subprocess.Popen[str], Any, Any]:
        helper = subprocess.Popen(
            [sys.executable, "-m", "openenv_grpc_envs.coding.tests.orphan_helper"],
            stdout=subprocess.PIPE, text=True, env={**os.environ, **env},
        )  # fmt: skip
        helpers.append(helper)
        assert helper.stdout is not None
        sandbox = json.loads(helper.stdout.readline())
        made = Path(sandbox["workdir"]) / "facts.json"
        wait_until(made.exists, "the hostile code set up", timeout=20)
        return helper, sandbox, json.loads(made.read_text())

    yield start
    for helper in helpers:
        helper.kill()
        helper.wait(10)
        if helper.stdout is not None:
            helper.stdout.close()
    CodingEnvironment.reclaim_orphans()


@pytest.mark.parametrize("kind", ["full", "degraded"])
def test_a_dead_owners_sandbox_is_reclaimed_and_a_live_one_is_not(kind: str, orphans: Any) -> None:
    env = {**DEGRADED, "PYTHONPATH": str(HERE / "degraded")} if kind == "degraded" else {}
    dead, sandbox, made = orphans(env)
    _live, live_sandbox, live_made = orphans(env)
    uid = sandbox["uid"]
    dead.send_signal(signal.SIGKILL)
    dead.wait(10)
    # What the dead owner left: its code's child, directory, cgroups, IPC, files.
    assert made["child"] in live_pids(uid)
    assert Path(sandbox["base"]).is_dir()
    assert all(Path(p).is_dir() for p in sandbox["cgroups"])
    assert len(sandbox["cgroups"]) == (2 if kind == "full" else 0)  # memory, pids (v1)
    assert made["child"] in in_namespace(made["ipc_ns"])
    if kind == "degraded":
        assert len(host_segments(uid)) == 1
        assert len(files_of(uid, "/dev/shm", "/run/lock", "/tmp")) == 3
    else:  # in the namespaces the child still holds
        assert Path(f"/proc/{made['child']}/root/dev/shm/orphan-{uid}").exists()
        assert len(files_of(uid, "/tmp")) == 1

    started = time.monotonic()
    CodingEnvironment.reclaim_orphans()  # from another process: this one
    report(
        f"{kind} reclaim: 1 dead owner's sandbox reclaimed in {time.monotonic() - started:.3f} s"
    )

    assert live_pids(uid) == []
    assert not Path(sandbox["base"]).exists()
    assert not any(Path(p).exists() for p in sandbox["cgroups"])
    assert host_segments(uid) == []
    assert files_of(uid, "/dev/shm", "/run/lock", "/tmp", "/var/tmp") == []
    if kind == "full":
        wait_until(lambda: not in_namespace(made["ipc_ns"]), "the IPC namespace freed")
    assert not list(REGISTRY.glob(Path(sandbox["base"]).name + "*"))
    # The live owner's sandbox is untouched.
    assert live_made["child"] in live_pids(live_sandbox["uid"])
    assert Path(live_sandbox["workdir"], "facts.json").exists()
    assert list(REGISTRY.glob(Path(live_sandbox["base"]).name + "*"))


def _hostile_step(env: CodingEnv) -> threading.Thread:
    """Steps the orphan helper's hostile code on ``env`` in a thread (it never returns)."""

    def step() -> None:
        with contextlib.suppress(Exception):  # the server (or its worker) is killed under it
            env.step(CodingAction(code=HOSTILE))

    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    return thread


def test_a_killed_servers_leftovers_are_reclaimed_by_the_next_server() -> None:
    servers = [_serve({})]
    try:
        env = CodingEnv(servers[0].target)
        env.open()
        env.reset(options=CodingResetOptions(limits=CodingLimits(wall_ms=60_000)))
        state = env.state()
        _hostile_step(env)
        made = Path(state.workdir) / "facts.json"
        wait_until(made.exists, "the hostile code set up", timeout=20)
        child = json.loads(made.read_text())["child"]
        servers[0].proc.kill()  # as Docker does when a drain overruns its grace
        servers[0].proc.wait(10)
        env.abort()
        assert child in live_pids(state.sandbox_uid) and Path(state.workdir).exists()
        servers.append(_serve({}))  # the new server reclaims the old one's sandboxes at start
        wait_until(lambda: not Path(state.workdir).parent.exists(), "the old sandbox reclaimed")
        assert live_pids(state.sandbox_uid) == []  # killed before the directory went
        assert files_of(state.sandbox_uid, "/tmp") == []
        assert f"reclaiming {Path(state.workdir).parent}" in servers[1].stderr()
        with CodingEnv(servers[1].target) as fresh:
            fresh.reset()
            assert run(fresh, "print('fresh')").stdout == "fresh\n"
    finally:
        for server in servers:
            server.stop()
        CodingEnvironment.reclaim_orphans()  # whatever a failure above left


def test_a_killed_isolated_workers_leftovers_are_reclaimed() -> None:
    server = _serve({}, "--isolated", "1")
    try:
        env = CodingEnv(server.target)
        env.open()
        env.reset(options=CodingResetOptions(limits=CodingLimits(wall_ms=60_000)))
        state = env.state()
        _hostile_step(env)
        made = Path(state.workdir) / "facts.json"
        wait_until(made.exists, "the hostile code set up", timeout=20)
        child = json.loads(made.read_text())["child"]
        # The worker is the parent of the run's harness: the one process of the uid
        # whose parent runs under another uid.
        parents = {_parent(pid) for pid in live_pids(state.sandbox_uid)}
        (worker,) = parents - set(live_pids(state.sandbox_uid))
        assert worker != server.proc.pid and child in live_pids(state.sandbox_uid)
        os.kill(worker, signal.SIGKILL)  # the child does not die with it (no pdeathsig)
        env.abort()
        # The server's front reclaims what the dead worker left (in a thread of its own).
        base = Path(state.workdir).parent
        wait_until(lambda: not base.exists(), "the dead worker's sandbox reclaimed")
        assert live_pids(state.sandbox_uid) == []  # killed before the directory went
        assert f"reclaiming {Path(state.workdir).parent}" in server.stderr()
        # A new session works (opened once the front has seen the death: one opened at
        # the same instant can still land on the dead worker, see the report).
        with CodingEnv(server.target) as fresh:
            fresh.reset()
            assert run(fresh, "print('fresh')").stdout == "fresh\n"
    finally:
        server.stop()
        CodingEnvironment.reclaim_orphans()  # whatever a failure above left
