"""The server side of the sandbox: where code runs, under which limits, and its clean-up.

One :class:`Sandbox` per episode owns a private directory tree, a record in the host's
registry of live sandboxes (see ``registry.py``), and, when the server runs as root, a
user id of its own (``uids.py``) and a cgroup (``cgroups.py``). Each run is a child
process ``python -I -S -u -B -c <harness> ...`` in a new session; the harness builds the
rest of the sandbox before the code starts (namespaces, private tmpfs, the uid drop, the
seccomp filter: see ``harness.py``). The run is watched from the calling thread: a
selector reads stdout and stderr up to a cap, a deadline enforces wall time, samples
count the sandbox's tasks, and when the run ends, for any reason, every process of the
sandbox is killed, the child reaped, orphaned zombies reaped too, and what the run could
leave in shared places (SysV IPC, ``/dev/shm``) removed where no namespace did it.

Without root the sandbox falls back to the server's uid, the run's session id and an
approximate process cap (see the README for what that does and does not hide).

Every child is spawned with plain ``subprocess.Popen`` arguments that let CPython use
vfork: no ``preexec_fn`` and no ``user=``/``group=`` (those force a real fork of this
multi-threaded gRPC process, whose children were seen to die of SIGSEGV before exec).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import selectors
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from openenv_grpc_envs.coding import leftovers
from openenv_grpc_envs.coding.cgroups import SandboxCgroup
from openenv_grpc_envs.coding.harness import SETUP_FAILED
from openenv_grpc_envs.coding.host import RUN_ENV, HostSupport, log_support, probe_host
from openenv_grpc_envs.coding.limits import Limits
from openenv_grpc_envs.coding.processes import (
    ProcFields,
    kill_matching,
    processes,
    reap_orphans,
    start_time,
)
from openenv_grpc_envs.coding.reclaim import BASE_PREFIX, reclaim_orphans
from openenv_grpc_envs.coding.registry import Registration, registry_dir
from openenv_grpc_envs.coding.removal import remove_tree
from openenv_grpc_envs.coding.uids import UidLease
from openenv_grpc_envs.coding.v1.coding_pb2 import Limit

__all__ = ["RunResult", "Sandbox", "SandboxSetupError", "host_support"]

log = logging.getLogger(__name__)

#: The harness's source, passed to ``python -c`` (the server never runs it itself).
HARNESS = (Path(__file__).resolve().parent / "harness.py").read_text(encoding="utf-8")

#: First and later samples of the sandbox's task count, in seconds from the start.
FIRST_SAMPLE = 0.05
SAMPLE_EVERY = 0.2
#: After the main process ends, how long to wait for its pipes to drain.
DRAIN_SECONDS = 1.0
#: Verdict-pipe bytes kept (the code can write there too).
VERDICT_CAP = 256 * 1024
#: RAM-backed shared dirs: private per run with a mount namespace, else swept per run.
RUN_SCOPED_DIRS = ("/dev/shm", "/run/lock")
#: Limits of the runs that probe the host.
TRIAL_LIMITS = Limits(
    cpu_seconds=5, wall_ms=20_000, memory_mb=128, output_bytes=4096, processes=8, file_size_mb=1
)


class SandboxSetupError(RuntimeError):
    """The harness could not build the sandbox (before any submitted code ran)."""


@dataclass(slots=True)
class RunResult:
    """What one run of the code produced."""

    stdout: bytes
    stderr: bytes
    exit_code: int
    limit: Limit.ValueType
    wall_seconds: float
    cpu_seconds: float
    stdout_truncated: bool
    stderr_truncated: bool
    #: Lines the harness wrote to the verdict pipe.
    verdicts: list[str] = field(default_factory=list)


_support: HostSupport | None = None
_support_lock = threading.Lock()
#: Set when a close left something behind (its record kept): the next sandbox made in
#: this process reclaims first, so a long-running server finishes it without a restart.
_reclaim_due = threading.Event()


def host_support() -> HostSupport:
    """Probe the host once per process (about 100 ms), log what it allows, and reclaim
    what sandboxes of dead processes left behind (a previous run of the server)."""
    global _support
    with _support_lock:
        if _support is None:
            support = probe_host(_trial)
            log_support(support)
            reclaimed = reclaim_orphans(support.killer)
            if reclaimed:
                log.warning("coding sandbox: reclaimed %d sandboxes of dead processes", reclaimed)
            _support = support
        return _support


def _trial(support: HostSupport) -> str | None:
    """Run ``pass`` in a sandbox with ``support``; why that failed, or None."""
    try:
        sandbox = Sandbox(TRIAL_LIMITS, allow_network=False, support=support)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    try:
        sandbox.prepare("pass", (), {})
        result = sandbox.run(b"")
    except SandboxSetupError as exc:
        return str(exc)
    finally:
        sandbox.close()
    if result.exit_code != 0:
        lines = result.stderr.decode(errors="replace").strip().splitlines()
        return f"exit code {result.exit_code}: {lines[-1] if lines else ''}"
    return None


class _Capture:
    """Bytes read from one pipe, up to a cap."""

    __slots__ = ("cap", "chunks", "size", "truncated")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.chunks: list[bytes] = []
        self.size = 0
        self.truncated = False

    def add(self, data: bytes) -> None:
        room = self.cap - self.size
        if len(data) > room:
            data = data[: max(room, 0)]
            self.truncated = True
        self.chunks.append(data)
        self.size += len(data)

    def value(self) -> bytes:
        return b"".join(self.chunks)


class Sandbox:
    """One episode's sandbox: a directory tree, maybe a uid and a cgroup, and a way to run
    code in it.

    Layout under ``base`` (``<tmp>/openenv-coding-<pid>-<random>``): ``work/`` is the
    code's cwd, HOME and TMPDIR (owned by the sandbox uid); ``src/`` holds ``main.py``,
    the assertion tests and the staged files, owned by root and readable by the sandbox's
    group only, so that the code cannot change them and other sandboxes cannot read them.

    Args:
        limits: The limits of every run.
        allow_network: Runs share the server's network namespace (else they get an empty
            one, where the host allows).
        support: What the host allows (default: :func:`host_support`).

    Raises:
        OSError: the directory tree, cgroup or registry record could not be made.
    """

    def __init__(
        self, limits: Limits, *, allow_network: bool, support: HostSupport | None = None
    ) -> None:
        self.support = support = support if support is not None else host_support()
        if _reclaim_due.is_set():
            _reclaim_due.clear()
            reclaim_orphans(support.killer)
        self.limits = limits
        self.closed = False
        self._lease = UidLease(support.killer) if support.own_uid else None
        self.uid = self._lease.uid if self._lease is not None else os.getuid()
        self.network_isolated = support.network_namespace and not allow_network
        self.cgroup: SandboxCgroup | None = None
        self._registration: Registration | None = None
        self.base = Path()
        made_base = False
        try:
            name = f"{BASE_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
            self.base = Path(tempfile.gettempdir()) / name
            parents = support.cgroup
            planned = [] if parents is None else [str(parents.memory / name)]
            if parents is not None and parents.version == 1 and parents.pids is not None:
                planned.append(str(parents.pids / name))
            # Recorded before anything exists, so that reclaim finds all of it.
            self._registration = Registration(
                registry_dir(),
                name,
                {
                    "owner": os.getpid(),
                    "owner_start": start_time(os.getpid()) or 0,
                    "uid": self.uid,
                    "own_uid": self._lease is not None,
                    "base": str(self.base),
                    "cgroups": planned,
                },
            )
            self.src = self.base / "src"
            self.workdir = self.base / "work"
            self.base.mkdir(mode=0o700)
            made_base = True
            self.src.mkdir()
            self.workdir.mkdir()
            if self._lease is not None:
                os.chown(self.base, 0, self.uid)
                os.chmod(self.base, 0o710)
                os.chown(self.src, 0, self.uid)
                os.chmod(self.src, 0o750)
                os.chown(self.workdir, self.uid, self.uid)
                os.chmod(self.workdir, 0o700)
            if parents is not None:
                self.cgroup = SandboxCgroup(parents, name, limits.memory_mb << 20, limits.processes)
        except BaseException:
            if not made_base:
                self.base = Path()  # not ours: close() must not remove it
            self.close()
            raise
        self._env = {**RUN_ENV, "HOME": str(self.workdir), "TMPDIR": str(self.workdir)}

    # -- files ------------------------------------------------------------------------

    def _write_src(self, relative: str, text: str) -> str:
        """Write a file under ``src/`` (root-owned, so no symlink planted by code applies)."""
        path = self.src / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if self._lease is not None:
            os.chown(path.parent, 0, self.uid)
            os.chmod(path.parent, 0o750)
        path.write_text(text, encoding="utf-8")
        if self._lease is not None:
            os.chown(path, 0, self.uid)
            os.chmod(path, 0o640)
        return str(path)

    def prepare(
        self, code: str, assertions: Sequence[str], files: Mapping[str, str]
    ) -> tuple[list[str], str]:
        """Write the step's program, tests and files; their paths for :meth:`run`."""
        for stale in ("tests", "files"):
            if not remove_tree(self.src / stale):
                raise OSError(f"the last step's {stale} in {self.src} could not be removed")
        self._write_src("main.py", code)
        tests = [self._write_src(f"tests/{i}.test.py", text) for i, text in enumerate(assertions)]
        staging = ""
        if files:
            for relative, text in files.items():
                self._write_src(f"files/{relative}", text)
            staging = str(self.src / "files")
        return tests, staging

    def listing(self, limit: int = 100) -> tuple[list[str], int]:
        """Sorted top-level entries of the working directory (dirs end in "/"), and their count."""
        try:
            entries = list(os.scandir(self.workdir))
        except OSError:
            return [], 0
        names = sorted(e.name + ("/" if e.is_dir(follow_symlinks=False) else "") for e in entries)
        return names[:limit], len(names)

    # -- runs -------------------------------------------------------------------------

    def _argv(self, verdict_fd: int, tests: Sequence[str], staging: str) -> list[str]:
        limits = self.limits
        support = self.support
        namespaces = [
            name
            for name, wanted in (
                ("ipc", support.ipc_namespace),
                ("mnt", support.mount_namespace),
                ("net", self.network_isolated),
            )
            if wanted
        ]
        tmpfs_bytes = limits.memory_mb << 20 if support.mount_namespace else 0
        cgroups = "\n".join(self.cgroup.procs_files) if self.cgroup is not None else ""
        return [
            support.python, "-I", "-S", "-u", "-B", "-c", HARNESS,
            str(self.uid if self._lease is not None else 0), str(verdict_fd),
            str(limits.cpu_seconds), str(limits.memory_mb << 20),
            str(limits.processes), str(limits.file_size_mb << 20),
            "own" if self._lease is not None else "shared",
            ",".join(namespaces), str(tmpfs_bytes), "1" if support.seccomp else "0", cgroups,
            str(self.src / "main.py"), str(self.workdir), staging, *tests,
        ]  # fmt: skip

    def _matcher(self, leader: int) -> Callable[[ProcFields], bool]:
        """What counts as the sandbox's process: its uid, else the run's session."""
        if self._lease is not None:
            return self._lease.owns
        return lambda fields: fields.session == leader

    def _end_every_process(self, match: Callable[[ProcFields], bool]) -> bool:
        """SIGKILL whatever of the sandbox still runs; True when nothing is left.

        An empty cgroup proves there is nothing (the common case: the code left no
        background process), which saves spawning the uid's killer.
        """
        if self.cgroup is not None and self.cgroup.empty():
            return True
        if self._lease is not None:
            return self._lease.kill_all()
        return kill_matching(match)

    def run(self, stdin: bytes, tests: Sequence[str] = (), staging: str = "") -> RunResult:
        """Run ``src/main.py`` (then ``tests``) once; blocks until the run is over."""
        if self.closed:
            raise RuntimeError("sandbox is closed")
        verdict_r, verdict_w = os.pipe()
        try:
            with tempfile.TemporaryFile() as stdin_file:
                stdin_file.write(stdin)
                stdin_file.seek(0)
                start = time.monotonic()
                proc = subprocess.Popen(
                    self._argv(verdict_w, tests, staging),
                    stdin=stdin_file,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=(verdict_w,),
                    cwd=self.workdir,
                    env=self._env,
                    start_new_session=True,
                )
            os.close(verdict_w)
            verdict_w = -1
            if self._lease is None and self._registration is not None:
                # Without a uid of its own, the run's session is how reclaim finds it.
                leader_start = start_time(proc.pid) or 0
                self._registration.update(leader=proc.pid, leader_start=leader_start)
            oom_before = self.cgroup.oom_kills() if self.cgroup is not None else 0
            result = self._supervise(proc, verdict_r, start, oom_before)
        finally:
            os.close(verdict_r)
            if verdict_w >= 0:
                os.close(verdict_w)
        self._clear_run_leftovers()
        if result.exit_code == SETUP_FAILED and result.verdicts[:1] != ["setup ok"]:
            first = result.verdicts[0] if result.verdicts else "no word from the harness"
            raise SandboxSetupError(first.removeprefix("setup failed "))
        return result

    def _clear_run_leftovers(self) -> None:
        """Remove what a run could leave in shared places that no namespace of its own
        took away: the uid's SysV IPC objects and its files in /dev/shm and /run/lock."""
        if self._lease is None:
            return  # under the server's uid nothing tells the sandbox's objects apart
        if not self.support.ipc_namespace:
            leftovers.remove_ipc(self.uid)
        if not self.support.mount_namespace:
            leftovers.sweep_files(self.uid, RUN_SCOPED_DIRS)

    def _supervise(
        self, proc: subprocess.Popen[bytes], verdict_fd: int, start: float, oom_before: int
    ) -> RunResult:
        limits = self.limits
        assert proc.stdout is not None and proc.stderr is not None
        out, err = _Capture(limits.output_bytes), _Capture(limits.output_bytes)
        verdicts = _Capture(VERDICT_CAP)
        captures = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, verdict_fd: verdicts}
        match = self._matcher(proc.pid)
        selector = selectors.DefaultSelector()
        pidfd = -1
        try:
            for fd in captures:
                os.set_blocking(fd, False)
                selector.register(fd, selectors.EVENT_READ)
            with contextlib.suppress(OSError):
                pidfd = os.pidfd_open(proc.pid)
                selector.register(pidfd, selectors.EVENT_READ)  # readable once it exits
            deadline = start + limits.wall_ms / 1000
            next_sample = start + FIRST_SAMPLE
            killed_for: Limit.ValueType | None = None
            crowded = False
            while not _exited(proc.pid):
                now = time.monotonic()
                if now >= deadline:
                    killed_for = Limit.LIMIT_WALL_TIME
                    break
                timeout = min(deadline, next_sample) - now
                if pidfd < 0:
                    timeout = min(timeout, 0.02)  # no pidfd: poll for the exit
                for key, _ in selector.select(max(timeout, 0.0)):
                    if key.fd != pidfd:
                        _read(key.fd, captures[key.fd], selector)
                if out.truncated or err.truncated:
                    killed_for = Limit.LIMIT_OUTPUT
                    break
                if time.monotonic() >= next_sample:
                    tasks = sum(p.threads for p in processes(match))
                    crowded = crowded or tasks >= limits.processes
                    next_sample += SAMPLE_EVERY
            elapsed = time.monotonic() - start
            # The run is over: nothing of it may outlive it (background children included).
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            if not self._end_every_process(match):
                log.error("coding sandbox: processes of uid %d survived SIGKILL", self.uid)
            drain_until = time.monotonic() + DRAIN_SECONDS
            while len(selector.get_map()) > (1 if pidfd >= 0 else 0):
                left = drain_until - time.monotonic()
                if left <= 0:
                    break
                for key, _ in selector.select(left):
                    if key.fd != pidfd:
                        _read(key.fd, captures[key.fd], selector)
        finally:
            selector.close()
            if pidfd >= 0:
                os.close(pidfd)
        exit_code, cpu = _reap(proc)
        if self.support.reaps_orphans:
            reap_orphans(match)
        lines = verdicts.value().decode("utf-8", "replace").splitlines()
        oom = self.cgroup is not None and self.cgroup.oom_kills() > oom_before
        limit = _which_limit(
            killed_for=killed_for,
            crowded=crowded,
            output=out.truncated or err.truncated,
            verdicts=lines,
            oom=oom,
            exit_code=exit_code,
            cpu=cpu,
            cpu_limit=limits.cpu_seconds,
        )
        return RunResult(
            stdout=out.value(),
            stderr=err.value(),
            exit_code=exit_code,
            limit=limit,
            wall_seconds=elapsed,
            cpu_seconds=cpu,
            stdout_truncated=out.truncated,
            stderr_truncated=err.truncated,
            verdicts=lines,
        )

    # -- the end ----------------------------------------------------------------------

    def close(self) -> None:
        """Kill what is left, remove the cgroup, directory tree and the uid's leftovers
        (IPC objects, kernel keys, files in the shared temp dirs), free the uid.
        Idempotent, and never raises: whatever cannot be removed stays in the registry,
        for :func:`~openenv_grpc_envs.coding.reclaim.reclaim_orphans` to finish (logged)."""
        if self.closed:
            return
        self.closed = True
        clean = True
        try:
            if self._lease is not None:
                clean = self._lease.clear()
            if self.cgroup is not None and not self.cgroup.destroy():
                log.error("coding sandbox: cgroup %s could not be removed", self.cgroup.paths)
                clean = False
            if self.base.name:
                # Any depth or width, never through a link (see removal.py).
                clean = remove_tree(self.base) and clean
        except Exception:  # the record below must outlive any failure
            log.exception("coding sandbox: closing %s failed", self.base)
            clean = False
        finally:
            if self._registration is not None:
                if clean:
                    self._registration.close()
                else:
                    log.error(
                        "coding sandbox: %s not fully removed; its registry record stays "
                        "for the next reclaim (at the next sandbox)", self.base,
                    )  # fmt: skip
                    self._registration.abandon()
                    _reclaim_due.set()
            if self._lease is not None:
                self._lease.release()


