"""The floor: a bare grpc.aio bidirectional echo server with no framework.

Same service path and message shapes as openenv-grpc's Session, so the same client
drives it; it answers every request with a canned step result for that request id.
`python -m bench.bare_echo PORT`
"""

from __future__ import annotations

import asyncio
import sys

import grpc

from openenv_grpc.v1 import session_pb2 as pb


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
        if request.HasField("step"):
            result.observation.type_url = (
                "type.googleapis.com/openenv_grpc_envs.echo.v1.EchoObservation"
            )
            result.observation.value = request.step.action.value
        else:
            result.observation.type_url = (
                "type.googleapis.com/openenv_grpc_envs.echo.v1.EchoObservation"
            )
        await context.write(response)


async def main(port: int) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
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
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
