"""Behaviour of the coding environment through a real server and the typed client.

Limits are kept small so that the runaway programs below end in a second or two: one CPU
second (with wall time to spare, so that a busy machine still ends a busy loop by CPU
time) and, where a test is about wall time, a wall limit of 1.5 s.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from openenv_grpc import EnvError
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.coding import (
    CodingAction,
    CodingEnv,
    CodingIoCase,
    CodingLimits,
    CodingObservation,
    CodingResetOptions,
    CodingState,
    CodingTestCase,
    Limit,
)

SECRET = "s3cr3t-do-not-leak"
FAST = CodingLimits(cpu_seconds=1, wall_ms=5000, memory_mb=128, processes=16, output_bytes=4096)
#: FAST, but ending by wall time soon.
SHORT = CodingLimits(cpu_seconds=1, wall_ms=1500, memory_mb=128, processes=16, output_bytes=4096)
FORK_BOMB = """\
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """One coding server for the module, with a secret in its environment."""
    process = ServerProcess(
        "coding", ["--max-concurrent-envs", "0"], {"OPENENV_SECRET_TOKEN": SECRET}
    )
    yield process
    process.stop()


@pytest.fixture
def env(server: ServerProcess) -> Iterator[CodingEnv]:
    """A session reset with the fast limits."""
    with CodingEnv(server.target) as session:
        session.reset(options=CodingResetOptions(limits=FAST))
        yield session


def run(env: CodingEnv, code: str, **fields: Any) -> tuple[CodingObservation, float]:
    """Step ``code``; the observation and the seconds the step took (for printing only:
    tests assert on outcomes, never on speed)."""
    started = time.monotonic()
    result = env.step(CodingAction(code=code, **fields))
    return result.observation, time.monotonic() - started


ROOT_ONLY = (
    "this test checks the sandbox of a root server (its own uid per sandbox), which CI and "
    "the development machine run; under a non-root server (README, 'not root') the code "
    "runs under the server's uid and this part of the isolation does not exist"
)


def require_sandbox_uid(state: CodingState) -> None:
    """Fail (never skip) unless the server gave the sandbox a uid of its own: the test
    that calls this checks the root server's behaviour in full, and only that."""
    assert os.geteuid() == 0 and state.sandbox_uid, ROOT_ONLY
    assert state.sandbox_uid >= 1_000_000_000, state.sandbox_uid


def sandbox_processes(state: CodingState) -> list[int]:
    """Live processes of a sandbox: its uid's (when it has one) or naming its directory."""
    base = str(Path(state.workdir).parent).encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
            with open(f"/proc/{name}/status", "rb") as f:
                status = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        uid = int(status.split(b"\nUid:")[1].split()[0])
        if (state.sandbox_uid and uid == state.sandbox_uid) or base in cmdline:
            found.append(int(name))
    return found


def assert_no_strays(state: CodingState) -> None:
    def described() -> str:
        lines = []
        for pid in sandbox_processes(state):
            with open(f"/proc/{pid}/stat", "rb") as f:
                lines.append(f.read().decode(errors="replace")[:120])
        return "\n".join(lines)

    try:
        ServerProcess.wait_until(
            lambda: not sandbox_processes(state), timeout=5, what="no sandbox process left"
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}; left:\n{described()}") from None


# -- runs and their outcomes ----------------------------------------------------------


def test_hello_world(env: CodingEnv) -> None:
    obs, _ = run(env, "print('hello, world')")
    assert obs.stdout == "hello, world\n"
    assert obs.stderr == ""
    assert obs.exit_code == 0
    assert obs.limit == Limit.LIMIT_NONE
    assert obs.wall_seconds > 0 and obs.cpu_seconds > 0
    assert not obs.stdout_truncated and not obs.stderr_truncated
    assert env.state().last_limit == Limit.LIMIT_NONE


