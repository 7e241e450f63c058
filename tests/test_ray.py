"""RayProvider on a real 3-node Ray cluster (``ray start`` per node) inside a network
namespace of the test's own, which holds only loopback: Ray binds its daemons to every
address of the namespace, so none but 127.0.0.1 exists there. The scenarios run in that
namespace too (this file run as a script through ``nsenter``) and print what they saw
as JSON; the test asserts on it and on nothing being left behind.

Run by hand: ``python -m pytest tests/test_ray.py -x -q`` (root: it makes the namespace).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.procs import running

pytestmark = pytest.mark.timeout(420)

TESTS = Path(__file__).resolve().parent
PYTHON = sys.executable
RAY = str(Path(PYTHON).parent / "ray")
SNAP = "support.envs:SnapshotEchoEnv"
KEYS = {"SNAPSHOT_KEYS": "k1:0123456789abcdef0123456789abcdef"}
MESSAGES = ["alpha", "be", "gamma-ray", "d", "epsilon", "zeta", "eta", "theta-x", "i", "kappa"]
PORT = 46379
ADDRESS = f"127.0.0.1:{PORT}"
NODES = 3
NETNS_PREFIX = "oeg-ray-"
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_IMPORT_WARNING": "1"}
#: Runs ``ray start`` for each node and stays the daemons' parent: a subreaper that never
#: reaps, as systemd --user is, or a pytest worker after a coding test. A worker's own
#: raylet-death check (its parent turned pid 1) never fires under one; the actor's must.
KEEPER = """
import ctypes, json, signal, subprocess, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
for args in json.loads(sys.argv[1]):
    done = subprocess.run(args, capture_output=True, text=True, timeout=180)
    if done.returncode:
        sys.exit(f"ray start failed:\\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
print("started", flush=True)
signal.pause()
"""


class RayCluster:
    """A Ray cluster of ``nodes`` raylets (the head and workers) in a namespace."""

    def __init__(self, nodes: int = NODES) -> None:
        self.netns = f"{NETNS_PREFIX}{os.getpid()}"
        self.temp = Path(tempfile.mkdtemp(prefix="oeg-ray-"))
        self.nodes = nodes
        self.keeper: subprocess.Popen[str] | None = None

    @staticmethod
    def cleanup_leftovers() -> None:
        """Tear down the namespaces of earlier runs whose test process is gone."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        for name in listed.stdout.split():
            owner = name.removeprefix(NETNS_PREFIX)
            if name.startswith(NETNS_PREFIX) and not Path(f"/proc/{owner}").exists():
                stale = RayCluster.__new__(RayCluster)
                stale.netns, stale.temp, stale.nodes = name, Path(tempfile.mkdtemp()), 0
                stale.keeper = None
                stale.teardown()

    def nsenter(self) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.netns}"]

    def start(self) -> None:
        subprocess.run(["ip", "netns", "add", self.netns], check=True)
        subprocess.run(["ip", "-n", self.netns, "link", "set", "lo", "up"], check=True)
        common = [
            "--node-ip-address=127.0.0.1", "--num-cpus=1", "--disable-usage-stats",
            "--object-store-memory=80000000",
        ]  # fmt: skip
        head = [
            RAY, "start", "--head", f"--port={PORT}", "--include-dashboard=false",
            f"--temp-dir={self.temp}", *common,
        ]  # fmt: skip
        workers = [[RAY, "start", f"--address={ADDRESS}", *common]] * (self.nodes - 1)
        self.keeper = subprocess.Popen(
            [*self.nsenter(), PYTHON, "-c", KEEPER, json.dumps([head, *workers])],
            env={**os.environ, **RAY_ENV}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        assert self.keeper.stdout is not None and self.keeper.stderr is not None
        if self.keeper.stdout.readline().strip() != "started":
            raise RuntimeError(f"the cluster did not start:\n{self.keeper.stderr.read()}")

    def pids(self) -> list[int]:
        if not Path(f"/run/netns/{self.netns}").exists():
            return []
        out = subprocess.run(
            ["ip", "netns", "pids", self.netns], capture_output=True, text=True
        ).stdout
        return [int(pid) for pid in out.split() if int(pid) != os.getpid()]

    def run(self, scenario: str, timeout: float = 300) -> dict[str, Any]:
        """Run ``scenario`` of this file inside the namespace; its JSON result."""
        done = subprocess.run(
            [*self.nsenter(), PYTHON, __file__, scenario],
            env={**os.environ, **RAY_ENV, "PYTHONPATH": str(TESTS)},
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        assert done.returncode == 0 and lines, f"{scenario} failed:\n{done.stderr[-6000:]}"
        result: dict[str, Any] = json.loads(lines[-1])
        return result

    def teardown(self) -> list[int]:
        """Stop every process of the namespace (the raylets, GCS, workers, servers),
        delete it and the temp dir; returns what was still running after SIGTERM."""
        pids = self.pids()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 10
            while (pids := self.pids()) and time.monotonic() < deadline:
                time.sleep(0.1)
        if self.keeper is not None:
            self.keeper.wait(10)
        if Path(f"/run/netns/{self.netns}").exists():
            subprocess.run(["ip", "netns", "delete", self.netns], check=False)
        shutil.rmtree(self.temp, ignore_errors=True)
        return pids


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    RayCluster.cleanup_leftovers()
    ray_cluster = RayCluster()
    try:
        ray_cluster.start()
        yield ray_cluster
    finally:
        left = ray_cluster.teardown()
    assert left == []
    assert not Path(f"/run/netns/{ray_cluster.netns}").exists()


def test_servers_spread_restart_and_survive_a_lost_node(cluster: RayCluster) -> None:
    seen = cluster.run("spread_and_node_loss")
    # One server per node, distinct nodes.
    assert len(set(seen["nodes"])) == NODES
    # Sessions opened through the fleet land on every node, evenly.
    assert sorted(seen["loads"]) == [2] * NODES
    # A SIGKILLed server: Ray restarted its actor (same node), on a new server process.
    assert seen["restarted"] == {"same_node": True, "old_gone": True, "answered_by_new_pid": True}
    # drain(i), a rolling restart's step: the old server drained away, a new one serves.
    assert seen["drained"] == {"old_gone": True, "same_node": True, "serving": True}
    # A node lost with its raylet: its two sessions resumed elsewhere, the others
    # never noticed, and every episode has the rewards of an undisturbed run.
    assert sorted(seen["recoveries"]) == [0, 0, 0, 0, 1, 1]
    assert seen["recovered_on_victim"] == 0
    assert seen["same_rewards"]
    # stop() drained and removed everything on the cluster.
    assert seen["alive_servers_after_stop"] == []
    assert seen["actors_after_stop"] == 0
    assert seen["placement_groups_after_stop"] == 0


# -- the scenarios (run inside the namespace) --------------------------------------------


def _spread_and_node_loss() -> dict[str, Any]:
    import ray

    from openenv_grpc.client.fleet import Fleet
    from openenv_grpc.client.info import fetch_info
    from openenv_grpc.providers.ray_provider import RayProvider
    from openenv_grpc_envs.echo import EchoAction, EchoEnv, EchoResetOptions

    result: dict[str, Any] = {}
    provider = RayProvider(
        SNAP, address=ADDRESS, grace=1, num_cpus=0.5,
        extra_env={**KEYS, "PYTHONPATH": str(TESTS)},
        ray_init={"log_to_driver": False},
    )  # fmt: skip
    provider.start()
    try:
        result["nodes"] = [server["node_id"] for server in provider.servers]
        head = ray.get_runtime_context().get_node_id()
        with Fleet(provider) as fleet:
            fleet.wait_ready()
            sessions = [fleet.session(EchoEnv) for _ in range(2 * NODES)]
            for env in sessions:
                env.open()
            result["loads"] = list(fleet.loads().values())
            for env in sessions:
                env.close()

        # Restart policy: the server dies, its actor ends, Ray starts it again.
        first = provider.servers[0]
        os.kill(first["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(ray.exceptions.RayActorError):
                now = provider.refresh()[0]
                if now["pid"] != first["pid"]:
                    break
            assert time.monotonic() < deadline, "the actor was not restarted"
            time.sleep(0.2)
        # The loop above only ends on a new pid: what it cannot show is that the old
        # process is gone and the new one is the server answering at the new target.
        served_by = fetch_info(now["target"], timeout=30).server_pid
        result["restarted"] = {
            "same_node": now["node_id"] == first["node_id"],
            "old_gone": not running(first["pid"]),
            "answered_by_new_pid": served_by == now["pid"],
        }

        # Rolling restart of one server: drained, started again in its bundle, SERVING.
        before = provider.servers[1]
        provider.drain(1)
        after = provider.servers[1]
        with Fleet(provider) as fleet:
            result["drained"] = {
                "old_gone": not running(before["pid"]),
                "same_node": after["node_id"] == before["node_id"],
                "serving": after["target"] in fleet.healthy(),
            }

        # Node loss: kill the raylet of a worker node (not the head: the driver's own).
        seeds = [21, 22, 23, 24, 25, 26]
        with Fleet(provider) as fleet:
            fleet.wait_ready()
            recovery = fleet.recovery(every=3)
            sessions = [fleet.session(EchoEnv, recovery=recovery) for _ in seeds]
            trajectories: list[list[tuple[float, int, bool]]] = []
            for env, seed in zip(sessions, seeds, strict=True):
                env.open()
                env.reset(seed=seed, options=EchoResetOptions(max_steps=50))
                trajectories.append([])
            pids = [
                int(env.step(EchoAction(message="pid")).observation.echoed_message)
                for env in sessions
            ]
            by_pid = {server["pid"]: server for server in provider.servers}
            victim = next(by_pid[pid] for pid in pids if by_pid[pid]["node_id"] != head)
            for index, message in enumerate(MESSAGES):
                if index == 4:  # the node goes: its raylet, then (with it) its server
                    os.kill(victim["raylet_pid"], signal.SIGKILL)
                    killed = time.monotonic()
                    while running(victim["pid"]):
                        assert time.monotonic() < killed + 90, "the node's server lives on"
                        time.sleep(0.05)
                    result["server_gone_after_s"] = round(time.monotonic() - killed, 2)
                for env, trajectory in zip(sessions, trajectories, strict=True):
                    result_ = env.step(EchoAction(message=message))
                    trajectory.append((result_.reward, result_.step_count, result_.done))
            result["recoveries"] = [env.recoveries for env in sessions]
            after = [
                int(env.step(EchoAction(message="pid")).observation.echoed_message)
                for env in sessions
            ]
            result["recovered_on_victim"] = after.count(victim["pid"])
            for env in sessions:
                env.close()
        survivor = next(s for s in provider.servers if s["node_id"] != victim["node_id"])
        undisturbed = []
        for seed in seeds:
            with EchoEnv(survivor["target"]) as env:
                env.reset(seed=seed, options=EchoResetOptions(max_steps=50))
                undisturbed.append([
                    (r.reward, r.step_count + 1, r.done)
                    for r in (env.step(EchoAction(message=m)) for m in MESSAGES)
                ])  # fmt: skip
        result["same_rewards"] = trajectories == undisturbed
        server_pids = {
            *(s["pid"] for s in provider.servers),
            victim["pid"],
            first["pid"],
            before["pid"],
        }
    finally:
        provider.stop()
    # stop() returns once Ray has the actors killed; their processes exit just after.
    deadline = time.monotonic() + 10
    while any(running(p) for p in server_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    result["alive_servers_after_stop"] = [p for p in server_pids if running(p)]
    ray.init(address=ADDRESS, log_to_driver=False)
    result["actors_after_stop"] = len(
        [a for a in ray._private.state.actors().values() if a["State"] != "DEAD"]
    )
    result["placement_groups_after_stop"] = len(
        [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]
    )
    ray.shutdown()
    return result


SCENARIOS = {"spread_and_node_loss": _spread_and_node_loss}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]]()), flush=True)
