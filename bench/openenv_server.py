"""The peer: an OpenEnv (openenv-core) echo server, written the way its docs show.

Runs in the benchmark's own virtualenv (``build/bench-openenv-venv``, made by
``bench.systems``), never in the project's: it imports only openenv-core, pydantic and
uvicorn. One uvicorn worker on 127.0.0.1, app from ``create_app`` (the documented entry
point), one environment instance per ``/ws`` WebSocket session.

    python bench/openenv_server.py --variant default|tuned --env echo|sleep|cpu [--port 0]

Variants:

* ``default``: the environment as users write it (sync ``reset``/``step``, which OpenEnv
  runs on a per-session single-thread executor) and uvicorn's defaults (WebSocket
  per-message-deflate on).
* ``tuned``: ``reset_async``/``step_async`` overridden (run on the event loop, no thread
  hop), ``REQUIRES_SINGLE_THREAD_EXECUTOR`` so sessions share one executor thread for env
  construction and close instead of one thread each, and per-message-deflate off.

Environments: ``echo`` (the template's echo env: observation = the message, reward 0.1 per
character), ``sleep`` (step waits 1 s: ``time.sleep`` in the default variant,
``asyncio.sleep`` in the tuned one), ``cpu`` (step burns ``--cpu-loops`` iterations of a
pure-Python loop, ~1 ms).

Prints ``openenv: serving VARIANT/ENV on 127.0.0.1:PORT`` once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import socket
import time
from typing import Any
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class EchoAction(Action):
    """A message to echo."""

    message: str = Field(..., description="Message to echo back")


class EchoObservation(Observation):
    """The echoed message and its length."""

    echoed_message: str = Field(default="", description="The echoed message")
    message_length: int = Field(default=0, description="Length of the echoed message")


CPU_LOOPS = 0  # set from --cpu-loops before the app is built


def burn(loops: int) -> int:
    """Pure-Python CPU work; the same loop the openenv-grpc and bare servers run."""
    x = 0
    for i in range(loops):
        x += i * i % 7
    return x


class EchoEnvironment(Environment):
    """Echo, as OpenEnv's template writes it: sync methods, state as a pydantic model."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> EchoObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return EchoObservation(echoed_message="ready", message_length=5, done=False, reward=0.0)

    def _echo(self, action: EchoAction) -> EchoObservation:
        self._state.step_count += 1
        message = action.message
        return EchoObservation(
            echoed_message=message,
            message_length=len(message),
            done=False,
            reward=0.1 * len(message),
        )

    def step(
        self, action: EchoAction, timeout_s: float | None = None, **kwargs: Any
    ) -> EchoObservation:
        return self._echo(action)

    @property
    def state(self) -> State:
        return self._state


class SleepEnvironment(EchoEnvironment):
    """Each step takes 1 s of wall time, blocking (how a sync env waits)."""

    def step(
        self, action: EchoAction, timeout_s: float | None = None, **kwargs: Any
    ) -> EchoObservation:
        time.sleep(1.0)
        return self._echo(action)


class CpuEnvironment(EchoEnvironment):
    """Each step burns ~1 ms of CPU in pure Python."""

    def step(
        self, action: EchoAction, timeout_s: float | None = None, **kwargs: Any
    ) -> EchoObservation:
        burn(CPU_LOOPS)
        return self._echo(action)


class TunedEchoEnvironment(EchoEnvironment):
    """Echo with async methods: OpenEnv awaits them on the event loop, no thread hop."""

    REQUIRES_SINGLE_THREAD_EXECUTOR = True

    async def reset_async(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> EchoObservation:
        return self.reset(seed=seed, episode_id=episode_id)

    async def step_async(
        self, action: EchoAction, timeout_s: float | None = None, **kwargs: Any
    ) -> EchoObservation:
        return self._echo(action)


class TunedSleepEnvironment(TunedEchoEnvironment):
    """Each step awaits 1 s (how an async env waits)."""

    async def step_async(
        self, action: EchoAction, timeout_s: float | None = None, **kwargs: Any
    ) -> EchoObservation:
        await asyncio.sleep(1.0)
        return self._echo(action)


class TunedCpuEnvironment(TunedEchoEnvironment):
    """Each step burns ~1 ms of CPU on the event loop (async, but CPU-bound)."""

    async def step_async(
        self, action: EchoAction, timeout_s: float | None = None, **kwargs: Any
    ) -> EchoObservation:
        burn(CPU_LOOPS)
        return self._echo(action)


ENVIRONMENTS = {
    ("default", "echo"): EchoEnvironment,
    ("default", "sleep"): SleepEnvironment,
    ("default", "cpu"): CpuEnvironment,
    ("tuned", "echo"): TunedEchoEnvironment,
    ("tuned", "sleep"): TunedSleepEnvironment,
    ("tuned", "cpu"): TunedCpuEnvironment,
}


def main() -> None:
    global CPU_LOOPS
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variant", choices=["default", "tuned"], default="default")
    parser.add_argument("--env", choices=["echo", "sleep", "cpu"], default="echo")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--max-concurrent-envs", type=int, default=100_000)
    parser.add_argument("--cpu-loops", type=int, default=0)
    args = parser.parse_args()
    CPU_LOOPS = args.cpu_loops
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    import uvicorn  # after the fd limit: uvicorn's import does nothing with it, but be safe

    env_cls = ENVIRONMENTS[(args.variant, args.env)]
    app = create_app(
        env_cls, EchoAction, EchoObservation, max_concurrent_envs=args.max_concurrent_envs
    )
    # Bind first so a free port (0) can be printed before serving; uvicorn serves on it.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    config = uvicorn.Config(
        app,
        log_level="warning",
        workers=1,
        ws_per_message_deflate=args.variant == "default",
    )
    server = uvicorn.Server(config)
    sock.listen(config.backlog)  # connections queue until uvicorn accepts them
    host, port = sock.getsockname()[:2]
    print(f"openenv: serving {args.variant}/{args.env} on {host}:{port}", flush=True)
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
