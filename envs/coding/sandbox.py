"""The server side of the sandbox: where code runs, under which limits, and its clean-up.

One :class:`Sandbox` per episode owns a private directory tree and, when the server runs
as root, a user id of its own (leased host-wide, see :class:`UidLease`). Each run is a
child process ``[unshare --net --] [setpriv <drop to the uid> --] python -I -S -u -B -c
<harness> ...`` in a new session, watched from the calling thread: a selector reads
stdout and stderr up to a cap, a deadline enforces wall time, samples count the
sandbox's tasks, and when the run ends, for any reason, every process of the sandbox is
killed, the child reaped, and orphaned zombies reaped too.

Why a private uid: RLIMIT_NPROC is not enforced for root, and code running as root could
signal the server or read its files. Under its own uid the kernel caps the sandbox's
tasks, the code cannot touch the server or other sandboxes, and "every process of the
sandbox" is "every process of that uid", which one kill(-1) issued under that uid ends
atomically (a /proc scan alone can be outrun by code that forks and exits in a loop).
Without root the sandbox falls back to the server's uid, the run's session id and an
approximate process cap (see the README for what that does and does not hide).

Every child is spawned with plain ``subprocess.Popen`` arguments that let CPython use
vfork: no ``preexec_fn`` and no ``user=``/``group=`` (those force a real fork of this
multi-threaded gRPC process, whose children were seen to die of SIGSEGV before exec).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import random
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from openenv_grpc_envs.coding.v1.coding_pb2 import Limit

__all__ = ["HostSupport", "Limits", "RunResult", "Sandbox", "UidLease", "host_support"]

log = logging.getLogger(__name__)

#: The harness's source, passed to ``python -c`` (it is never imported by the server).
HARNESS = (Path(__file__).resolve().parent / "harness.py").read_text(encoding="utf-8")

#: Sandbox uids (and gids) are drawn from here; far above any real account.
UID_BASE = 1_600_000_000
UID_SPAN = 100_000_000
#: First and later samples of the sandbox's task count, in seconds from the start.
FIRST_SAMPLE = 0.05
SAMPLE_EVERY = 0.2
#: After the main process ends, how long to wait for its pipes to drain.
DRAIN_SECONDS = 1.0
#: Verdict-pipe bytes kept (the code can write there too).
VERDICT_CAP = 256 * 1024
#: Where code may leave files outside its working directory; swept at close.
SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")
#: Directories searched for setpriv, unshare and python3 besides the server's PATH.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The whole environment of a run (HOME and TMPDIR are added per sandbox).
RUN_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    # glibc reserves 64 MiB of address space per thread arena; keep threads under RLIMIT_AS.
    "MALLOC_ARENA_MAX": "2",
}


@dataclass(frozen=True, slots=True)
class Limits:
    """Resource limits of every run of a sandbox (all values filled in)."""

    cpu_seconds: int
    wall_ms: int
    memory_mb: int
    output_bytes: int
    processes: int
    file_size_mb: int


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


@dataclass(frozen=True, slots=True)
class HostSupport:
    """What this host lets the sandbox do; probed once per server process."""

    #: The server runs as root: each sandbox gets a uid of its own.
    own_uid: bool
    #: Path of setpriv (drops the uid, sets no_new_privs and the parent-death signal);
    #: without it the harness drops the uid itself.
    setpriv: str | None
    #: Path of unshare when an empty network namespace can be made, else None.
    unshare: str | None
    #: The interpreter that runs the code, and its version.
    python: str
    python_version: str
    #: Path of kill(1), when ``setpriv ... kill -KILL -1`` works; else a python one-liner
    #: does the same kill(-1) (a few ms slower).
    kill: str | None = None
    #: kill(-1) under a sandbox uid was seen to work; if not, /proc scans stand in.
    killer_works: bool = False
    #: Orphaned sandbox processes end up as this server's children, which reaps them.
    reaps_orphans: bool = False


#: Python that drops from root to the uid in ``sys.argv[1]`` (used when setpriv is
#: missing; raises before anything else runs if the kernel did not comply).
DROP = """\
import os, sys
_u = int(sys.argv.pop(1))
os.setgroups([])
os.setresgid(_u, _u, _u)
os.setresuid(_u, _u, _u)
if _u <= 0 or os.getresuid() != (_u, _u, _u) or os.getresgid() != (_u, _u, _u):
    raise SystemExit(125)