def test_exception_is_exit_code_1_with_traceback(env: CodingEnv) -> None:
    obs, _ = run(env, "def f():\n    return 1 / 0\nf()")
    assert obs.exit_code == 1
    assert obs.limit == Limit.LIMIT_NONE
    lines = obs.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-1] == "ZeroDivisionError: division by zero"
    assert "<string>" not in obs.stderr  # the harness's own frame is hidden
    assert 'main.py", line 3, in <module>' in obs.stderr
    assert env.state().last_exit_code == 1


def test_syntax_error(env: CodingEnv) -> None:
    obs, _ = run(env, "x = (")
    assert obs.exit_code == 1
    assert obs.stderr.splitlines()[-1] == "SyntaxError: '(' was never closed"


def test_exit_codes(env: CodingEnv) -> None:
    assert run(env, "import os\nprint('lost', end='')\nos._exit(3)")[0].exit_code == 3
    obs, _ = run(env, "import sys\nsys.exit('bye')")
    assert (obs.exit_code, obs.stderr) == (1, "bye\n")
    assert run(env, "raise SystemExit(7)")[0].exit_code == 7


def test_stdin_is_fed_to_the_code(env: CodingEnv) -> None:
    obs, _ = run(env, "import sys\nprint(sys.stdin.read().upper())", stdin="abc\ndef")
    assert obs.stdout == "ABC\nDEF\n"


def test_infinite_loop_hits_the_cpu_limit(env: CodingEnv) -> None:
    obs, took = run(env, "print('started')\nwhile True:\n    pass")
    print(f"CPU limit 1 s, wall 5 s: a busy loop ended after {took:.2f}s")
    # Ended by CPU time (SIGXCPU), not by the 5 s wall limit: that would be
    # LIMIT_WALL_TIME and SIGKILL (-9).
    assert obs.limit == Limit.LIMIT_CPU_TIME
    assert obs.exit_code == -24  # SIGXCPU
    assert obs.stdout == "started\n"  # unbuffered: output before the kill is kept
    assert obs.cpu_seconds >= 0.5  # the kernel's accounting lags the 1 s limit a little


def test_sleeping_forever_hits_the_wall_limit(env: CodingEnv) -> None:
    env.reset(options=CodingResetOptions(limits=SHORT))
    obs, _ = run(env, "import time\ntime.sleep(100)")
    assert obs.limit == Limit.LIMIT_WALL_TIME
    assert obs.exit_code == -9
    assert obs.wall_seconds >= 1.4


def test_memory_bomb_hits_the_memory_limit(env: CodingEnv) -> None:
    obs, _ = run(env, "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))")
    assert obs.limit == Limit.LIMIT_MEMORY
    assert obs.exit_code == 1
    assert obs.stderr.splitlines()[-1] == "MemoryError"


def test_fork_bomb_is_contained_and_cleaned_up(server: ServerProcess, env: CodingEnv) -> None:
    env.reset(options=CodingResetOptions(limits=SHORT))
    state = env.state()
    obs, _ = run(env, FORK_BOMB)
    assert obs.limit == Limit.LIMIT_PROCESSES
    assert_no_strays(state)
    # The server and the session are fine.
    assert server.health() == health_pb2.HealthCheckResponse.SERVING
    assert run(env, "print('still here')")[0].stdout == "still here\n"


def test_background_processes_end_with_the_run(env: CodingEnv) -> None:
    """A double-forked daemon in a session of its own, still holding stdout, sleeping
    100 s: the run ends when its main process does, and the daemon is killed with it.
    Root server only (see ROOT_ONLY): under the server's uid a new session escapes the
    run (README), which this test does not cover."""
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(100)\n"
        "    os._exit(0)\n"
        "print('parent done')\n"
    )
    state = env.state()
    require_sandbox_uid(state)
    obs, took = run(env, code)
    print(f"a run that left a daemon holding stdout ended after {took:.2f}s (wall limit 5 s)")
    assert obs.stdout == "parent done\n"
    assert obs.exit_code == 0
    # Neither waited for the daemon nor for its copy of stdout: either would have run
    # into the 5 s wall limit (LIMIT_WALL_TIME), the daemon sleeps 100 s.
    assert obs.limit == Limit.LIMIT_NONE
    assert_no_strays(state)


