"""The coding environment: each step runs a Python program in a sandbox and tests it.

An episode owns one :class:`~openenv_grpc_envs.coding.sandbox.Sandbox` (a working
directory that persists across its steps, and a uid of its own when the server is root).
A step runs the action's code once on the action's stdin, runs the assertion tests after
it in the same process, then runs the code once more per stdin/stdout test. The reward
is the fraction of tests that passed; a step whose tests all pass terminates the episode
unless the reset options say to go on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

from google.protobuf import json_format

from openenv_grpc import Environment, InvalidAction, Transition
from openenv_grpc_envs import snapshot_body
from openenv_grpc_envs.coding import workspace
from openenv_grpc_envs.coding.limits import ENV_VARS, CodingSettings, Limits, resolve_limits
from openenv_grpc_envs.coding.reclaim import reclaim_orphans
from openenv_grpc_envs.coding.sandbox import RunResult, Sandbox, host_support
from openenv_grpc_envs.coding.uids import default_killer
from openenv_grpc_envs.coding.v1.coding_pb2 import (
    CodingAction,
    CodingIoCase,
    CodingLimits,
    CodingObservation,
    CodingResetOptions,
    CodingState,
    CodingTestResult,
    Limit,
)

__all__ = ["CodingEnvironment", "NetworkUnavailable"]

#: Size caps of an action, checked before anything runs.
MAX_CODE_BYTES = 1024 * 1024
MAX_STDIN_BYTES = 4 * 1024 * 1024
MAX_TESTS = 32
MAX_TEST_BYTES = 1024 * 1024
MAX_FILES = 100
MAX_FILES_BYTES = 8 * 1024 * 1024
#: How a failed test's message names the limit its run hit.
LIMIT_WORDS = {
    Limit.LIMIT_CPU_TIME: "CPU time limit",
    Limit.LIMIT_WALL_TIME: "wall time limit",
    Limit.LIMIT_MEMORY: "memory limit",
    Limit.LIMIT_OUTPUT: "output limit",
    Limit.LIMIT_PROCESSES: "process limit",
    Limit.LIMIT_FILE_SIZE: "file size limit",
}
#: Longest excerpt of an output quoted in a failed test's message.
EXCERPT_CHARS = 80
#: The layout of this env's snapshots (see :meth:`CodingEnvironment.snapshot`).
SNAPSHOT_LAYOUT = "coding/1"


class NetworkUnavailable(RuntimeError):
    """The host cannot cut the sandbox's network, and the server does not allow it."""


def _proto_limits(limits: Limits) -> CodingLimits:
    return CodingLimits(**{f.name: getattr(limits, f.name) for f in fields(Limits)})


def _check_action(action: CodingAction) -> None:
    """Refuse an action that is too big or malformed, before anything changes."""
    code_bytes = len(action.code.encode())
    if code_bytes > MAX_CODE_BYTES:
        raise InvalidAction(f"code has {code_bytes} bytes; the limit is {MAX_CODE_BYTES}")
    stdin_bytes = len(action.stdin.encode())
    if stdin_bytes > MAX_STDIN_BYTES:
        raise InvalidAction(f"stdin has {stdin_bytes} bytes; the limit is {MAX_STDIN_BYTES}")
    if len(action.tests) > MAX_TESTS:
        raise InvalidAction(f"{len(action.tests)} tests; the limit is {MAX_TESTS}")
    for index, test in enumerate(action.tests):
        kind = test.WhichOneof("kind")
        if kind is None:
            raise InvalidAction(f"tests[{index}] sets neither assertion nor io")
        size = (
            len(test.assertion.encode())
            if kind == "assertion"
            else len(test.io.stdin.encode()) + len(test.io.expected_stdout.encode())
        )
        if size > MAX_TEST_BYTES:
            raise InvalidAction(f"tests[{index}] has {size} bytes; the limit is {MAX_TEST_BYTES}")
    if len(action.files) > MAX_FILES:
        raise InvalidAction(f"{len(action.files)} files; the limit is {MAX_FILES}")
    total = 0
    for path, text in action.files.items():
        _check_path(path)
        total += len(text.encode())
    if total > MAX_FILES_BYTES:
        raise InvalidAction(f"files have {total} bytes; the limit is {MAX_FILES_BYTES}")


