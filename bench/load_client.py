"""One load-generating client process for the side-by-side benchmark (`bench.run`).

Run as a script by path, by either Python: the project's (``system: grpc``, sessions are
typed ``AsyncEchoEnv`` streams over shared ``grpc.aio`` channels) or the OpenEnv
benchmark venv's (``system: openenv``, one ``websockets`` connection per session, speaking
OpenEnv's ``/ws`` JSON protocol as its own ``EnvClient`` does). Only the standard library
is imported at the top, so the same file runs in both.

Protocol with the orchestrator: the first stdin line is a JSON config; the client writes
JSON lines (``{"event": ...}``) to stdout and waits for command lines on stdin:

* ``steady``: open ``sessions`` (connect + reset), say ``ready``, wait for ``go T0``
  (``time.monotonic()`` clock, shared by all processes on the machine), then every session
  steps in a closed loop (one step in flight) until ``T0 + warmup + seconds``; steps that
  complete inside ``[T0 + warmup, T0 + warmup + seconds)`` are measured. Says ``result``.
* ``open``: ``count`` sessions one after the other: time connect + reset, then close.
* ``idle``: for each ``open K`` line, open K more sessions and hold them; say ``held``.
  ``exit`` ends the process without closing anything (the server is gone by then).
* ``admission``: say ``ready``, wait for ``go``, then launch all ``sessions`` at once:
  each connects, resets, takes one step, closes, within ``timeout`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import sys
import time
from typing import Any

clock = time.monotonic


def emit(event: str, **data: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **data}) + "\n")
    sys.stdout.flush()


async def read_line() -> str:
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    if not line:
        raise SystemExit(0)  # the orchestrator went away
    return line.strip()


def describe(exc: BaseException) -> str:
    text = str(exc).replace("\n", " ")
    return f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__


# -- drivers: the same five operations over gRPC and over OpenEnv's WebSocket -----------


class GrpcDriver:
    """openenv-grpc sessions (also the bare floor): streams over shared channels."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        import grpc

        from openenv_grpc.client.channel import channel_options
        from openenv_grpc_envs.echo import AsyncEchoEnv, EchoAction

        self._grpc = grpc
        self._env_cls = AsyncEchoEnv
        self._target = cfg["target"]
        self._per_channel = max(1, int(cfg.get("sessions_per_channel", 250)))
        # A channel argument unique to the channel keeps gRPC from pooling the TCP
        # connections of channels to the same target: N channels = N connections.
        self._options = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
        self._channels: list[Any] = []
        self._action = EchoAction(message=cfg["message"])

    def _channel(self, index: int) -> Any:
        k = index // self._per_channel
        while len(self._channels) <= k:
            self._channels.append(
                self._grpc.aio.insecure_channel(self._target, options=self._options)
            )
        return self._channels[k]

    async def open(self, index: int) -> Any:
        env = self._env_cls(self._channel(index))
        await env.open()
        await env.reset()
        return env

    async def open_cold(self) -> Any:
        """A session on a channel of its own (TCP + HTTP/2 handshake included)."""
        channel = self._grpc.aio.insecure_channel(self._target, options=self._options)
        env = self._env_cls(channel)
        env._cold_channel = channel  # closed with the session
        await env.open()
        await env.reset()
        return env

    async def step(self, env: Any) -> None:
        await env.step(self._action)

    async def close(self, env: Any) -> None:
        await env.close()
        channel = getattr(env, "_cold_channel", None)
        if channel is not None:
            await channel.close()

    def alive(self, env: Any) -> bool:
        return bool(env.is_open)

    async def shutdown(self) -> None:
        for channel in self._channels:
            await channel.close(grace=None)