def test_huge_output_is_truncated(env: CodingEnv) -> None:
    obs, _ = run(env, "while True:\n    print('x' * 1000)")
    assert obs.limit == Limit.LIMIT_OUTPUT
    assert obs.stdout_truncated and not obs.stderr_truncated
    assert len(obs.stdout) == 4096
    assert obs.exit_code == -9
    obs, _ = run(env, "import sys\nsys.stderr.write('e' * 5000)")
    assert obs.stderr_truncated and len(obs.stderr) == 4096
    assert obs.limit == Limit.LIMIT_OUTPUT


def test_big_file_hits_the_file_size_limit(server: ServerProcess) -> None:
    with CodingEnv(server.target) as env:
        env.reset(options=CodingResetOptions(limits=CodingLimits(file_size_mb=1)))
        obs, _ = run(env, "open('big', 'wb').write(b'x' * (2 << 20))")
        assert obs.limit == Limit.LIMIT_FILE_SIZE
        assert obs.stderr.splitlines()[-1] == "OSError: [Errno 27] File too large"


# -- what the code can see ------------------------------------------------------------


def test_environment_is_scrubbed(server: ServerProcess, env: CodingEnv) -> None:
    """The code sees only its own variables and cannot read the server's environ (root
    server only, see ROOT_ONLY: under the server's uid that file is readable)."""
    code = (
        "import json, os\n"
        "try:\n"
        "    leaked = open(f'/proc/{os.getppid()}/environ', 'rb').read()\n"
        "except OSError as exc:\n"
        "    leaked = type(exc).__name__\n"
        "print(json.dumps({'env': dict(os.environ), 'ppid': os.getppid(),\n"
        "                  'parent_environ': str(leaked)}))\n"
    )
    state = env.state()
    require_sandbox_uid(state)
    obs, _ = run(env, code)
    seen = json.loads(obs.stdout)
    assert seen["env"] == {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "MALLOC_ARENA_MAX": "2",
        "HOME": state.workdir,
        "TMPDIR": state.workdir,
    }
    assert SECRET not in obs.stdout + obs.stderr
    assert seen["ppid"] == server.proc.pid  # the server itself spawned the interpreter
    assert seen["parent_environ"] == "PermissionError"


def test_cwd_is_a_fresh_empty_dir_removed_at_reset_and_close(server: ServerProcess) -> None:
    code = "import os\nprint(os.getcwd(), sorted(os.listdir('.')))\nopen('made.txt', 'w')"
    with CodingEnv(server.target) as env:
        env.reset(options=CodingResetOptions(limits=FAST))
        first = env.state().workdir
        assert env.state().files == [] and env.state().file_count == 0
        assert run(env, code)[0].stdout == f"{first} []\n"
        assert run(env, code)[0].stdout == f"{first} ['made.txt']\n"  # kept for the episode
        assert list(env.state().files) == ["made.txt"]
        env.reset(options=CodingResetOptions(limits=FAST))
        second = env.state().workdir
        assert second != first and not Path(first).parent.exists()
        assert run(env, code)[0].stdout == f"{second} []\n"
    ServerProcess.wait_until(lambda: not Path(second).parent.exists(), what="workdir removed")


def test_files_are_written_before_the_run(env: CodingEnv) -> None:
    obs, _ = run(
        env,
        "import helper\nprint(open('data/in.txt').read(), helper.X + 1)",
        files={"data/in.txt": "from a file", "helper.py": "X = 41"},
    )
    assert obs.stdout == "from a file 42\n"
    assert list(env.state().files) == ["data/", "helper.py"]


