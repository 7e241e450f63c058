"""``SlurmProvider``: one server of an environment on each node of a SLURM allocation,
behind one balanced target.

``with SlurmProvider("echo", nodes=4, partition="cpu") as p, p.session(EchoEnv) as env:``

:meth:`start` submits one batch job (``sbatch``) whose single step (``srun``, one task
per node) runs ``openenv-grpc serve`` on every node of the allocation. Each server
listens on its node's address (``NodeAddr``, or ``host``) on a port the kernel picks
(``--port 0``: two servers never collide, whatever else runs there) and prints its
serving line; the provider reads the lines from the job's output file, waits for each
server's ``grpc.health.v1`` SERVING, and exposes their targets (:attr:`targets`) and all
of them as one gRPC target balanced per stream (:attr:`target`, see
:mod:`openenv_grpc.client.fleet`).

:meth:`stop` cancels the job (``scancel``): SLURM sends SIGTERM to every task -- the
servers drain for their grace -- and SIGKILL after its ``KillWait``, so keep ``grace``
below that. The provider waits for the job to leave the queue and deletes its files.
A job whose owner died first ends at its ``time_limit``, or at the next
:meth:`start`'s :func:`cleanup_orphan_jobs` (the job's comment names its owner).

``workdir`` must be visible from the node that runs the batch script (the first of the
allocation), which writes the output file: on a real cluster, a shared filesystem.
The same job as a plain script, for people who do not launch from Python, is
``deploy/slurm/openenv-grpc.sbatch``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from openenv_grpc.metadata import SERVICE_NAME, SERVING_LINE
from openenv_grpc.providers.base import FleetProvider, ProviderError, wait_serving
from openenv_grpc.providers.ownership import owner_gone, owner_labels

__all__ = ["SlurmProvider", "cleanup_orphan_jobs"]

#: Prefix of every job name this module submits (``squeue --name`` finds them).
JOB_PREFIX = "openenv-grpc-"

#: Prefix of the temp dirs :meth:`SlurmProvider.start` makes (no ``workdir`` given).
_TEMP_PREFIX = "openenv-grpc-slurm-"

#: States of a job still queued or running.
_LIVE_STATES = frozenset(
    {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "RESIZING", "REQUEUED"}
)

#: ``srun --label`` output: "<task>: <line>".
_LABELLED = re.compile(r"^\s*(\d+): (.*)$")
_NODE_LINE = re.compile(r"openenv-grpc-node: (\S+)")

#: What each task runs: find the node's address, say which node it is, become the server.
_TASK = (
    'host="${OPENENV_GRPC_HOST:-$(scontrol show node -o "$SLURMD_NODENAME" '
    "| sed -n 's/.* NodeAddr=\\([^ ]*\\).*/\\1/p')}\"; "
    'echo "openenv-grpc-node: $SLURMD_NODENAME"; exec "$@" --host "$host" --port 0'
)


def _run(command: Sequence[str], env: Mapping[str, str], timeout: float = 60.0) -> str:
    """Run a SLURM command; its stdout.

    Raises:
        ProviderError: it failed or is not installed.
    """
    try:
        done = subprocess.run(
            list(command), env=dict(env), capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ProviderError(f"{command[0]} failed: {exc}") from None
    if done.returncode != 0:
        raise ProviderError(f"{shlex.join(command)} failed: {done.stderr.strip()}")
    return done.stdout


def _owner_comment() -> str:
    labels = owner_labels("slurm")
    return "openenv-grpc " + " ".join(f"{key}={value}" for key, value in labels.items())


def cleanup_orphan_jobs(environ: Mapping[str, str] | None = None) -> list[str]:
    """Cancel this module's jobs whose owner process (on this machine) is gone, and
    delete the temp dirs they were submitted from.

    Returns:
        The job ids cancelled.
    """
    env = {**os.environ, **(environ or {})}
    try:
        listing = _run(["squeue", "-h", "-o", "%i|%j|%o|%k", "--me"], env)
    except ProviderError:
        return []
    cancelled = []
    for line in listing.splitlines():
        job, _, rest = line.partition("|")
        name, _, rest = rest.partition("|")
        script, _, comment = rest.partition("|")
        if not name.startswith(JOB_PREFIX) or not comment.startswith("openenv-grpc "):
            continue
        labels = dict(item.split("=", 1) for item in comment.split()[1:] if "=" in item)
        if owner_gone(labels):
            try:
                _run(["scancel", job], env)
            except ProviderError:
                continue
            cancelled.append(job)
            workdir = Path(script).parent
            if workdir.name.startswith(_TEMP_PREFIX):  # made by the dead owner's start()
                shutil.rmtree(workdir, ignore_errors=True)
    return cancelled


class SlurmProvider(FleetProvider):
    """One ``openenv-grpc serve`` per node of a SLURM job (see the module's docstring).

    Args:
        env: What ``serve`` gets: a packaged env name or ``module:factory``.
        nodes: Nodes to allocate (one server each).
        args: More ``serve`` flags.
        host: Listen address on every node (None: each node's ``NodeAddr``).
        partition: ``--partition`` (None: the cluster's default).
        time_limit: ``--time`` (e.g. ``"04:00:00"``; None: the partition's).
        max_concurrent_envs: ``--max-concurrent-envs`` per server.
        grace: ``--grace`` seconds for the drain (keep it below the cluster's KillWait).
        extra_env: Environment variables for the servers (e.g. ``SNAPSHOT_KEYS``).
        sbatch_args: More ``sbatch`` options (``--account=...``, ``--cpus-per-task=4``).
        slurm_env: Environment for the SLURM commands (e.g. ``SLURM_CONF``), added to
            this process's.
        workdir: Where the job's script and output go (None: a new temp dir); removed
            on stop.
        python: The interpreter on the nodes that runs ``serve``.
        start_timeout: Seconds for the job to start and every server to be SERVING.
        stop_timeout: Seconds :meth:`stop` waits for the job to leave the queue.
    """

    def __init__(
        self,
        env: str = "echo",
        *,
        nodes: int = 2,
        args: Sequence[str] = (),
        host: str | None = None,
        partition: str | None = None,
        time_limit: str | None = None,
        max_concurrent_envs: int | None = None,
        grace: float | None = None,
        extra_env: Mapping[str, str] | None = None,
        sbatch_args: Sequence[str] = (),
        slurm_env: Mapping[str, str] | None = None,
        workdir: str | Path | None = None,
        python: str = sys.executable,
        start_timeout: float = 120.0,
        stop_timeout: float = 60.0,
        health_service: str = SERVICE_NAME,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        super().__init__(credentials=credentials)
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        self.env = env
        self.nodes = nodes
        flags: list[str] = []
        if max_concurrent_envs is not None:
            flags += ["--max-concurrent-envs", str(max_concurrent_envs)]
        if grace is not None:
            flags += ["--grace", str(grace)]
        self.command = [python, "-m", "openenv_grpc", "serve", env, *flags, *args]
        self.host = host
        self.partition = partition
        self.time_limit = time_limit
        self.extra_env = dict(extra_env or {})
        self.sbatch_args = list(sbatch_args)
        self.slurm_env = {**os.environ, **(slurm_env or {})}
        self._workdir_given = Path(workdir) if workdir is not None else None
        self.workdir: Path | None = None
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.health_service = health_service
        #: The job's id once submitted.
        self.job_id = ""
        #: Each server: task, node (name) and target, in task order.
        self.servers: list[dict[str, Any]] = []

    def script(self) -> str:
        """The batch script :meth:`start` submits."""
        assert self.workdir is not None
        name = JOB_PREFIX + re.sub(r"[^A-Za-z0-9_.-]", "-", self.env)[:40]
        lines = [
            "#!/bin/sh",
            f"#SBATCH --job-name={name}",
            f"#SBATCH --nodes={self.nodes}",
            "#SBATCH --ntasks-per-node=1",
            f"#SBATCH --output={self.workdir}/job-%j.out",
            f"#SBATCH --comment={shlex.quote(_owner_comment())}",
        ]
        if self.partition:
            lines.append(f"#SBATCH --partition={self.partition}")
        if self.time_limit:
            lines.append(f"#SBATCH --time={self.time_limit}")
        exports = [f"export {key}={shlex.quote(value)}" for key, value in self.extra_env.items()]
        if self.host:
            exports.append(f"export OPENENV_GRPC_HOST={shlex.quote(self.host)}")
        # One task per node; a task that dies leaves the others serving.
        srun = [
            "srun", "--label", "--unbuffered", "--kill-on-bad-exit=0",
            f"--ntasks={self.nodes}", "--ntasks-per-node=1",
            "sh", "-c", _TASK, "sh", *self.command,
        ]  # fmt: skip
        return "\n".join([*lines, *exports, "exec " + shlex.join(srun), ""])

    def start(self) -> None:
        """Submit the job, read every server's port, wait for SERVING.

        Raises:
            ProviderError: sbatch failed, the job ended or did not start every server
                within ``start_timeout`` (it is cancelled then, with its output in the
                message).
            RuntimeError: already started.
        """
        if self.job_id:
            raise RuntimeError("the provider is already started")
        cleanup_orphan_jobs(self.slurm_env)
        self.workdir = self._workdir_given or Path(tempfile.mkdtemp(prefix=_TEMP_PREFIX))
        self.workdir.mkdir(parents=True, exist_ok=True)
        path = self.workdir / "openenv-grpc.sbatch"
        path.write_text(self.script())
        try:
            submitted = _run(["sbatch", "--parsable", *self.sbatch_args, str(path)], self.slurm_env)
            self.job_id = submitted.strip().split(";")[0]
            deadline = time.monotonic() + self.start_timeout
            self.servers = self._wait_for_ports(deadline)
            for server in self.servers:
                wait_serving(
                    server["target"], self.health_service,
                    max(1.0, deadline - time.monotonic()), credentials=self.credentials,
                )  # fmt: skip
        except BaseException as exc:
            output = self.output()
            self._stop_servers()
            if isinstance(exc, ProviderError):
                raise ProviderError(f"{exc}; job output:\n{output[-4000:]}") from None
            raise

    def output(self) -> str:
        """The job's output so far ("" before it starts or once stopped)."""
        if self.workdir is None or not self.job_id:
            return ""
        try:
            return (self.workdir / f"job-{self.job_id}.out").read_text(errors="replace")
        except OSError:
            return ""

    def state(self) -> str:
        """The job's state as squeue/scontrol say (``RUNNING``, ...; "" once gone)."""
        if not self.job_id:
            return ""
        try:
            out = _run(["squeue", "-h", "-j", self.job_id, "-o", "%T"], self.slurm_env)
        except ProviderError:
            return ""
        return out.strip()

    def _reason(self) -> str:
        """Why squeue says the job waits (``Resources``, ``PartitionNodeLimit``, ...)."""
        try:
            out = _run(["squeue", "-h", "-j", self.job_id, "-o", "%r"], self.slurm_env)
        except ProviderError:
            return "gone"
        return out.strip()

    def _wait_for_ports(self, deadline: float) -> list[dict[str, Any]]:
        while True:
            nodes: dict[int, str] = {}
            targets: dict[int, str] = {}
            for line in self.output().splitlines():
                labelled = _LABELLED.match(line)
                if labelled is None:
                    continue
                task, text = int(labelled.group(1)), labelled.group(2)
                if node := _NODE_LINE.search(text):
                    nodes[task] = node.group(1)
                elif serving := SERVING_LINE.search(text):
                    host = serving.group(2)
                    host = f"[{host}]" if ":" in host else host
                    targets[task] = f"{host}:{serving.group(3)}"
            if len(targets) == self.nodes:
                return [
                    {"task": task, "node": nodes.get(task, ""), "target": targets[task]}
                    for task in sorted(targets)
                ]
            state = self.state()
            if (state and state not in _LIVE_STATES) or (not state and time.monotonic() > deadline):
                raise ProviderError(f"job {self.job_id} ended ({state or 'gone'})")
            if time.monotonic() > deadline:
                raise ProviderError(
                    f"job {self.job_id} ({state}, reason: {self._reason()}): {len(targets)} "
                    f"of {self.nodes} servers announced a port in {self.start_timeout}s"
                )
            time.sleep(0.1)

    def _stop_servers(self) -> None:
        if self.job_id:
            with contextlib.suppress(ProviderError):
                _run(["scancel", self.job_id], self.slurm_env)  # SIGTERM: the drain
            deadline = time.monotonic() + self.stop_timeout
            while self.state() in _LIVE_STATES:
                if time.monotonic() > deadline:
                    with contextlib.suppress(ProviderError):
                        _run(["scancel", "--signal=KILL", "--full", self.job_id], self.slurm_env)
                    break
                time.sleep(0.2)
            self.job_id = ""
        if self.workdir is not None and self._workdir_given is None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir = None
        self.servers = []