"""
#: Run under a sandbox uid, ends every process of that uid in one kill(-1).
KILL_ALL = "os.kill(-1, 9)\n"

_support: HostSupport | None = None
_support_lock = threading.Lock()


def host_support() -> HostSupport:
    """Probe the host once (about 100 ms) and remember the answer."""
    global _support
    with _support_lock:
        if _support is None:
            _support = _probe()
            log.info("coding sandbox: %s", _support)
        return _support


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.pathsep.join((os.environ.get("PATH", ""), SYSTEM_PATH)))


def _as_uid(setpriv: str | None, uid: int, python: str, source: str, *args: str) -> list[str]:
    """argv that runs python ``source`` under ``uid`` (and nothing else: no groups).

    Never ``Popen(user=...)``: that forbids vfork, and a plain fork of a gRPC server runs
    its at-fork handlers, which were seen to crash the child (SIGSEGV) now and then.
    """
    if setpriv is not None:
        return [*_drop(setpriv, uid), python, "-I", "-S", "-c", source, *args]
    return [python, "-I", "-S", "-c", DROP + source, str(uid), *args]


def _drop(setpriv: str, uid: int) -> list[str]:
    """setpriv arguments that run the rest of the command as ``uid`` with nothing else."""
    return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--nnp",
            "--pdeathsig", "KILL", "--"]  # fmt: skip


def killer_argv(support: HostSupport, uid: int) -> list[str]:
    """argv that SIGKILLs every process of ``uid`` at once (never root's: see the guard)."""
    if uid < UID_BASE:
        raise ValueError(f"refusing to kill every process of uid {uid}")
    if support.kill is not None and support.setpriv is not None:
        return [*_drop(support.setpriv, uid), support.kill, "-KILL", "-1"]
    return _as_uid(support.setpriv, uid, support.python, "import os\n" + KILL_ALL)


def _probe() -> HostSupport:
    setpriv = _which("setpriv")
    reaps = _become_subreaper()
    if os.geteuid() != 0:
        python, version = _pick_python(None, setpriv)
        return HostSupport(False, setpriv, None, python, version, reaps_orphans=reaps)
    with UidLease() as lease:
        uid = lease.uid
        python, version = _pick_python(uid, setpriv)
        unshare = _which("unshare")
        if unshare is not None and (
            _quiet([unshare, "--net", "--", *_as_uid(setpriv, uid, python, "")]) is None
        ):
            unshare = None
        support = HostSupport(True, setpriv, unshare, python, version, reaps_orphans=reaps)
        # Prefer kill(1) behind setpriv (two small execs); else the python one-liner.
        for kill in (_which("kill") if setpriv else None, None):
            candidate = replace(support, kill=kill, killer_works=True)
            if _killer_kills(candidate, uid):
                return candidate
        log.warning("coding sandbox: kill(-1) under a sandbox uid failed; using /proc scans")
        return support


def _killer_kills(support: HostSupport, uid: int) -> bool:
    """Whether :func:`killer_argv` ends a sleeping process of ``uid``."""
    victim = subprocess.Popen(
        _as_uid(support.setpriv, uid, support.python, "import time\ntime.sleep(30)\n"),
        env=RUN_ENV, cwd="/",
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        time.sleep(0.05)  # let it drop to the uid
        _quiet(killer_argv(support, uid))
        return victim.wait(5) == -signal.SIGKILL
    except subprocess.TimeoutExpired:
        return False
    finally:
        victim.kill()
        victim.wait()


def _quiet(argv: list[str]) -> str | None:
    """Run a short probe; its stdout, or None when it failed."""
    try:
        done = subprocess.run(
            argv, capture_output=True, timeout=20, env=RUN_ENV, cwd="/", check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.decode() if done.returncode == 0 else None


def _pick_python(uid: int | None, setpriv: str | None) -> tuple[str, str]:
    """The first interpreter that works the same under the sandbox's uid as for the server.

    A virtualenv's or pyenv's python under /root may start under another uid yet fall back
    to a different standard library; comparing ``sys.prefix`` both ways rules that out.
    """
    # Imports after the uid drop prove the standard library is readable by the sandbox.
    probe = "import json, socket, sys; print(sys.prefix, '%d.%d.%d' % sys.version_info[:3])"
    override = os.environ.get("OPENENV_CODING_PYTHON")
    candidates = (
        [override]
        if override
        else [
            sys.executable,
            os.path.realpath(sys.executable),
            getattr(sys, "_base_executable", ""),
            "/usr/bin/python3",
            "/usr/local/bin/python3",
            _which("python3") or "",
        ]
    )
    seen: set[str] = set()
    for exe in candidates:
        if not exe or exe in seen or not os.access(exe, os.X_OK):
            continue
        seen.add(exe)
        mine = _quiet([exe, "-I", "-S", "-c", probe])
        if mine is None:
            continue
        if uid is None or _quiet(_as_uid(setpriv, uid, exe, probe)) == mine:
            return exe, mine.split()[-1]
    raise RuntimeError(f"no python interpreter runs the same under uid {uid}: tried {seen}")


class UidLease:
    """A sandbox uid no other sandbox on this host holds, until :meth:`release`.

    The lease is an abstract unix socket named after the uid: binding it is atomic and
    exclusive host-wide (per network namespace), and the kernel drops it when the socket
    closes or the server dies, so no lock file can go stale.
    """

    def __init__(self, killer: Callable[[int], list[str]] | None = None) -> None:
        self._killer = killer
        self._sock: socket.socket | None = None
        rng = random.SystemRandom()
        for _ in range(1000):
            uid = UID_BASE + rng.randrange(UID_SPAN)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(f"\0openenv-coding-uid-{uid}".encode())
            except OSError:
                sock.close()
                continue
            self.uid = uid
            self._sock = sock
            break
        else:
            raise RuntimeError("no free sandbox uid")
        # A dead server's sandbox may have left processes under this uid: end them.
        if processes(self.owns):
            self.kill_all()

    def owns(self, fields: ProcFields) -> bool:
        """Whether a process runs under the leased uid."""
        return fields.uid == self.uid

    def kill_all(self) -> bool:
        """SIGKILL every process of the uid; True when none is left.

        kill(-1) from a process of the uid signals all of them in one pass under the
        kernel's task-list lock, and a process with SIGKILL pending cannot fork: nothing
        escapes, not even code that forks and exits in a loop to stay ahead of a /proc
        scan (which is what a scan alone would miss).
        """
        if self._killer is not None:
            _quiet(self._killer(self.uid))  # kill(1) exits 1 when some pid vanished meanwhile
            deadline = time.monotonic() + 2
            while processes(self.owns):  # the killed ones are still on their way out
                if time.monotonic() > deadline:
                    break
                time.sleep(0.002)
            else:
                return True
        return kill_matching(self.owns)

    def release(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> UidLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(frozen=True, slots=True)
class ProcFields:
    """What :func:`processes` reads of one process."""

    pid: int
    uid: int
    session: int
    threads: int
    parent: int
    zombie: bool


def processes(match: Callable[[ProcFields], bool], *, zombies: bool = False) -> list[ProcFields]:
    """Live processes of the host that ``match`` selects (or, with ``zombies``, dead ones)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _read_proc(int(name))
        if fields is not None and fields.zombie == zombies and match(fields):
            found.append(fields)
    return found


def reap_orphans(match: Callable[[ProcFields], bool]) -> int:
    """Reap the zombies ``match`` selects that were left to this process; how many.

    Killed sandbox processes whose parent died first are reparented to the nearest
    subreaper (this server, see :func:`_become_subreaper`) or to pid 1, which is this
    server too when it runs as a container's first process. Nobody else would reap them,
    and under the sandbox's uid every zombie still counts against RLIMIT_NPROC.
    """
    me = os.getpid()
    reaped = 0
    for zombie in processes(lambda f: f.parent == me and match(f), zombies=True):
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(zombie.pid, os.WNOHANG)[0]:
                reaped += 1
    return reaped


def _become_subreaper() -> bool:
    """Make orphaned descendants this process's children (PR_SET_CHILD_SUBREAPER)."""
    if os.getpid() == 1:
        return True
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(36, 1, 0, 0, 0) == 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _read_proc(pid: int) -> ProcFields | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
        # The command name may hold spaces and parentheses: split after the last ")".
        rest = stat_line.rsplit(b")", 1)[1].split()
        uid_at = status.index(b"\nUid:")
        uid = int(status[uid_at + 5 :].split(None, 1)[0])  # the real uid
        zombie = rest[0] in (b"Z", b"X")
        return ProcFields(pid, uid, int(rest[3]), int(rest[17]), int(rest[1]), zombie)
    except (OSError, ValueError, IndexError):
        return None  # gone meanwhile, or not ours to read


def _signal(pid: int, match: Callable[[ProcFields], bool]) -> None:
    """SIGKILL ``pid`` if it still matches, without racing pid reuse (via a pidfd)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return  # already gone
    try:
        # The pidfd pins the process: if /proc/pid still matches, it is the same one.
        fields = _read_proc(pid)
        if fields is not None and match(fields):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(pidfd)


def kill_matching(match: Callable[[ProcFields], bool], rounds: int = 200) -> bool:
    """SIGKILL every process ``match`` selects, until none is left; True if none is."""
    for attempt in range(rounds):
        victims = processes(match)
        if not victims:
            return True
        for victim in victims:
            _signal(victim.pid, match)
        time.sleep(min(0.001 * attempt, 0.02))  # let the kernel tear them down
    return not processes(match)


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
    """One episode's sandbox: a directory tree, maybe a uid, and a way to run code in it.

    Layout under ``base`` (a fresh ``openenv-coding-*`` temp dir): ``work/`` is the
    code's cwd, HOME and TMPDIR (owned by the sandbox uid); ``src/`` holds ``main.py``,
    the assertion tests and the staged files, owned by root and readable by the sandbox's
    group only, so that the code cannot change them and other sandboxes cannot read them.
    """

    def __init__(self, limits: Limits, *, allow_network: bool) -> None:
        self.support = host_support()
        self.limits = limits
        support = self.support
        killer = functools.partial(killer_argv, support) if support.killer_works else None
        self._lease = UidLease(killer) if support.own_uid else None
        self.uid = self._lease.uid if self._lease is not None else os.getuid()
        self.network_isolated = self.support.unshare is not None and not allow_network
        try:
            self.base = Path(tempfile.mkdtemp(prefix=f"openenv-coding-{os.getpid()}-"))
            self.src = self.base / "src"
            self.workdir = self.base / "work"
            self.src.mkdir()
            self.workdir.mkdir()
            if self._lease is not None:
                os.chown(self.base, 0, self.uid)
                os.chmod(self.base, 0o710)
                os.chown(self.src, 0, self.uid)
                os.chmod(self.src, 0o750)
                os.chown(self.workdir, self.uid, self.uid)
                os.chmod(self.workdir, 0o700)
        except BaseException:
            self.close()
            raise
        self._env = {**RUN_ENV, "HOME": str(self.workdir), "TMPDIR": str(self.workdir)}
        self.closed = False

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
            shutil.rmtree(self.src / stale, ignore_errors=True)
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
        prefix: list[str] = []
        if self.network_isolated and support.unshare is not None:
            prefix += [support.unshare, "--net", "--"]
        if support.setpriv is not None:
            if self._lease is not None:
                prefix += _drop(support.setpriv, self.uid)
            else:
                prefix += [support.setpriv, "--nnp", "--pdeathsig", "KILL", "--"]
        # Without setpriv the harness drops root to the sandbox uid itself, first thing.
        drop = self.uid if self._lease is not None and support.setpriv is None else 0
        return [
            *prefix, support.python, "-I", "-S", "-u", "-B", "-c", HARNESS,
            str(drop), str(verdict_fd), str(limits.cpu_seconds), str(limits.memory_mb << 20),
            str(limits.processes), str(limits.file_size_mb << 20),
            "own" if self._lease is not None else "shared",
            str(self.src / "main.py"), str(self.workdir), staging, *tests,
        ]  # fmt: skip

    def _matcher(self, leader: int) -> Callable[[ProcFields], bool]:
        """What counts as the sandbox's process: its uid, else the run's session."""
        if self._lease is not None:
            return self._lease.owns
        return lambda fields: fields.session == leader

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
            return self._supervise(proc, verdict_r, start)
        finally:
            os.close(verdict_r)
            if verdict_w >= 0:
                os.close(verdict_w)

    def _supervise(self, proc: subprocess.Popen[bytes], verdict_fd: int, start: float) -> RunResult:
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
            if not (self._lease.kill_all() if self._lease is not None else kill_matching(match)):
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
        limit = _which_limit(
            killed_for=killed_for,
            crowded=crowded,
            output=out.truncated or err.truncated,
            verdicts=lines,
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
        """Kill what is left, delete the directory tree, free the uid. Idempotent."""
        if getattr(self, "closed", False):
            return
        self.closed = True
        lease = getattr(self, "_lease", None)
        if lease is not None:
            if processes(lease.owns):
                lease.kill_all()
            _sweep_shared_tmp(lease.uid)
        base = getattr(self, "base", None)
        if base is not None:
            # rmtree never follows the symlinks the code may have left behind.
            shutil.rmtree(base, ignore_errors=True)
        if lease is not None:
            lease.release()


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
    exit_code: int,
    cpu: float,
    cpu_limit: int,
) -> Limit.ValueType:
    """The limit to report; specific causes before the time limits that usually follow."""
    if crowded:
        return Limit.LIMIT_PROCESSES
    if output or killed_for == Limit.LIMIT_OUTPUT:
        return Limit.LIMIT_OUTPUT
    if "limit memory" in verdicts:
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


def _sweep_shared_tmp(uid: int) -> None:
    """Remove what the sandbox's uid left at the top of the world-writable temp dirs."""
    for folder in SHARED_TMP:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
                if info.st_uid != uid:
                    continue
                if stat.S_ISDIR(info.st_mode):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    log.warning("coding sandbox: could not remove %s: %s", entry.path, exc)