def test_private_files_and_the_server_are_out_of_reach(server: ServerProcess) -> None:
    folder = Path(tempfile.mkdtemp(prefix="coding-test-"))
    try:
        folder.chmod(0o755)
        private = folder / "private.txt"
        private.write_text("private")
        private.chmod(0o600)
        public = folder / "public.txt"
        public.write_text("public")
        public.chmod(0o644)
        code = (
            "import os, signal\n"
            "for path in ('private.txt', 'public.txt'):\n"
            "    try:\n"
            f"        print(open({str(folder)!r} + '/' + path).read())\n"
            "    except OSError as exc:\n"
            "        print(type(exc).__name__)\n"
            "try:\n"
            "    os.kill(os.getppid(), signal.SIGKILL)\n"
            "except OSError as exc:\n"
            "    print(type(exc).__name__)\n"
        )
        with CodingEnv(server.target) as env:
            env.reset(options=CodingResetOptions(limits=FAST))
            require_sandbox_uid(env.state())
            obs, _ = run(env, code)
            # World-readable files stay readable: only permissions protect files.
            assert obs.stdout == "PermissionError\npublic\nPermissionError\n"
        assert server.proc.poll() is None
    finally:
        private.unlink(missing_ok=True)
        public.unlink(missing_ok=True)
        folder.rmdir()


def test_network_is_cut(server: ServerProcess) -> None:
    host, port = server.target.split(":")
    code = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(({host!r}, {port}), timeout=1).close()\n"
        "    print('connected')\n"
        "except OSError as exc:\n"
        "    print(exc.errno)\n"
    )
    with CodingEnv(server.target) as env:
        env.reset(options=CodingResetOptions(limits=FAST))
        assert env.state().network_isolated
        assert run(env, code)[0].stdout == "101\n"  # ENETUNREACH: not even loopback
    # Allowing it is the server's call: see test_reliability_sandbox.py.


# -- tests and rewards ----------------------------------------------------------------

PROGRAM = "def add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))\n"  # noqa: E501


def test_reward_is_the_fraction_of_tests_passed(env: CodingEnv) -> None:
    tests = [
        CodingTestCase(name="ok", assertion="assert add(1, 2) == 3"),
        CodingTestCase(assertion="x = add(1, 2)\nassert x == 4, f'got {x}'"),
        CodingTestCase(name="io ok", io=CodingIoCase(stdin="2 3", expected_stdout="5")),
        CodingTestCase(name="io bad", io=CodingIoCase(stdin="2 3", expected_stdout="5\n6\n")),
    ]
    result = env.step(CodingAction(code=PROGRAM, stdin="1 1", tests=tests))
    assert result.reward == 0.5
    assert not result.terminated
    obs = result.observation
    assert obs.stdout == "2\n"
    assert obs.tests_passed == 2
    assert [(t.name, t.passed, t.message) for t in obs.tests] == [
        ("ok", True, ""),
        ("test 1", False, "AssertionError: got 3 (line 2)"),
        ("io ok", True, ""),
        ("io bad", False, "stdout has 1 lines; expected 2"),
    ]


def test_io_test_failure_messages(env: CodingEnv) -> None:
    cases = {
        "print(-1)": "stdout line 1: expected '5', got '-1'",
        "print(1 / 0)": "exit code 1: ZeroDivisionError: division by zero",
        "while True:\n    pass": "CPU time limit hit",
        "import sys\nprint(5)\nsys.exit(2)": "exit code 2",
    }
    for code, message in cases.items():
        test = CodingTestCase(io=CodingIoCase(expected_stdout="5"))
        result = env.step(CodingAction(code=code, tests=[test]))
        assert result.observation.tests[0].message == message, code
        assert result.reward == 0.0
    # Trailing spaces and blank lines at the end do not matter.
    test = CodingTestCase(io=CodingIoCase(expected_stdout="a\nb"))
    result = env.step(CodingAction(code="print('a  ')\nprint('b')\nprint()", tests=[test]))
    assert result.reward == 1.0


