"""Server CPU per Session step in the request handler alone: no gRPC, no socket.

Steps one echo session through the handler the server builds for a Session stream
(``SessionView`` over the one driver) and reports ``time.process_time`` per step. To
compare with a commit from before the one driver (issue 20), run this file from a
worktree of that commit: it falls back to that commit's ``EpisodeDriver``::

    python -m bench.handler_step 20000
    cd ../old && PYTHONPATH=. python ../main/bench/handler_step.py 20000
"""

from __future__ import annotations

import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from openenv_grpc.codec import pack
from openenv_grpc.server.model.spec import EnvSpec
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc_envs.echo import EchoAction, EchoEnvironment


async def _handler(spec: EnvSpec, pool: ThreadPoolExecutor) -> tuple[str, Any]:
    try:
        from openenv_grpc.environment import AutoresetMode
        from openenv_grpc.server.local.calls import local_calls
        from openenv_grpc.server.model.phases import SESSION_WORDS
        from openenv_grpc.server.stream.session_view import SessionView
    except ImportError:  # a commit from before the one driver
        from openenv_grpc.server.episode import EpisodeDriver  # type: ignore[import-not-found]
        from openenv_grpc.server.local.runner import EnvRunner

        async def make() -> EnvRunner:
            return await EnvRunner.create(spec, pool)

        return "EpisodeDriver", EpisodeDriver(spec, await make(), make, None)
    calls = await local_calls(
        spec, 1, AutoresetMode.DISABLED, pool, words=SESSION_WORDS, native=False,
        placement=spec.placement,
    )  # fmt: skip
    return "SessionView", SessionView(spec, calls)


async def main(steps: int) -> None:
    spec = EnvSpec.from_factory(EchoEnvironment)
    with ThreadPoolExecutor(2) as pool:
        name, handler = await _handler(spec, pool)
        await handler.handle(
            pb.SessionRequest(request_id=1, reset=pb.ResetCommand()).SerializeToString()
        )
        step = pb.StepCommand(action=pack(EchoAction(message="hello")))
        raw = pb.SessionRequest(request_id=2, step=step).SerializeToString()
        for _ in range(2000):  # warm up
            await handler.handle(raw)
        started = time.process_time()
        for _ in range(steps):
            await handler.handle(raw)
        per_step = (time.process_time() - started) / steps * 1e6
        await handler.close()
    print(f"{name}: {per_step:.2f} us of CPU per step ({steps} steps)")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 20000))
