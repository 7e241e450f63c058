"""SlurmProvider on a real SLURM cluster: slurmctld and 3 slurmd nodes (Debian's
slurm-wlm, munge) started by scripts/start_slurm.sh inside a network namespace of the
test's own that holds only loopback. The scenarios run in that namespace too (this file
run as a script through ``nsenter``) and print what they saw as JSON; the test asserts
on it and on nothing being left behind.

Run by hand: ``python -m pytest tests/test_slurm.py -x -q`` (root: it makes the namespace).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.procs import running

pytestmark = pytest.mark.timeout(300)

TESTS = Path(__file__).resolve().parent
START = TESTS.parent / "scripts" / "start_slurm.sh"
SNAP = "support.envs:SnapshotEchoEnv"
KEYS = {"SNAPSHOT_KEYS": "k1:0123456789abcdef0123456789abcdef"}
MESSAGES = ["alpha", "be", "gamma-ray", "d", "epsilon", "zeta", "eta", "theta-x", "i", "kappa"]
NODES = 3
NETNS_PREFIX = "oeg-slurm-"


class SlurmCluster:
    """The cluster of scripts/start_slurm.sh in a namespace named after this process."""

    def __init__(self) -> None:
        self.netns = f"{NETNS_PREFIX}{os.getpid()}"
        self.dir = Path(tempfile.gettempdir()) / self.netns
        self.conf = self.dir / "slurm.conf"

    def start(self) -> None:
        done = subprocess.run(
            ["sh", str(START), "start", str(self.dir), str(NODES), self.netns],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, f"start_slurm.sh failed:\n{done.stdout}{done.stderr}"

    def stop(self) -> None:
        subprocess.run(
            ["sh", str(START), "stop", str(self.dir), self.netns], timeout=120, check=True
        )

    def run(self, scenario: str, timeout: float = 240) -> dict[str, Any]:
        """Run ``scenario`` of this file inside the namespace; its JSON result."""
        done = subprocess.run(
            ["nsenter", f"--net=/run/netns/{self.netns}", sys.executable, __file__, scenario],
            env={**os.environ, "SLURM_CONF": str(self.conf), "PYTHONPATH": str(TESTS)},
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        assert done.returncode == 0 and lines, f"{scenario} failed:\n{done.stderr[-6000:]}"
        result: dict[str, Any] = json.loads(lines[-1])
        return result

    @staticmethod
    def cleanup_leftovers() -> None:
        """Tear down the clusters of earlier runs whose test process is gone."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        for name in listed.stdout.split():
            owner = name.removeprefix(NETNS_PREFIX)
            if name.startswith(NETNS_PREFIX) and not Path(f"/proc/{owner}").exists():
                stale = Path(tempfile.gettempdir()) / name
                subprocess.run(["sh", str(START), "stop", str(stale), name], timeout=120)


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    SlurmCluster.cleanup_leftovers()
    slurm = SlurmCluster()
    try:
        slurm.start()
        yield slurm
    finally:
        slurm.stop()
    assert not Path(f"/run/netns/{slurm.netns}").exists()
    assert not slurm.dir.exists()


def test_one_server_per_node_sessions_on_every_node_and_a_lost_node_loses_nothing(
    cluster: SlurmCluster,
) -> None:
    seen = cluster.run("spread_and_node_loss")
    assert sorted(seen["nodes"]) == [f"node{i}" for i in range(1, NODES + 1)]
    assert len(set(seen["targets"])) == NODES  # ports chosen without collisions
    assert sorted(seen["loads"]) == [2] * NODES
    assert sorted(seen["recoveries"]) == [0, 0, 0, 0, 1, 1]
    assert seen["recovered_on_victim"] == 0
    assert seen["same_rewards"]
    assert seen["alive_servers_after_stop"] == []
    assert seen["jobs_after_stop"] == ""
    assert not seen["workdir_left"]


def test_scancel_drains_open_sessions_and_leaves_nothing(cluster: SlurmCluster) -> None:
    seen = cluster.run("drain_on_scancel")
    assert seen["draining_seen"] and seen["lost_code"] == "UNAVAILABLE"
    assert seen["alive_servers_after_stop"] == []
    assert seen["jobs_after_stop"] == ""
    assert not seen["workdir_left"]


def test_a_job_that_cannot_start_in_time_is_cancelled_with_its_reason(
    cluster: SlurmCluster,
) -> None:
    seen = cluster.run("too_many_nodes")
    assert "(PENDING, reason: " in seen["error"], seen["error"]
    assert "0 of 8 servers announced a port in 3s" in seen["error"], seen["error"]
    assert seen["jobs_after"] == ""


