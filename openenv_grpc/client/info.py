"""Reading a server's Info RPC, and decoding its types without the .proto files."""

from __future__ import annotations

import time
from typing import Any

import grpc
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import Message

from openenv_grpc.client.channel import auth_metadata, sync_channel
from openenv_grpc.client.errors import InfoUnavailable
from openenv_grpc.client.protocol import nothing_listening
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc

__all__ = ["fetch_info", "info_pool", "message_classes"]

#: Seconds the first Info try waits before the call waits for a connection.
_PROBE = 1.0


def fetch_info(
    target: str | grpc.Channel,
    timeout: float = 10.0,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    token: str | None = None,
) -> pb.InfoResponse:
    """Call Info on ``target`` ("host:port", over TLS with ``credentials``, or a blocking
    channel), with ``token`` as bearer token if the server wants one.

    A target where nothing listens fails at once ("nothing is listening on HOST:PORT"),
    not after ``timeout``: a first try does not wait for the connection; only a server
    that accepts the connection but is slow to answer gets the whole ``timeout``.

    Raises:
        InfoUnavailable: the server could not be reached in ``timeout`` seconds, or refused
            the call (``code`` and ``message`` say which).
    """
    channel = sync_channel(target, credentials) if isinstance(target, str) else target
    stub: Any = pb_grpc.EnvServiceStub(channel)
    metadata = auth_metadata(token)
    deadline = time.monotonic() + timeout
    try:
        try:  # fails fast where the connection is refused
            return stub.Info(  # type: ignore[no-any-return]
                pb.InfoRequest(), timeout=min(timeout, _PROBE), metadata=metadata
            )
        except grpc.RpcError as exc:
            refused = nothing_listening(exc.code(), exc.details())
            if refused is not None:
                raise InfoUnavailable(exc.code(), refused) from None
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
        return stub.Info(  # type: ignore[no-any-return]
            pb.InfoRequest(),
            timeout=max(0.0, deadline - time.monotonic()),
            wait_for_ready=True,
            metadata=metadata,
        )
    except grpc.RpcError as exc:
        raise InfoUnavailable(exc.code(), exc.details() or "") from None
    finally:
        if isinstance(target, str):
            channel.close()


def info_pool(info: pb.InfoResponse) -> descriptor_pool.DescriptorPool:
    """A private descriptor pool holding the info's FileDescriptorSet: it works in a
    process that never imported the environment's generated code (and never clashes with
    one that did)."""
    pool = descriptor_pool.DescriptorPool()
    for file in info.descriptors.file:
        pool.Add(file)
    return pool


def message_classes(
    info: pb.InfoResponse, pool: descriptor_pool.DescriptorPool | None = None
) -> dict[str, type[Message]]:
    """Message classes for the info's four types, built from its FileDescriptorSet alone
    (in ``pool``, by default a new :func:`info_pool`), keyed action, observation, state
    and reset_options."""
    if pool is None:
        pool = info_pool(info)
    names = {
        "action": info.action_type,
        "observation": info.observation_type,
        "state": info.state_type,
        "reset_options": info.reset_options_type,
    }
    return {
        role: message_factory.GetMessageClass(pool.FindMessageTypeByName(name))
        for role, name in names.items()
        if name
    }
