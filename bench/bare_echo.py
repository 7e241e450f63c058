"""The floor: a bare grpc.aio bidirectional echo server with no framework.

Same service path and message shapes as openenv-grpc's Session, so the same client
drives it; it answers every request with a canned step result for that request id.
`python -m bench.bare_echo PORT [--mode echo|sleep|cpu] [--cpu-loops N]`

Modes (for the side-by-side benchmark, `bench.run`): ``echo`` answers at once; ``sleep``
awaits 1 s before answering a step (the admission test's env); ``cpu`` burns
``--cpu-loops`` iterations of the same pure-Python loop the other servers run (~1 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource

import grpc

from openenv_grpc.v1 import session_pb2 as pb

_OBSERVATION_URL = "type.googleapis.com/openenv_grpc_envs.echo.v1.EchoObservation"

MODE = "echo"
CPU_LOOPS = 0


def burn(loops: int) -> int:
    """Pure-Python CPU work; the same loop as bench.envs and bench/openenv_server.py."""
    x = 0
    for i in range(loops):
        x += i * i % 7
    return x


async def session(request_iterator: object, context: grpc.aio.ServicerContext) -> None:  # type: ignore[type-arg]
    await context.send_initial_metadata((("openenv-env", "bare"),))
    while True:
        request = await context.read()
        if request is grpc.aio.EOF:
            return
        response = pb.SessionResponse(request_id=request.request_id)
        if request.HasField("close"):
            response.closed.SetInParent()
            await context.write(response)
            return
        result = response.result
        result.observation.type_url = _OBSERVATION_URL
        if request.HasField("step"):
            if MODE == "sleep":
                await asyncio.sleep(1.0)
            elif MODE == "cpu":
                burn(CPU_LOOPS)
            result.observation.value = request.step.action.value
        await context.write(response)


async def main(port: int) -> None:
    options: list[tuple[str, int]] = [("grpc.so_reuseport", 0)]
    # An experiment, off by default (the floor runs grpc's defaults): grpc-core cancels new
    # calls the application has not picked up yet once more than 1,000 wait (all above
    # 3,000); BARE_MAX_PENDING_REQUESTS=N raises both limits to N.
    pending = int(os.environ.get("BARE_MAX_PENDING_REQUESTS", "0"))
    if pending > 0:
        options += [
            ("grpc.server.max_pending_requests", pending),
            ("grpc.server.max_pending_requests_hard_limit", pending),
        ]
    server = grpc.aio.server(options=options)
    handler = grpc.method_handlers_generic_handler(
        "openenv_grpc.v1.EnvService",
        {
            "Session": grpc.stream_stream_rpc_method_handler(
                session,
                request_deserializer=pb.SessionRequest.FromString,
                response_serializer=pb.SessionResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((handler,))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"openenv-grpc: serving bare on 127.0.0.1:{bound}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("port", type=int, nargs="?", default=0)
    parser.add_argument("--mode", choices=["echo", "sleep", "cpu"], default="echo")
    parser.add_argument("--cpu-loops", type=int, default=0)
    args = parser.parse_args()
    MODE, CPU_LOOPS = args.mode, args.cpu_loops
    _soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (_hard, _hard))
    asyncio.run(main(args.port))