def test_the_sbatch_recipe_serves_on_every_node_and_drains_on_scancel(
    cluster: SlurmCluster,
) -> None:
    seen = cluster.run("recipe")
    assert sorted(seen["nodes"]) == ["node1", "node2"]
    assert seen["serving"] == [True, True]
    assert seen["jobs_after_stop"] == ""
    assert seen["alive_servers_after_stop"] == []


def test_the_job_of_a_killed_owner_is_cancelled_by_the_next_start(
    cluster: SlurmCluster,
) -> None:
    seen = cluster.run("orphan")
    assert seen["running_after_owner_died"]
    assert seen["cancelled"] == [seen["job"]]
    assert seen["jobs_after"] == ""
    assert not seen["workdir_left"]


# -- the scenarios (run inside the namespace) --------------------------------------------


def _provider(**kwargs: Any) -> Any:
    from openenv_grpc.providers.slurm import SlurmProvider

    return SlurmProvider(SNAP, grace=1, extra_env={**KEYS, "PYTHONPATH": str(TESTS)}, **kwargs)


def _pid(env: Any) -> int:
    from openenv_grpc_envs.echo import EchoAction

    return int(env.step(EchoAction(message="pid")).observation.echoed_message)


def _leftovers(provider: Any, pids: set[int], workdir: Path) -> dict[str, Any]:
    queue = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True)
    return {
        "alive_servers_after_stop": [p for p in pids if running(p)],
        "jobs_after_stop": queue.stdout.strip(),
        "workdir_left": workdir.exists(),
    }


def _spread_and_node_loss() -> dict[str, Any]:
    from openenv_grpc.client.fleet import Fleet
    from openenv_grpc.client.info import fetch_info
    from openenv_grpc_envs.echo import EchoAction, EchoEnv, EchoResetOptions

    result: dict[str, Any] = {}
    provider = _provider(nodes=NODES)  # host: each node's NodeAddr, via scontrol
    provider.start()
    workdir = provider.workdir
    pids = {fetch_info(target).server_pid for target in provider.targets}
    try:
        result["nodes"] = [server["node"] for server in provider.servers]
        result["targets"] = provider.targets
        by_pid = {fetch_info(server["target"]).server_pid: server for server in provider.servers}
        with Fleet(provider) as fleet:
            fleet.wait_ready()
            sessions = [fleet.session(EchoEnv) for _ in range(2 * NODES)]
            for env in sessions:
                env.open()
            result["loads"] = list(fleet.loads().values())
            for env in sessions:
                env.close()

        seeds = [31, 32, 33, 34, 35, 36]
        with Fleet(provider) as fleet:
            fleet.wait_ready()
            recovery = fleet.recovery(every=3)
            sessions = [fleet.session(EchoEnv, recovery=recovery) for _ in seeds]
            trajectories: list[list[tuple[float, int, bool]]] = []
            for env, seed in zip(sessions, seeds, strict=True):
                env.open()
                env.reset(seed=seed, options=EchoResetOptions(max_steps=50))
                trajectories.append([])
            homes = [_pid(env) for env in sessions]
            victim_pid = homes[0]
            node = by_pid[victim_pid]["node"]
            slurmd = int(Path(os.environ["SLURM_CONF"]).with_name(f"slurmd-{node}.pid").read_text())
            for index, message in enumerate(MESSAGES):
                if index == 4:  # the node goes: its slurmd and its server
                    os.kill(slurmd, signal.SIGKILL)
                    os.kill(victim_pid, signal.SIGKILL)
                for env, trajectory in zip(sessions, trajectories, strict=True):
                    step = env.step(EchoAction(message=message))
                    trajectory.append((step.reward, step.step_count, step.done))
            result["recoveries"] = [env.recoveries for env in sessions]
            result["recovered_on_victim"] = [_pid(env) for env in sessions].count(victim_pid)
            for env in sessions:
                env.close()
        survivor = next(s for p, s in by_pid.items() if p != victim_pid)
        undisturbed = []
        for seed in seeds:
            with EchoEnv(survivor["target"]) as env:
                env.reset(seed=seed, options=EchoResetOptions(max_steps=50))
                undisturbed.append([
                    (r.reward, r.step_count + 1, r.done)
                    for r in (env.step(EchoAction(message=m)) for m in MESSAGES)
                ])  # fmt: skip
        result["same_rewards"] = trajectories == undisturbed
        # The node comes back (ReturnToService=2) for the next test.
        subprocess.run(["slurmd", "-f", os.environ["SLURM_CONF"], "-N", node], check=True)
    finally:
        provider.stop()
    result.update(_leftovers(provider, pids, workdir))
    return result


