"""The sandbox side of a run: builds the sandbox, then runs the submitted code and its tests.

The server never imports this module to run code: it passes its source to ``python -I -S
-u -B -c`` as the run's only program. So it may use only the standard library, imports
as little as it can (every import is start-up time of every run), and trusts nothing
that runs after it hands control to the submitted code.

When the server is root, the harness starts as root and builds the sandbox itself, in
this order, before any submitted byte is read: it moves itself into the sandbox's
cgroups (one memory and process budget for everything the run starts), unshares its IPC,
mount and network namespaces (SysV limits sized to the memory budget in the IPC one),
makes every mount private and puts a private tmpfs of the memory budget's size on
``/dev/shm`` and ``/run/lock``, joins a new session keyring (never the server's),
drops to the sandbox uid (no groups), sets
``no_new_privs`` and the parent-death signal, and loads a seccomp filter that refuses
new namespaces and mounts. Each step is asked for by the server (which probed what the
host allows); a step that was asked for and fails ends the run before the code starts
(exit 125, ``setup failed STEP: why`` on the verdict pipe). The server spawns this
process with plain ``Popen`` arguments, so it can vfork (see ``sandbox.py``).

Arguments (all strings, in order): the uid to drop to (``0``: stay), the verdict pipe's
fd, CPU seconds, address-space bytes, process cap, file-size bytes, process-cap mode
(``own`` when the sandbox has a user id of its own, ``shared`` when it runs under the
server's), namespaces to unshare (comma-separated ``ipc``, ``mnt``, ``net``; ``""`` for
none), the size in bytes of the private tmpfs mounts (``0``: none), ``1`` to load the
seccomp filter, the ``cgroup.procs`` files to join (newline-separated; ``""`` for none),
the path of ``main.py``, the working directory, the staging directory of the action's
files (``""`` for none), then one path per assertion test.

It writes one line per event to the verdict pipe: first ``setup ok`` (or ``setup failed
...``), which the code cannot forge because it has not started yet; then ``limit
memory`` / ``limit file_size`` (the code died of that), ``code ok`` (the code finished;
the tests start), ``pass I`` and ``fail I MESSAGE`` (test I). The submitted code can
write to that pipe too, so assertion verdicts are not proof against code written to
forge them; stdin/stdout tests, which the server judges itself, are.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys

#: Longest failure message sent back for one test.
MESSAGE_CHARS = 500
#: Exit code of a run whose sandbox could not be built.
SETUP_FAILED = 125

# Linux constants (include/uapi/linux/sched.h, mount.h, prctl.h, seccomp.h).
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWTIME = 0x00000080
NAMESPACE_FLAGS = {"ipc": CLONE_NEWIPC, "mnt": CLONE_NEWNS, "net": CLONE_NEWNET}
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_REC = 0x4000
MS_PRIVATE = 0x40000
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
#: keyctl(2) per architecture, and its operation that joins a new session keyring.
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}
KEYCTL_JOIN_SESSION_KEYRING = 1
#: Where the private tmpfs mounts go (when the directory exists).
PRIVATE_TMPFS = ("/dev/shm", "/run/lock")
#: Syscalls refused to the code (EPERM): no new namespaces, no mounts, no chroot, and no
#: kernel keys (as in Docker's default profile): a key added to the user keyring belongs
#: to the uid, not to a process, and would outlive the sandbox and the server.
BLOCKED_SYSCALLS = (
    "unshare", "setns", "mount", "umount", "umount2", "pivot_root", "chroot",
    "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr",
    "add_key", "keyctl", "request_key",
)  # fmt: skip
#: clone(2) flags that make a namespace; clone with any of them is refused (EPERM).
CLONE_NAMESPACE_FLAGS = (
    CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID,
    CLONE_NEWNET, CLONE_NEWTIME,
)  # fmt: skip
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_MASKED_EQ = 7
EPERM = 1
ENOSYS = 38


class SetupError(Exception):
    """A sandbox step the server asked for failed; the code must not run."""


def _limit(which: int, soft: int, hard: int | None = None) -> None:
    resource.setrlimit(which, (soft, soft if hard is None else hard))


def _own_tasks() -> int:
    """Tasks (processes + threads) running under this process's real user id."""
    uid = os.getuid()
    count = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as status:
                fields = dict(
                    line.split(b":", 1) for line in status.read().splitlines() if b":" in line
                )
            if int(fields[b"Uid"].split()[0]) == uid:
                count += int(fields[b"Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return count


def _write(fd: int, line: str) -> None:
    try:  # noqa: SIM105 - contextlib would be one more import per run
        os.write(fd, (line.replace("\n", " ") + "\n").encode("utf-8", "replace"))
    except OSError:
        pass  # the server stopped listening: nothing left to tell it


def _describe(exc: BaseException) -> str:
    """One line: ``Type: message (line N)``, the line being the test's own."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    tb = exc.__traceback__
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(".test.py"):
            line = tb.tb_lineno
        tb = tb.tb_next
    if line is not None:
        text += f" (line {line})"
    return text[:MESSAGE_CHARS]


def _stage(source: str, target: str) -> None:
    """Copy the action's files into the working directory, as the sandbox's user."""
    for folder, _dirs, names in os.walk(source):
        rel = os.path.relpath(folder, source)
        dest = target if rel == "." else os.path.join(target, rel)
        os.makedirs(dest, exist_ok=True)
        for name in names:
            with (
                open(os.path.join(folder, name), "rb") as src,
                open(os.path.join(dest, name), "wb") as dst,
            ):
                dst.write(src.read())


# -- building the sandbox (as root, before the code) -----------------------------------


def _check(result: int, what: str) -> None:
    """Raise SetupError naming ``what`` when a libc call returned -1."""
    if result != 0:
        raise SetupError(f"{what}: {os.strerror(ctypes.get_errno())}")


def _join_cgroups(procs_files: list[str]) -> None:
    """Move this process into each cgroup; its children are born there."""
    pid = str(os.getpid())
    for path in procs_files:
        try:
            with open(path, "w") as procs:
                procs.write(pid)
        except OSError as exc:
            raise SetupError(f"{path}: {exc.strerror}") from None


def _unshare(libc: ctypes.CDLL, names: list[str], tmpfs_bytes: int, ipc_bytes: int) -> None:
    """New IPC/mount/network namespaces; SysV limits in the IPC one (its own sysctls),
    private mounts and tmpfs in the mount one."""
    flags = 0
    for name in names:
        flags |= NAMESPACE_FLAGS[name]
    _check(libc.unshare(flags), "unshare " + ",".join(names))
    if "ipc" in names:
        for sysctl, value in (
            ("shmmax", ipc_bytes), ("shmall", ipc_bytes // 4096), ("shmmni", 64), ("msgmni", 16),
        ):  # fmt: skip
            with open(f"/proc/sys/kernel/{sysctl}", "w") as knob:
                knob.write(str(value))
    if "mnt" not in names:
        return
    # Nothing mounted from here on propagates back to the host, and nothing comes in.
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    if not tmpfs_bytes:
        return
    options = f"size={tmpfs_bytes},nr_inodes=4096,mode=1777".encode()
    for path in PRIVATE_TMPFS:
        real = os.path.realpath(path)
        if os.path.isdir(real):
            done = libc.mount(b"tmpfs", real.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options)
            _check(done, f"tmpfs on {real}")


def _drop(uid: int) -> None:
    """Become ``uid`` for good: real, effective and saved ids, no supplementary groups."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (uid, uid, uid):
        raise SetupError(f"setresuid {uid}: the ids did not change")


def _own_session_keyring(libc: ctypes.CDLL) -> None:
    """A new, empty session keyring of the run's own, in place of the server's (which a
    process possesses whatever its uid): it dies with the run's last process. Where
    keyctl is refused (a seccomp profile above the server), the code cannot use keys
    either, so a failure changes nothing."""
    number = SYS_KEYCTL.get(os.uname().machine)
    if number is not None:
        libc.syscall(number, KEYCTL_JOIN_SESSION_KEYRING, None)


def _no_privileges(libc: ctypes.CDLL, parent: int) -> None:
    """no_new_privs (setuid files grant nothing) and death with the server."""
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl no_new_privs")
    # Set after the uid change, which clears it; the parent may have died meanwhile.
    _check(libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "prctl pdeathsig")
    if os.getppid() != parent:
        raise SetupError("the server died")


def load_seccomp(libc: ctypes.CDLL) -> None:
    """Load a filter (built by libseccomp) that refuses namespaces, mounts and keys.

    Syscalls are named, and libseccomp resolves each name for the architecture it runs
    on (``add_key`` is 248 on x86-64, 217 on arm64); a name unknown there is skipped.

    ``clone3`` answers ENOSYS: its flags are out of a filter's reach, and glibc falls back
    to ``clone``, whose flags the filter does check.
    """

    class Cmp(ctypes.Structure):  # struct scmp_arg_cmp
        _fields_ = (
            ("arg", ctypes.c_uint),
            ("op", ctypes.c_int),
            ("datum_a", ctypes.c_uint64),
            ("datum_b", ctypes.c_uint64),
        )

    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError as exc:
        raise SetupError(f"libseccomp: {exc}") from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = (ctypes.c_uint32,)
    lib.seccomp_syscall_resolve_name.argtypes = (ctypes.c_char_p,)
    lib.seccomp_rule_add_array.argtypes = (
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(Cmp),
    )  # fmt: skip
    lib.seccomp_load.argtypes = (ctypes.c_void_p,)
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise SetupError("seccomp_init failed")

    def rule(name: str, errno: int, *cmp: Cmp) -> None:
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:
            return  # not a syscall on this architecture
        args = (Cmp * len(cmp))(*cmp) if cmp else None
        if lib.seccomp_rule_add_array(ctx, 0x00050000 | errno, number, len(cmp), args) < 0:
            raise SetupError(f"seccomp rule for {name}")

    for name in BLOCKED_SYSCALLS:
        rule(name, EPERM)
    rule("clone3", ENOSYS)
    for flag in CLONE_NAMESPACE_FLAGS:  # x86-64 and arm64 both pass clone's flags first
        rule("clone", EPERM, Cmp(0, SCMP_CMP_MASKED_EQ, flag, flag))
    if lib.seccomp_load(ctx) < 0:
        raise SetupError("seccomp_load failed")
    # unshare(0) does nothing, unless refused: proof that the filter is in force.
    if libc.unshare(0) == 0:
        raise SetupError("the seccomp filter is not in force")


def _build(
    drop: int,
    namespaces: list[str],
    tmpfs_bytes: int,
    memory: int,
    seccomp: bool,
    cgroups: list[str],
) -> None:
    """Every step the server asked for, in order. Raises SetupError (or OSError)."""
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if cgroups:
        _join_cgroups(cgroups)
    if namespaces:
        _unshare(libc, namespaces, tmpfs_bytes, memory)
    # Before the drop: the keyring is the server uid's, not charged to the sandbox's.
    _own_session_keyring(libc)
    if drop:
        _drop(drop)
    _no_privileges(libc, parent)
    if seccomp:
        load_seccomp(libc)


def main() -> None:
    drop = int(sys.argv[1])
    fd = int(sys.argv[2])
    cpu, memory, processes, file_size = (int(a) for a in sys.argv[3:7])
    mode, namespaces, tmpfs_bytes, seccomp, cgroups = sys.argv[7:12]
    main_path, workdir, staging = sys.argv[12:15]
    tests = sys.argv[15:]

    try:
        _build(
            drop,
            [n for n in namespaces.split(",") if n],
            int(tmpfs_bytes),
            memory,
            seccomp == "1",
            [p for p in cgroups.split("\n") if p],
        )
    except (SetupError, OSError) as exc:
        step = exc if isinstance(exc, SetupError) else f"{type(exc).__name__}: {exc}"
        _write(fd, f"setup failed {step}")
        os._exit(SETUP_FAILED)
    _write(fd, "setup ok")

    # Soft CPU limit sends SIGXCPU; the hard one, a second later, SIGKILL.
    _limit(resource.RLIMIT_CPU, cpu, cpu + 1)
    _limit(resource.RLIMIT_AS, memory)
    _limit(resource.RLIMIT_FSIZE, file_size)
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_NOFILE, 256)
    # RLIMIT_NPROC counts every task of the real user id: exact under a private uid,
    # an approximation (what already runs + the cap) under the server's shared one.
    base = _own_tasks() if mode == "shared" else 0
    _limit(resource.RLIMIT_NPROC, base + processes)
    os.nice(5)  # the server's own threads come first

    if staging:
        _stage(staging, workdir)
    sys.path.insert(0, workdir)  # lets the code import modules it wrote or was given
    sys.argv = [main_path]

    # A fresh __main__ module: pickle, dataclasses and friends look classes up there.
    module = type(sys)("__main__")
    module.__file__ = main_path
    module.__builtins__ = __builtins__  # type: ignore[attr-defined]
    sys.modules["__main__"] = module
    namespace = module.__dict__

    with open(main_path, "rb") as source:
        text = source.read()
    try:
        code = compile(text, main_path, "exec")
        exec(code, namespace)
    except SystemExit as exc:
        # sys.exit(0) ends the code normally: the tests still run.
        if exc.code not in (None, 0) or not tests:
            raise
    except BaseException as exc:
        if isinstance(exc, MemoryError):
            _write(fd, "limit memory")
        elif isinstance(exc, OSError) and exc.errno == 27:  # EFBIG: RLIMIT_FSIZE
            _write(fd, "limit file_size")
        # Print as python would, minus this harness's frame.
        tb = exc.__traceback__
        exc.__traceback__ = tb.tb_next if tb is not None else None
        sys.excepthook(type(exc), exc, exc.__traceback__)
        raise SystemExit(1) from None
    _write(fd, "code ok")

    for index, path in enumerate(tests):
        try:
            with open(path, "rb") as source:
                exec(compile(source.read(), path, "exec"), namespace)
        except BaseException as exc:
            _write(fd, f"fail {index} {_describe(exc)}")
        else:
            _write(fd, f"pass {index}")


if __name__ == "__main__":
    main()