def _check_path(path: str) -> None:
    """A file path must stay inside the working directory."""
    if not workspace.plain_path(path):
        raise InvalidAction(
            f"file path {path!r} is not a plain relative path (no '..', '.', '//' or leading '/')"
        )


class CodingEnvironment(
    Environment[CodingAction, CodingObservation, CodingState, CodingResetOptions]
):
    """Runs Python code in a sandboxed child process; rewards the fraction of tests passed."""

    name = "coding"
    version = "1.0.0"
    description = (
        "Runs Python code in a sandboxed process (CPU, memory, process, output and wall "
        "limits); reward = fraction of test cases passed."
    )
    runs_inline = False  # a step blocks for as long as the code runs

    @classmethod
    def check_settings(cls) -> None:
        """Parse the ``CODING_*`` variables at server start: a bad value stops the server
        with its message instead of failing every session."""
        CodingSettings.from_env()

    def __init__(self, settings: CodingSettings | None = None) -> None:
        """Args:
            settings: The server's maxima; None reads them from the ``CODING_*``
                environment variables (see the README).

        Raises:
            ValueError: a ``CODING_*`` variable does not parse or is out of range.
            NetworkUnavailable: this host cannot give runs an empty network namespace and
                the server does not allow the network (``CODING_ALLOW_NETWORK=1``).
        """
        self._settings = settings if settings is not None else CodingSettings.from_env()
        self._support = host_support()
        if not self._support.network_namespace and not self._settings.allow_network:
            raise NetworkUnavailable(
                "this host cannot cut the sandbox's network (the server needs root and "
                "CAP_SYS_ADMIN for a network namespace); set "
                f"{ENV_VARS['allow_network']}=1 to let code use the server's network"
            )
        self._sandbox: Sandbox | None = None
        self._limits = self._resolve(None)
        self._max_steps = 0
        self._terminate_on_pass = True
        self._allow_network = False
        self._steps = 0
        self._last_exit_code = 0
        self._last_limit: Limit.ValueType = Limit.LIMIT_UNSPECIFIED

    # -- the contract -----------------------------------------------------------------

    def reset(
        self, *, seed: int | None, episode_id: str, options: CodingResetOptions | None
    ) -> Transition[CodingObservation]:
        options = options if options is not None else CodingResetOptions()
        limits = self._resolve(options.limits if options.HasField("limits") else None)
        self._check_network(options.allow_network)
        # A fresh sandbox per episode: new directory, new uid, nothing left of the last.
        sandbox = Sandbox(limits, allow_network=options.allow_network, support=self._support)
        self._begin(
            sandbox,
            limits,
            max_steps=options.max_steps,
            terminate_on_pass=not options.continue_on_pass,
            allow_network=options.allow_network,
        )
        return Transition(CodingObservation())

    def step(self, action: CodingAction) -> Transition[CodingObservation]:
        _check_action(action)
        sandbox = self._sandbox
        assert sandbox is not None  # the server only steps after a reset
        assertions = [t.assertion for t in action.tests if t.WhichOneof("kind") == "assertion"]
        tests, staging = sandbox.prepare(action.code, assertions, dict(action.files))
        main = sandbox.run(action.stdin.encode(), tests, staging)
        observation = _observation(main)
        results = self._judge(sandbox, action, main)
        observation.tests.extend(results)
        passed = sum(r.passed for r in results)
        observation.tests_passed = passed
        self._steps += 1
        self._last_exit_code = main.exit_code
        self._last_limit = main.limit
        total = len(results)
        all_passed = total > 0 and passed == total
        return Transition(
            observation,
            reward=passed / total if total else 0.0,
            terminated=all_passed and self._terminate_on_pass,
            truncated=bool(self._max_steps) and self._steps >= self._max_steps,
        )

    def state(self) -> CodingState:
        sandbox = self._sandbox
        support = self._support
        files, count = sandbox.listing() if sandbox is not None else ([], 0)
        return CodingState(
            step_count=self._steps,
            last_exit_code=self._last_exit_code,
            last_limit=self._last_limit,
            files=files,
            file_count=count,
            limits=_proto_limits(self._limits),
            workdir=str(sandbox.workdir) if sandbox is not None else "",
            sandbox_uid=sandbox.uid if sandbox is not None and support.own_uid else 0,
            network_isolated=(
                sandbox.network_isolated
                if sandbox is not None
                else support.network_namespace and not self._allow_network
            ),
            python_version=support.python_version,
            terminate_on_pass=self._terminate_on_pass,
            max_steps=self._max_steps,
            ipc_isolated=support.ipc_namespace,
            private_tmpfs=support.mount_namespace,
            syscall_filter=support.seccomp,
            memory_cgroup=support.cgroup is not None,
            maximums=_proto_limits(self._settings.maxima),
            max_sandbox_memory_mb=self._settings.max_sandbox_memory_mb,
            network_allowed=self._settings.allow_network,
        )

    def close(self) -> None:
        self._close_sandbox()

    def snapshot(self) -> bytes:
        """The episode as JSON: its settings (limits, max_steps, continue_on_pass,
        allow_network), its counters (step count, last exit code and limit; the env keeps
        no transcript of earlier steps) and the working directory's files, directories and
        links (see :mod:`.workspace`; at most 1000 entries and 4 MiB of file bytes).

        Running processes are not captured: none is left between steps (every process
        of the sandbox is killed when its run ends), and none is started by a restore.

        Raises:
            InvalidAction: no episode yet, or the working directory is over the caps.
        """
        sandbox = self._sandbox
        if sandbox is None:  # the server never asks before a reset; be explicit anyway
            raise InvalidAction("no episode to snapshot: call reset first")
        limits = _proto_limits(self._limits)
        return snapshot_body.dump(
            SNAPSHOT_LAYOUT,
            {
                "limits": json_format.MessageToDict(limits),
                "max_steps": self._max_steps,
                "terminate_on_pass": self._terminate_on_pass,
                "allow_network": self._allow_network,
                "steps": self._steps,
                "last_exit_code": self._last_exit_code,
                "last_limit": int(self._last_limit),
                "files": workspace.capture(sandbox.workdir),
            },
        )

    def restore(self, snapshot: bytes) -> None:
        """Continue from :meth:`snapshot`'s bytes in a fresh sandbox (a new directory and
        uid) holding the recorded files; the limits pass the same checks as a reset's.

        Raises:
            InvalidAction: a field is malformed or over a cap (the episode is unchanged).
        """
        body = snapshot_body.load(SNAPSHOT_LAYOUT, snapshot)
        try:
            requested = json_format.ParseDict(body.mapping("limits"), CodingLimits())
        except json_format.ParseError as exc:
            raise body.invalid("limits", f"is not a CodingLimits: {exc}") from None
        limits = self._resolve(requested)
        max_steps = body.integer("max_steps", low=0, high=(1 << 32) - 1)
        terminate_on_pass = body.boolean("terminate_on_pass")
        allow_network = body.boolean("allow_network")
        self._check_network(allow_network)
        steps = body.integer("steps", low=0)
        last_exit_code = body.integer("last_exit_code", low=-(1 << 31), high=(1 << 31) - 1)
        last_limit = body.integer("last_limit")
        if last_limit not in Limit.values():
            raise body.invalid("last_limit", f"is {last_limit}, not a Limit")
        listing = workspace.check(body.children("files", max_items=workspace.MAX_ENTRIES))
        sandbox = Sandbox(limits, allow_network=allow_network, support=self._support)
        try:
            own = sandbox.uid if self._support.own_uid else None
            workspace.rebuild(sandbox.workdir, listing, own)
        except BaseException:
            sandbox.close()
            raise
        self._begin(
            sandbox,
            limits,
            max_steps=max_steps,
            terminate_on_pass=terminate_on_pass,
            allow_network=allow_network,
            steps=steps,
            last_exit_code=last_exit_code,
            last_limit=Limit.ValueType(last_limit),
        )

    @classmethod
    def reclaim_orphans(cls) -> None:
        """Release what sandboxes of processes that died without closing them left behind
        (their processes, directories, cgroups, IPC objects and temp files).

        Safe at any time from any process: live sandboxes, this process's included, are
        never touched. The server calls it at start and after an isolated worker dies;
        the first sandbox of each process also runs it.
        """
        reclaim_orphans(default_killer())

    # -- helpers ----------------------------------------------------------------------

    def _check_network(self, allow_network: bool) -> None:
        """Refuse an episode that asks for the network on a server that forbids it."""
        if allow_network and not self._settings.allow_network:
            raise InvalidAction(
                "allow_network is true, but this server does not allow the sandbox network "
                f"({ENV_VARS['allow_network']}=0)"
            )

    def _resolve(self, requested: CodingLimits | None) -> Limits:
        return resolve_limits(
            requested, self._settings, memory_cgroup=self._support.cgroup is not None
        )

    def _begin(
        self,
        sandbox: Sandbox,
        limits: Limits,
        *,
        max_steps: int,
        terminate_on_pass: bool,
        allow_network: bool,
        steps: int = 0,
        last_exit_code: int = 0,
        last_limit: Limit.ValueType = Limit.LIMIT_UNSPECIFIED,
    ) -> None:
        """Make ``sandbox`` the episode's (closing the previous one) with these settings
        and counters."""
        self._close_sandbox()
        self._sandbox = sandbox
        self._limits = limits
        self._max_steps = max_steps
        self._terminate_on_pass = terminate_on_pass
        self._allow_network = allow_network
        self._steps = steps
        self._last_exit_code = last_exit_code
        self._last_limit = last_limit

    def _close_sandbox(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None

    def _judge(
        self, sandbox: Sandbox, action: CodingAction, main: RunResult
    ) -> list[CodingTestResult]:
        """One result per test, in the action's order."""
        verdicts = _assertion_verdicts(main.verdicts)
        code_ok = "code ok" in main.verdicts
        results = []
        assertion_index = 0
        for index, test in enumerate(action.tests):
            name = test.name or f"test {index}"
            if test.WhichOneof("kind") == "assertion":
                verdict = verdicts.get(assertion_index)
                if verdict is None:
                    verdict = _no_verdict(main, code_ok)
                assertion_index += 1
                results.append(CodingTestResult(name=name, passed=not verdict, message=verdict))
            else:
                run = sandbox.run(test.io.stdin.encode())
                message = _compare(run, test.io)
                results.append(CodingTestResult(name=name, passed=not message, message=message))
        return results


def _observation(run: RunResult) -> CodingObservation:
    return CodingObservation(
        stdout=run.stdout.decode("utf-8", "replace"),
        stderr=run.stderr.decode("utf-8", "replace"),
        exit_code=run.exit_code,
        limit=run.limit,
        wall_seconds=run.wall_seconds,
        cpu_seconds=run.cpu_seconds,
        stdout_truncated=run.stdout_truncated,
        stderr_truncated=run.stderr_truncated,
    )


def _assertion_verdicts(lines: Sequence[str]) -> dict[int, str]:
    """Assertion index -> "" (passed) or the failure message, from the harness's lines."""
    verdicts: dict[int, str] = {}
    for line in lines:
        word, _, rest = line.partition(" ")
        if word not in ("pass", "fail"):
            continue
        number, _, message = rest.partition(" ")
        if not number.isdigit() or int(number) in verdicts:
            continue  # malformed, or a second verdict for the same test: the first stands
        verdicts[int(number)] = "" if word == "pass" else (message or "failed")
    return verdicts


def _no_verdict(run: RunResult, code_ok: bool) -> str:
    """Why an assertion test has no verdict: the process ended before it finished."""
    cause = _run_failure(run) or f"the process exited with code {run.exit_code}"
    if not code_ok:
        return f"the code did not finish ({cause}); the tests did not run"
    return f"the test did not finish ({cause})"


def _run_failure(run: RunResult) -> str:
    """A short reason a run failed ("" when it exited 0 within its limits)."""
    if run.limit in LIMIT_WORDS:
        return f"{LIMIT_WORDS[run.limit]} hit"
    if run.exit_code != 0:
        last = run.stderr.decode("utf-8", "replace").strip().splitlines()
        tail = f": {last[-1][:200]}" if last else ""
        return f"exit code {run.exit_code}{tail}"
    return ""


def _normalize(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _compare(run: RunResult, case: CodingIoCase) -> str:
    """ "" when the run produced the expected stdout cleanly, else what went wrong."""
    failure = _run_failure(run)
    if failure:
        return failure
    got = _normalize(run.stdout.decode("utf-8", "replace"))
    want = _normalize(case.expected_stdout)
    for number, (expected, actual) in enumerate(zip(want, got, strict=False), start=1):
        if expected != actual:
            return (
                f"stdout line {number}: expected {expected[:EXCERPT_CHARS]!r}, "
                f"got {actual[:EXCERPT_CHARS]!r}"
            )
    if len(got) != len(want):
        return f"stdout has {len(got)} lines; expected {len(want)}"
    return ""
