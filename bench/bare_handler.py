"""The whole openenv-grpc server with bare grpc.aio's Session handler in place of the
session core: what the server's setup costs per step (its interceptors, options, threads,
task factory), apart from what the core's handler costs.

    python -m bench.echo_load --env bench.bare_handler:EchoEnvironment --sessions 64

Importing this module (``serve`` does, to load the env) replaces
``EnvServicer.Session`` with ``bench.bare_echo``'s echo on bytes; the env is never made.
A measurement tool only: nothing of the server's own is bounded or counted on it.
"""

from __future__ import annotations

from typing import Any

import grpc

from openenv_grpc.metadata import ADMITTED_KEY
from openenv_grpc.server import service
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc_envs.echo import EchoEnvironment

__all__ = ["EchoEnvironment"]

_OBSERVATION_URL = "type.googleapis.com/openenv_grpc_envs.echo.v1.EchoObservation"


async def _bare_session(self: Any, request_iterator: Any, context: Any) -> None:
    await context.send_initial_metadata(((ADMITTED_KEY, "bare"),))
    while True:
        raw = await context.read()
        if raw is grpc.aio.EOF:
            return
        request = pb.SessionRequest.FromString(raw)
        response = pb.SessionResponse(request_id=request.request_id)
        if request.HasField("close"):
            response.closed.SetInParent()
            await context.write(response.SerializeToString())
            return
        result = response.result
        result.observation.type_url = _OBSERVATION_URL
        if request.HasField("step"):
            result.observation.value = request.step.action.value
        await context.write(response.SerializeToString())


service.EnvServicer.Session = _bare_session  # type: ignore[method-assign]