def test_assertion_tests_need_the_code_to_finish(env: CodingEnv) -> None:
    env.reset(options=CodingResetOptions(limits=FAST, continue_on_pass=True))
    tests = [CodingTestCase(assertion="assert True")]
    result = env.step(CodingAction(code="1 / 0", tests=tests))
    assert result.observation.tests[0].message == (
        "the code did not finish (exit code 1: ZeroDivisionError: division by zero); "
        "the tests did not run"
    )
    # sys.exit(0) is a normal end: the tests still run.
    result = env.step(CodingAction(code="import sys\nX = 1\nsys.exit(0)", tests=tests))
    assert result.reward == 1.0
    # A test that loops forever fails; the ones before it keep their verdict.
    looping = [CodingTestCase(assertion="assert True"), CodingTestCase(assertion="while 1: pass")]
    obs = env.step(CodingAction(code="pass", tests=looping)).observation
    assert [(t.passed, t.message) for t in obs.tests] == [
        (True, ""),
        (False, "the test did not finish (CPU time limit hit)"),
    ]


def test_all_tests_passing_terminates_unless_told_otherwise(server: ServerProcess) -> None:
    tests = [CodingTestCase(assertion="assert add(2, 2) == 4")]
    with CodingEnv(server.target) as env:
        env.reset(options=CodingResetOptions(limits=FAST))
        result = env.step(CodingAction(code=PROGRAM, stdin="1 2", tests=tests))
        assert (result.reward, result.terminated, result.truncated) == (1.0, True, False)
        with pytest.raises(EnvError) as failed:
            env.step(CodingAction(code="pass"))
        assert failed.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert failed.value.message == "the episode has terminated: call reset to start a new one"

        env.reset(options=CodingResetOptions(limits=FAST, continue_on_pass=True, max_steps=2))
        assert not env.state().terminate_on_pass
        result = env.step(CodingAction(code=PROGRAM, stdin="1 2", tests=tests))
        assert (result.reward, result.terminated, result.truncated) == (1.0, False, False)
        result = env.step(CodingAction(code="pass"))  # no tests: reward 0
        assert (result.reward, result.terminated, result.truncated) == (0.0, False, True)
        with pytest.raises(EnvError) as failed:
            env.step(CodingAction(code="pass"))
        assert failed.value.message == "the episode was truncated: call reset to start a new one"


def test_same_code_same_observation(server: ServerProcess) -> None:
    code = "import random\nrandom.seed(7)\nprint(random.random(), sorted({3, 1, 2}))"
    seen = []
    for _ in range(2):
        with CodingEnv(server.target) as env:
            env.reset(seed=1, options=CodingResetOptions(limits=FAST))
            obs = env.step(CodingAction(code=code)).observation
            obs.ClearField("wall_seconds")
            obs.ClearField("cpu_seconds")
            seen.append(obs.SerializeToString(deterministic=True))
    assert seen[0] == seen[1]


# -- state ----------------------------------------------------------------------------


def test_state_before_and_after_reset(server: ServerProcess) -> None:
    """State before and after a reset, the sandbox's own uid included (root server only,
    see ROOT_ONLY: a non-root server reports sandbox_uid 0)."""
    with CodingEnv(server.target) as env:
        state = env.state()
        assert state.workdir == "" and state.step_count == 0
        assert state.limits == CodingLimits(
            cpu_seconds=5, wall_ms=10000, memory_mb=512, output_bytes=65536,
            processes=32, file_size_mb=16,
        )  # fmt: skip
        assert state.python_version.count(".") == 2
        env.reset(options=CodingResetOptions(limits=CodingLimits(wall_ms=1500), max_steps=4))
        state = env.state()
        assert state.limits.wall_ms == 1500 and state.limits.cpu_seconds == 5
        assert state.max_steps == 4 and state.terminate_on_pass
        assert Path(state.workdir).is_dir()
        require_sandbox_uid(state)
        assert Path(state.workdir).stat().st_uid == state.sandbox_uid


# -- errors ---------------------------------------------------------------------------