class OpenEnvDriver:
    """OpenEnv sessions: one WebSocket per session on ``/ws``, JSON messages."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        from websockets.asyncio.client import connect
        from websockets.protocol import State

        self._connect = connect
        self._open_state = State.OPEN
        self._url = f"ws://{cfg['target']}/ws"
        # OpenEnv's EnvClient connects with websockets' defaults (permessage-deflate
        # offered) and max_size 100 MiB; the tuned variant turns compression off.
        self._compression = "deflate" if cfg.get("compression", True) else None
        self._local_addr = cfg.get("local_addr")
        self._step_text = json.dumps({"type": "step", "data": {"message": cfg["message"]}})
        self._reset_text = json.dumps({"type": "reset", "data": {}})
        self._close_text = json.dumps({"type": "close"})

    async def _call(self, ws: Any, text: str) -> dict[str, Any]:
        await ws.send(text)
        response: dict[str, Any] = json.loads(await ws.recv())
        if response.get("type") == "error":
            raise RuntimeError(f"server error: {response.get('data')}")
        return response

    async def open(self, index: int) -> Any:
        kwargs: dict[str, Any] = {}
        if self._local_addr:
            kwargs["local_addr"] = (self._local_addr, 0)
        ws = await self._connect(
            self._url,
            compression=self._compression,
            max_size=100 * 1024 * 1024,
            open_timeout=None,
            **kwargs,
        )
        try:
            await self._call(ws, self._reset_text)
        except BaseException:
            await ws.close()
            raise
        return ws

    async def open_cold(self) -> Any:
        return await self.open(0)

    async def step(self, ws: Any) -> None:
        await self._call(ws, self._step_text)

    async def close(self, ws: Any) -> None:
        await ws.send(self._close_text)  # as EnvClient.disconnect does
        await ws.close()

    def alive(self, ws: Any) -> bool:
        return bool(ws.state is self._open_state)

    async def shutdown(self) -> None:
        return None


# -- scenarios ---------------------------------------------------------------------------


async def open_many(
    driver: Any, start: int, count: int, cfg: dict[str, Any]
) -> tuple[list[Any], list[str]]:
    """Open ``count`` sessions, at most ``open_concurrency`` at once, each within
    ``open_timeout`` s; after ``give_up_after`` failures the rest are not tried (a full or
    dead server would otherwise cost a timeout each)."""
    gate = asyncio.Semaphore(cfg.get("open_concurrency", 128))
    timeout = cfg.get("open_timeout", 20.0)
    give_up_after = cfg.get("give_up_after", 256)
    handles: list[Any] = []
    errors: list[str] = []

    async def one(i: int) -> None:
        async with gate:
            if len(errors) >= give_up_after:
                errors.append("not tried: too many failures before")
                return
            try:
                handles.append(await asyncio.wait_for(driver.open(i), timeout))
            except Exception as exc:
                errors.append(describe(exc))

    await asyncio.gather(*(one(start + i) for i in range(count)))
    return handles, errors


async def close_many(driver: Any, handles: list[Any]) -> None:
    gate = asyncio.Semaphore(256)

    async def one(h: Any) -> None:
        async with gate:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(driver.close(h), 10)

    await asyncio.gather(*(one(h) for h in handles))


async def steady(driver: Any, cfg: dict[str, Any]) -> None:
    handles, errors = await open_many(driver, 0, cfg["sessions"], cfg)
    emit("ready", opened=len(handles), errors=len(errors), error_sample=errors[:3])
    command = await read_line()
    t0 = float(command.split()[1])
    measure_from = t0 + cfg["warmup"]
    stop_at = measure_from + cfg["seconds"]
    latencies: list[float] = []
    step_errors: list[str] = []
    await asyncio.sleep(max(0.0, t0 - clock()))

    async def run(handle: Any) -> None:
        step = driver.step
        while True:
            a = clock()
            try:
                await step(handle)
            except Exception as exc:
                step_errors.append(describe(exc))
                return
            b = clock()
            if b >= stop_at:
                return
            if b >= measure_from:
                latencies.append(b - a)

    await asyncio.gather(*(run(h) for h in handles))
    emit(
        "result",
        latencies_us=[round(x * 1e6, 1) for x in latencies],
        errors=len(step_errors),
        error_sample=step_errors[:3],
    )
    await close_many(driver, handles)


async def open_latency(driver: Any, cfg: dict[str, Any]) -> None:
    cold = bool(cfg.get("cold"))
    latencies: list[float] = []
    errors: list[str] = []
    for i in range(cfg["count"]):
        a = clock()
        try:
            handle = await (driver.open_cold() if cold else driver.open(i))
        except Exception as exc:
            errors.append(describe(exc))
            continue
        latencies.append(clock() - a)
        try:
            await driver.close(handle)
        except Exception as exc:
            errors.append(describe(exc))
    emit(
        "result",
        latencies_us=[round(x * 1e6, 1) for x in latencies],
        errors=len(errors),
        error_sample=errors[:3],
    )


async def idle(driver: Any, cfg: dict[str, Any]) -> None:
    handles: list[Any] = []
    errors: list[str] = []
    emit("ready")
    while True:
        command = await read_line()
        if command == "exit":
            emit("bye")
            os._exit(0)  # leave the sessions to die with the process: the server is gone
        count = int(command.split()[1])
        new, errs = await open_many(driver, len(handles) + len(errors), count, cfg)
        handles.extend(new)
        errors.extend(errs)
        emit(
            "held",
            held=sum(1 for h in handles if driver.alive(h)),
            opened=len(handles),
            errors=len(errors),
            error_sample=errors[:3],
        )


async def admission(driver: Any, cfg: dict[str, Any]) -> None:
    emit("ready")
    command = await read_line()
    t0 = float(command.split()[1])
    await asyncio.sleep(max(0.0, t0 - clock()))
    budget = cfg["timeout"]

    async def lifecycle(i: int) -> None:
        handle = await driver.open(i)  # connect + reset
        await driver.step(handle)  # the env sleeps 1 s
        await driver.close(handle)

    async def one(i: int) -> tuple[bool, float, str]:
        a = clock()
        try:
            await asyncio.wait_for(lifecycle(i), budget)
        except Exception as exc:
            return False, clock() - a, describe(exc)
        return True, clock() - a, ""

    outcomes = await asyncio.gather(*(one(i) for i in range(cfg["sessions"])))
    errors: dict[str, int] = {}
    for ok, _, error in outcomes:
        if not ok:
            kind = error[:80]
            errors[kind] = errors.get(kind, 0) + 1
    emit(
        "result",
        ok=sum(1 for ok, _, _ in outcomes if ok),
        failed=sum(1 for ok, _, _ in outcomes if not ok),
        durations_s=[round(d, 4) for ok, d, _ in outcomes if ok],
        errors=errors,
        wall_s=clock() - t0,
    )


SCENARIOS = {"steady": steady, "open": open_latency, "idle": idle, "admission": admission}


async def main() -> None:
    cfg = json.loads(sys.stdin.readline())
    driver = GrpcDriver(cfg) if cfg["system"] == "grpc" else OpenEnvDriver(cfg)
    try:
        await SCENARIOS[cfg["scenario"]](driver, cfg)
    finally:
        await driver.shutdown()


if __name__ == "__main__":
    _soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (_hard, _hard))
    asyncio.run(main())
