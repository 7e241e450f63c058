"""The client side of tests/test_swarm.py, run *inside* the swarm's network namespace
(``nsenter --net=...``): the replicas listen there, so the provider's health wait and the
sessions must run there too (Python 3.11 has no ``os.setns``).

``python swarm_client.py SCENARIO '{"url": ..., "image": ..., ...}'`` prints one JSON line
(``hold`` prints it once the service is up, then sleeps until it is killed).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

import docker

from openenv_grpc.client.channel import AioChannelPool
from openenv_grpc.providers.base import ProviderError
from openenv_grpc.providers.swarm import DockerSwarmProvider
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc
from openenv_grpc_envs.echo import AsyncEchoEnv, EchoAction, EchoEnv, EchoResetOptions

#: Each replica admits a different number of sessions, so Info tells them apart.
REPLICA_TAGGED_CAPACITY = {"MAX_CONCURRENT_ENVS": "1{{.Task.Slot}}0"}


def provider(params: dict[str, Any], **overrides: Any) -> DockerSwarmProvider:
    options: dict[str, Any] = {
        "docker_url": params["url"],
        "grace": 2,
        "start_timeout": 40,
        "labels": {"org.openenv-grpc.test": params["tag"]},
        **params.get("options", {}),
        **overrides,
    }
    return DockerSwarmProvider(params["image"], params.get("replicas", 3), **options)


def leftovers(params: dict[str, Any], name: str) -> dict[str, Any]:
    """What is left of the test's services and of service ``name``'s containers."""
    client = docker.DockerClient(base_url=params["url"])
    services = client.services.list(filters={"label": f"org.openenv-grpc.test={params['tag']}"})
    label = f"com.docker.swarm.service.name={name}"
    containers = client.containers.list(all=True, sparse=True, filters={"label": label})
    return {
        "left_services": [s.name for s in services],
        "left_containers": [c.id for c in containers],
    }


async def spread(target: str, sessions: int) -> list[dict[str, int]]:
    """``sessions`` full echo episodes, each on a channel (= connection) of its own, all
    open at once; for each, the replica that served it (Info on the same connection)."""
    async with AioChannelPool(target, size=sessions) as pool:
        envs = [AsyncEchoEnv(channel) for channel in pool.channels]
        seen = []
        for i, env in enumerate(envs):
            await env.open()
            first = await env.reset(seed=i, options=EchoResetOptions(max_steps=2))
            assert first.step_count == 0
        for i, (env, channel) in enumerate(zip(envs, pool.channels, strict=True)):
            one = await env.step(EchoAction(message=f"s{i}"))
            two = await env.step(EchoAction(message="end"))
            assert one.observation.echoed_message == f"s{i}"
            assert (one.truncated, two.truncated, two.step_count) == (False, True, 2)
            info = await pb_grpc.EnvServiceStub(channel).Info(pb.InfoRequest(), timeout=10)
            seen.append(
                {
                    "replica": info.capacity.max_sessions,
                    "active": info.capacity.active_sessions,
                    "total_length": (await env.state()).total_length,
                }
            )
        for env in envs:
            await env.close()
        return seen


def episodes(params: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    started = time.monotonic()
    p = provider(params, extra_env=REPLICA_TAGGED_CAPACITY, cpus=1, mem_limit="256m")
    with p, p.session(EchoEnv) as env:
        out["start_s"] = round(time.monotonic() - started, 2)
        out["target"], out["name"] = p.target, p.name
        first = env.reset(seed=1, options=EchoResetOptions(max_steps=3))
        steps = [env.step(EchoAction(message=m)) for m in ("a", "bb", "ccc")]
        out["sync_episode"] = {
            "first_step": first.step_count,
            "echoed": [s.observation.echoed_message for s in steps],
            "truncated": [s.truncated for s in steps],
            "total_length": env.state().total_length,
        }
        with p.session(EchoEnv) as other:  # a second session on the provider's channel
            other.reset(seed=2)
            out["second_session"] = other.step(EchoAction(message="x")).observation.echoed_message
        out["sessions"] = asyncio.run(spread(p.target, params.get("sessions", 12)))
        service = p.client.services.get(p.service_id)
        spec = service.attrs["Spec"]
        task = spec["TaskTemplate"]
        out["service"] = {
            "labels": spec["Labels"],
            "replicas": spec["Mode"]["Replicated"]["Replicas"],
            "networks": [
                p.client.networks.get(n["Target"]).name for n in task.get("Networks") or []
            ],
            "limits": task.get("Resources", {}).get("Limits"),
            "env": task["ContainerSpec"].get("Env"),
        }
        out["running_tasks"] = sum(1 for t in p.tasks() if t["Status"]["State"] == "running")
        out["running_containers"] = sum(1 for c in p.containers() if c.status == "running")
        out["watchdog_pid"] = p.watchdog_process.pid if p.watchdog_process else None
        out["logs"] = p.logs()
        stopping = time.monotonic()
    out["stop_s"] = round(time.monotonic() - stopping, 2)
    out.update(leftovers(params, out["name"]))
    if out["watchdog_pid"]:
        out["watchdog_exit"] = p.watchdog_process.poll() if p.watchdog_process else None
    return out


def hold(params: dict[str, Any]) -> None:
    p = provider(params)
    p.start()
    print(
        json.dumps(
            {
                "name": p.name,
                "service_id": p.service_id,
                "target": p.target,
                "pid": os.getpid(),
                "watchdog_pid": p.watchdog_process.pid if p.watchdog_process else None,
            }
        ),
        flush=True,
    )
    time.sleep(600)


def fail(params: dict[str, Any]) -> dict[str, Any]:
    p = provider(params)
    started = time.monotonic()
    out: dict[str, Any] = {"name": p.name}
    try:
        p.start()
    except ProviderError as exc:
        out["error"] = str(exc)
    else:
        out["error"] = None
        p.stop()
    out["elapsed_s"] = round(time.monotonic() - started, 2)
    out.update(leftovers(params, p.name))
    return out


def ingress(params: dict[str, Any]) -> dict[str, Any]:
    """The routing mesh: works (and spreads sessions) or fails saying why, clean either way."""
    p = provider(
        params,
        endpoint="ingress",
        health_interval=1,
        # The bound covers the replicas' start and then the mesh's health wait (which
        # fails on a kernel without IPVS); 12 s was too short for the replicas alone
        # on a loaded 2-core machine ("0 of 2 replicas serving after 12s").
        start_timeout=params.get("start_timeout", 30),
        extra_env=REPLICA_TAGGED_CAPACITY,
    )
    out: dict[str, Any] = {"name": p.name, "ipvs": os.path.exists("/proc/sys/net/ipv4/vs")}
    started = time.monotonic()
    try:
        with p:
            out["target"] = p.target
            out["sessions"] = asyncio.run(spread(p.target, 6))
        out["error"] = None
    except ProviderError as exc:
        out["error"] = str(exc)
    out["elapsed_s"] = round(time.monotonic() - started, 2)
    out.update(leftovers(params, p.name))
    return out


def main() -> None:
    scenario, params = sys.argv[1], json.loads(sys.argv[2])
    if scenario == "hold":
        hold(params)
        return
    result = {"episodes": episodes, "fail": fail, "ingress": ingress}[scenario](params)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