def _refused(call: object, message: str) -> None:
    assert isinstance(call, EnvError), call
    assert call.code is grpc.StatusCode.INVALID_ARGUMENT
    assert call.message == message


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        (
            CodingLimits(wall_ms=120_001),
            "limits.wall_ms is 120001; the server's maximum is 120000 (CODING_MAX_WALL_MS)",
        ),
        (
            CodingLimits(cpu_seconds=61),
            "limits.cpu_seconds is 61; the server's maximum is 60 (CODING_MAX_CPU_SECONDS)",
        ),
        (
            CodingLimits(memory_mb=5000),
            "limits.memory_mb is 5000; the server's maximum is 4096 (CODING_MAX_MEMORY_MB)",
        ),
        (CodingLimits(memory_mb=10), "limits.memory_mb is 10; the minimum is 64"),
        (CodingLimits(processes=1), "limits.processes is 1; the minimum is 2"),
        (
            CodingLimits(processes=257),
            "limits.processes is 257; the server's maximum is 256 (CODING_MAX_PROCESSES)",
        ),
        (
            CodingLimits(output_bytes=5 << 20),
            "limits.output_bytes is 5242880; the server's maximum is 4194304 "
            "(CODING_MAX_OUTPUT_BYTES)",
        ),
        (
            CodingLimits(file_size_mb=2000),
            "limits.file_size_mb is 2000; the server's maximum is 1024 (CODING_MAX_FILE_SIZE_MB)",
        ),
    ],
)
def test_bad_limits_are_invalid_argument_and_the_episode_stands(
    env: CodingEnv, limits: CodingLimits, message: str
) -> None:
    run(env, "pass")
    with pytest.raises(EnvError) as failed:
        env.reset(options=CodingResetOptions(limits=limits))
    _refused(failed.value, message)
    assert env.step(CodingAction(code="print(1)")).step_count == 2
    assert env.state().limits.wall_ms == FAST.wall_ms


@pytest.mark.parametrize(
    ("action", "message"),
    [
        (
            CodingAction(code="x" * (1 << 20 | 1)),
            "code has 1048577 bytes; the limit is 1048576",
        ),
        (
            CodingAction(code="pass", tests=[CodingTestCase(name="empty")]),
            "tests[0] sets neither assertion nor io",
        ),
        (
            CodingAction(code="pass", tests=[CodingTestCase(assertion="1")] * 33),
            "33 tests; the limit is 32",
        ),
        (
            CodingAction(code="pass", files={"../escape": "x"}),
            "file path '../escape' is not a plain relative path (no '..', '.', '//' or leading '/')",  # noqa: E501
        ),
        (
            CodingAction(code="pass", files={"/etc/passwd": "x"}),
            "file path '/etc/passwd' is not a plain relative path (no '..', '.', '//' or leading '/')",  # noqa: E501
        ),
        (
            CodingAction(code="pass", files={"a//b": "x"}),
            "file path 'a//b' is not a plain relative path (no '..', '.', '//' or leading '/')",
        ),
    ],
)
def test_bad_actions_are_invalid_argument_and_the_episode_goes_on(
    env: CodingEnv, action: CodingAction, message: str
) -> None:
    with pytest.raises(EnvError) as failed:
        env.step(action)
    _refused(failed.value, message)
    assert env.step(CodingAction(code="print(1)")).step_count == 1
    assert env.state().file_count == 0


def test_step_before_reset_is_failed_precondition(server: ServerProcess) -> None:
    with CodingEnv(server.target) as env:
        with pytest.raises(EnvError) as failed:
            env.step(CodingAction(code="pass"))
        assert failed.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert failed.value.message == "step before reset: call reset first"


# -- neighbours -----------------------------------------------------------------------


#: Marks its start in the working dir, then waits (sleeping) until the test releases it.
GATED = (
    "import os, time\n"
    "open('entered', 'w').close()\n"
    "while not os.path.exists('release'):\n"
    "    time.sleep(0.01)\n"
    "print('released')\n"
)