def _exited(pid: int) -> bool:
    """The child has ended (left unreaped, so that its pid cannot be reused yet)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _read(fd: int, capture: _Capture, selector: selectors.BaseSelector) -> None:
    try:
        data = os.read(fd, 65536)
    except BlockingIOError:
        return
    except OSError:
        data = b""
    if data:
        capture.add(data)
    else:
        selector.unregister(fd)


def _reap(proc: subprocess.Popen[bytes]) -> tuple[int, float]:
    """Wait for the (killed) child; its exit code and CPU seconds."""
    for _ in range(500):
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        with contextlib.suppress(OSError):
            os.kill(proc.pid, signal.SIGKILL)
        time.sleep(0.01)
    else:  # pragma: no cover - a SIGKILLed child that never dies
        pid, status, usage = os.wait4(proc.pid, 0)
    exit_code = os.waitstatus_to_exitcode(status)
    proc.returncode = exit_code  # reaped here: Popen must not wait for it again
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
    return exit_code, usage.ru_utime + usage.ru_stime


def _which_limit(
    *,
    killed_for: Limit.ValueType | None,
    crowded: bool,
    output: bool,
    verdicts: Sequence[str],
    oom: bool,
    exit_code: int,
    cpu: float,
    cpu_limit: int,
) -> Limit.ValueType:
    """The limit to report; specific causes before the time limits that usually follow."""
    if crowded:
        return Limit.LIMIT_PROCESSES
    if output or killed_for == Limit.LIMIT_OUTPUT:
        return Limit.LIMIT_OUTPUT
    if oom or "limit memory" in verdicts:
        return Limit.LIMIT_MEMORY
    if "limit file_size" in verdicts:
        return Limit.LIMIT_FILE_SIZE
    if exit_code == -signal.SIGXCPU or (
        exit_code == -signal.SIGKILL and killed_for is None and cpu >= cpu_limit - 0.05
    ):
        return Limit.LIMIT_CPU_TIME
    if killed_for == Limit.LIMIT_WALL_TIME:
        return Limit.LIMIT_WALL_TIME
    return Limit.LIMIT_NONE
