"""The EnvService servicer: wires the three RPCs to the session manager, the vector
streams and the spec."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import grpc

from openenv_grpc._version import __version__
from openenv_grpc.metadata import PROTOCOL, SERVICE_NAME
from openenv_grpc.server.session import SessionManager
from openenv_grpc.server.vector_session import AUTORESET_MODES, VectorSessions
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc

__all__ = ["PROTOCOL", "SERVICE_NAME", "EnvServicer", "add_env_service"]


class EnvServicer(pb_grpc.EnvServiceServicer):
    """Session streams go to the session manager, VectorSession streams to the vector
    streams (which hand them to the same manager); Info is answered from the spec."""

    def __init__(self, sessions: SessionManager, vectors: VectorSessions) -> None:
        self._sessions = sessions
        self._vectors = vectors
        spec = sessions.spec
        # Everything but the capacity is fixed: build it once, copy it per call.
        self._info = pb.InfoResponse(
            env_name=spec.name,
            env_version=spec.version,
            env_description=spec.description,
            action_type=spec.types.action.DESCRIPTOR.full_name,
            observation_type=spec.types.observation.DESCRIPTOR.full_name,
            state_type=spec.types.state.DESCRIPTOR.full_name,
            reset_options_type=spec.types.reset_options.DESCRIPTOR.full_name,
            descriptors=spec.descriptors,
            server_version=__version__,
            protocol=PROTOCOL,
            server_pid=os.getpid(),
            vector=pb.VectorSupport(
                supported=True,
                native_batch=vectors.native,
                max_envs_per_stream=vectors.max_envs,
                autoreset_modes=AUTORESET_MODES,
                snapshots=True,
            ),
        )
        snapshots = self._info.snapshots
        snapshots.supported = spec.snapshots
        seal = sessions.snapshots
        if seal is not None:
            snapshots.max_bytes = seal.limit
            snapshots.signing_key_id = seal.keys.signing.id
            snapshots.ephemeral_key = seal.keys.ephemeral
        self._workers = sessions.config.workers

    async def Session(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[bytes],
        context: grpc.aio.ServicerContext[bytes, bytes],
    ) -> None:
        # The manager reads with context.read(): cheaper than the async iterator.
        await self._sessions.serve(context)

    async def VectorSession(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[bytes],
        context: grpc.aio.ServicerContext[bytes, bytes],
    ) -> None:
        await self._vectors.serve(context)

    async def Info(
        self,
        request: pb.InfoRequest,
        context: grpc.aio.ServicerContext[pb.InfoRequest, pb.InfoResponse],
    ) -> pb.InfoResponse:
        response = pb.InfoResponse()
        response.CopyFrom(self._info)
        limiter = self._sessions.limiter
        response.capacity.max_sessions = limiter.capacity
        response.capacity.active_sessions = limiter.active
        response.capacity.draining = limiter.draining
        response.capacity.workers = self._workers
        self._sessions.activity.fill(response.activity, limiter)
        return response


def add_env_service(servicer: EnvServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` like the generated ``add_EnvServiceServicer_to_server``, except
    that Session and VectorSession requests and responses are bytes: the stream's backend
    parses them, so a request that does not decode ends the stream with INVALID_ARGUMENT
    (gRPC would say UNKNOWN), and an isolated worker's answer passes through unparsed.
    """
    handlers = {
        # Bytes both ways: the session's backend parses and serializes (it may be a
        # worker process that hands back response bytes as they are).
        "Session": grpc.stream_stream_rpc_method_handler(servicer.Session),
        "VectorSession": grpc.stream_stream_rpc_method_handler(servicer.VectorSession),
        "Info": grpc.unary_unary_rpc_method_handler(
            servicer.Info,
            request_deserializer=pb.InfoRequest.FromString,
            response_serializer=pb.InfoResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