def _drain_on_scancel() -> dict[str, Any]:
    import grpc

    from openenv_grpc.client import SessionLost
    from openenv_grpc.client.info import fetch_info
    from openenv_grpc_envs.echo import EchoAction, EchoEnv

    result: dict[str, Any] = {"draining_seen": False, "lost_code": ""}
    provider = _provider(nodes=2)
    _wait_idle(2)
    provider.start()
    workdir = provider.workdir
    pids = {fetch_info(target).server_pid for target in provider.targets}
    env = EchoEnv(provider.targets[0])
    env.open()
    env.reset(seed=1)
    stopping = threading.Thread(target=provider.stop)
    stopping.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            env.step(EchoAction(message="x"))
            result["draining_seen"] = result["draining_seen"] or env.draining is not None
            time.sleep(0.05)
    except SessionLost as lost:
        result["lost_code"] = lost.code.name
        assert lost.code is grpc.StatusCode.UNAVAILABLE
    finally:
        env.abort()
        stopping.join()
    result.update(_leftovers(provider, pids, workdir))
    return result


def _too_many_nodes() -> dict[str, Any]:
    from openenv_grpc.providers import ProviderError

    provider = _provider(nodes=NODES + 5, start_timeout=3)
    try:
        provider.start()
    except ProviderError as exc:
        error = str(exc)
    else:
        provider.stop()
        error = "started"
    queue = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True)
    return {"error": error, "jobs_after": queue.stdout.strip()}


def _wait_idle(count: int, timeout: float = 60) -> None:
    """Until ``count`` nodes are idle (a node that came back takes a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"], capture_output=True, text=True
        ).stdout.split()
        if len(set(out)) >= count or time.monotonic() > deadline:
            return
        time.sleep(0.2)


def _recipe() -> dict[str, Any]:
    import re

    from openenv_grpc.client.fleet import Fleet
    from openenv_grpc.client.info import fetch_info

    recipe = TESTS.parent / "deploy" / "slurm" / "openenv-grpc.sbatch"
    _wait_idle(2)
    with tempfile.TemporaryDirectory() as workdir:
        job = subprocess.run(
            ["sbatch", "--parsable", "--nodes=2", f"--chdir={workdir}", "--export=ALL",
             str(recipe), "echo"],
            env={**os.environ, "PYTHON": sys.executable, "GRACE": "1"},
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        output = Path(workdir) / f"openenv-grpc-{job}.out"
        deadline = time.monotonic() + 60
        while True:
            text = output.read_text() if output.exists() else ""
            targets = re.findall(r"openenv-grpc: serving \S+ on (\S+)", text)
            if len(targets) == 2:
                break
            assert time.monotonic() < deadline, text
            time.sleep(0.1)
        nodes = re.findall(r"openenv-grpc-node: (\S+)", text)
        with Fleet(targets) as fleet:
            serving = [target in fleet.healthy() for target in targets]
        pids = {fetch_info(target).server_pid for target in targets}
        subprocess.run(["scancel", job], check=True)
        deadline = time.monotonic() + 60
        while subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline, "the job did not end"
            time.sleep(0.2)
    # Read again after the wait, as _leftovers does: what the caller checks is the queue.
    queue = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True)
    return {
        "nodes": nodes,
        "serving": serving,
        "jobs_after_stop": queue.stdout.strip(),
        "alive_servers_after_stop": [p for p in pids if running(p)],
    }


def _orphan() -> dict[str, Any]:
    from openenv_grpc.providers.slurm import cleanup_orphan_jobs

    _wait_idle(1)
    owner = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from openenv_grpc.providers.slurm import SlurmProvider\n"
         "p = SlurmProvider('echo', nodes=1, grace=1)\n"
         "p.start()\n"
         "print(p.job_id, p.workdir, flush=True)\n"
         "time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert owner.stdout is not None
    job, workdir = owner.stdout.readline().split()
    owner.kill()  # SIGKILL: its stop() never runs
    owner.wait()
    queue = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True)
    running = queue.stdout.split() == [job]
    cancelled = cleanup_orphan_jobs()  # what every start() runs first
    deadline = time.monotonic() + 60
    while subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout:
        assert time.monotonic() < deadline, "the orphan job did not end"
        time.sleep(0.2)
    queue = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True)
    return {
        "job": job,
        "running_after_owner_died": running,
        "cancelled": cancelled,
        "jobs_after": queue.stdout.strip(),
        "workdir_left": Path(workdir).exists(),
    }


SCENARIOS = {
    "orphan": _orphan,
    "recipe": _recipe,
    "spread_and_node_loss": _spread_and_node_loss,
    "drain_on_scancel": _drain_on_scancel,
    "too_many_nodes": _too_many_nodes,
}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]]()), flush=True)
