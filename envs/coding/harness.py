"""The sandbox side of a run: sets the limits, then runs the submitted code and its tests.

The server never imports this module: it passes its source to ``python -I -S -u -c``
inside the sandbox, already under the sandbox's user id. So it may use only the standard
library, imports as little as it can (every import is start-up time of every run), and
trusts nothing that runs after it hands control to the submitted code.

Arguments (all strings, in order): the uid to drop to first (``0``: none; the server
uses it when it has no setpriv to do that), the verdict pipe's fd, CPU seconds, address-space
bytes, process cap, file-size bytes, process-cap mode (``own`` when the sandbox has a user
id of its own, ``shared`` when it runs under the server's), the path of ``main.py``, the
working directory, the staging directory of the action's files (``""`` for none), then
one path per assertion test.

It writes one line per event to the verdict pipe: ``limit memory`` / ``limit file_size``
(the code died of that), ``code ok`` (the code finished; the tests start), ``pass I`` and
``fail I MESSAGE`` (test I). The submitted code can write to that pipe too, so assertion
verdicts are not proof against code written to forge them; stdin/stdout tests, which the
server judges itself, are.
"""

from __future__ import annotations

import os
import resource
import sys

#: Longest failure message sent back for one test.
MESSAGE_CHARS = 500


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


def _drop(uid: int) -> None:
    """Become ``uid`` for good (only when the server had no setpriv to do it)."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (uid, uid, uid):
        raise SystemExit(125)


def main() -> None:
    drop = int(sys.argv[1])
    if drop:
        _drop(drop)
    fd = int(sys.argv[2])
    cpu, memory, processes, file_size = (int(a) for a in sys.argv[3:7])
    mode, main_path, workdir, staging = sys.argv[7:11]
    tests = sys.argv[11:]

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