def test_a_neighbour_keeps_working_while_a_session_loops(server: ServerProcess) -> None:
    """One session's run is held (it waits for a file only the test makes): a neighbour's
    five runs and a refused action all answer while it is still held; then it is
    released and ends normally. Event-based: a neighbour stalled behind the held run
    could not answer before the release."""
    outcome: dict[str, Any] = {}
    with CodingEnv(server.target) as stuck_env:
        stuck_env.reset(options=CodingResetOptions(limits=CodingLimits(wall_ms=60_000)))
        workdir = Path(stuck_env.state().workdir)

        def stuck() -> None:
            try:
                outcome["obs"] = run(stuck_env, GATED)[0]
            except Exception as exc:
                outcome["obs"] = exc

        thread = threading.Thread(target=stuck, daemon=True)
        thread.start()
        try:
            with CodingEnv(server.target) as env:
                env.reset(options=CodingResetOptions(limits=FAST))
                ServerProcess.wait_until(
                    lambda: (workdir / "entered").exists(), 30, "the held run started"
                )
                took = []
                for i in range(5):
                    obs, seconds = run(env, f"print({i})")
                    took.append(seconds)
                    assert obs.stdout == f"{i}\n"
                    assert "obs" not in outcome  # answered while the other run is held
                # An error in this session changes nothing for the other one either.
                with pytest.raises(EnvError):
                    env.step(CodingAction(code="pass", files={"..": ""}))
                assert thread.is_alive() and "obs" not in outcome  # still held
                print("neighbour runs beside a held run: " + ", ".join(f"{t:.2f}s" for t in took))
        finally:
            (workdir / "release").touch()
            thread.join(30)
        obs = outcome["obs"]
        assert isinstance(obs, CodingObservation), obs
        assert (obs.stdout, obs.exit_code, obs.limit) == ("released\n", 0, Limit.LIMIT_NONE)


#: Eight children sleeping, then a mark in the working dir, then a wait that only the
#: wall limit ends (a close waits for the run: it never overlaps it).
HELD_WITH_CHILDREN = (
    "import os, time\n"
    "for _ in range(8):\n"
    "    if os.fork() == 0:\n"
    "        time.sleep(100)\n"
    "        os._exit(0)\n"
    "open('entered', 'w').close()\n"
    "while True:\n"
    "    time.sleep(1)\n"
)


def test_ending_a_session_mid_run_cleans_up(server: ServerProcess) -> None:
    """The session is aborted while its run (with eight children) is still going, as the
    run's mark, its live processes and its unanswered step show: once the run ends (at
    its 5 s wall limit: a close never overlaps a run), its processes and working dir go."""
    env = CodingEnv(server.target)
    env.open()
    env.reset(options=CodingResetOptions(limits=CodingLimits(wall_ms=5000)))
    state = env.state()
    require_sandbox_uid(state)  # its processes are found by the sandbox uid
    workdir = Path(state.workdir)
    done = threading.Event()

    def step() -> None:
        try:
            env.step(CodingAction(code=HELD_WITH_CHILDREN))
        except Exception:
            pass  # the stream was cancelled under it
        finally:
            done.set()

    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    ServerProcess.wait_until(lambda: (workdir / "entered").exists(), 30, "the run started")
    assert len(sandbox_processes(state)) >= 9  # the run and its eight children
    assert not done.is_set()  # mid-run: the step has not answered
    env.abort()
    thread.join(30)
    assert done.is_set()
    ServerProcess.wait_until(
        lambda: not workdir.parent.exists(), timeout=30, what="workdir removed"
    )
    assert_no_strays(state)
    assert server.health() == health_pb2.HealthCheckResponse.SERVING


def test_a_server_step_timeout_still_cleans_up(start_server: Any) -> None:
    server = start_server("coding", "--step-timeout", "0.5")
    with CodingEnv(server.target) as env:
        env.reset(options=CodingResetOptions(limits=SHORT))
        state = env.state()
        with pytest.raises(EnvError) as failed:
            env.step(CodingAction(code="import time\ntime.sleep(100)"))
        assert failed.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        # The session has a fresh env; the cut one is closed once its run hits the wall.
        env.reset(options=CodingResetOptions(limits=SHORT))
        assert run(env, "print('fresh')")[0].stdout == "fresh\n"
        ServerProcess.wait_until(
            lambda: not Path(state.workdir).parent.exists(), timeout=5, what="cut sandbox removed"
        )
        assert_no_strays(state)
