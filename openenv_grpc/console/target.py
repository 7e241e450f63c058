"""The env server the console talks to, as an ordinary gRPC client.

One asyncio channel serves every browser session and the live figures. The server's Info
RPC gives the types (as descriptors, so the console needs no generated code) and the
capacity and activity shown live.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import any_pb2, json_format
from google.protobuf.message import Message

from openenv_grpc.client.channel import aio_channel, auth_metadata
from openenv_grpc.client.info import info_pool, message_classes
from openenv_grpc.codec import PayloadError, pack, unpack
from openenv_grpc.console import tensors
from openenv_grpc.console.schema import schemas
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc

__all__ = ["EnvTarget", "InputError"]


class InputError(ValueError):
    """What the page sent cannot become the message it should be (caught in the console,
    never sent to the server)."""


class EnvTarget:
    """A channel to ``address`` (TLS with ``credentials``; ``token`` as bearer token)."""

    def __init__(
        self,
        address: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        call_timeout: float | None = 60.0,
    ) -> None:
        self.address = address
        self.tls = credentials is not None
        self.token = token
        #: Longest the console waits for one answer; the session stays open after it.
        self.call_timeout = call_timeout
        self.channel = aio_channel(address, credentials)
        self.stub: pb_grpc.EnvServiceAsyncStub = pb_grpc.EnvServiceStub(self.channel)
        self._metadata: Sequence[tuple[str, str]] = auth_metadata(token)
        self.info = pb.InfoResponse()
        self._classes: dict[str, type[Message]] = {}
        self._pool: Any = None

    async def load(self, timeout: float = 10.0) -> None:
        """Read the server's Info (waiting up to ``timeout`` for it to come up).

        Raises:
            grpc.aio.AioRpcError: the server did not answer or refused the call.
        """
        self.info = await self.fetch_info(timeout, wait_for_ready=True)
        self._pool = info_pool(self.info)
        self._classes = message_classes(self.info, self._pool)

    async def fetch_info(self, timeout: float = 5.0, *, wait_for_ready: bool = False) -> Any:
        """A fresh InfoResponse (capacity and activity change; the rest does not)."""
        return await self.stub.Info(
            pb.InfoRequest(),
            timeout=timeout,
            metadata=self._metadata,
            wait_for_ready=wait_for_ready,
        )

    async def close(self) -> None:
        await self.channel.close()

    def describe(self) -> dict[str, Any]:
        """What the page shows about the env and builds its forms from."""
        info = self.info
        roots = [
            self._classes[role].DESCRIPTOR
            for role in ("action", "reset_options")
            if role in self._classes
        ]
        return {
            "target": self.address,
            "tls": self.tls,
            "token": self.token is not None,
            "env": {
                "name": info.env_name,
                "version": info.env_version,
                "description": info.env_description,
            },
            "types": {
                "action": info.action_type,
                "observation": info.observation_type,
                "state": info.state_type,
                "reset_options": info.reset_options_type,
            },
            "server": {
                "version": info.server_version,
                "protocol": info.protocol,
                "pid": info.server_pid,
            },
            "capacity": capacity_view(info),
            "schemas": schemas(*roots),
            "dtypes": list(tensors.DTYPES),
        }

    def pack(self, role: str, data: object) -> any_pb2.Any:
        """The page's JSON for ``role`` ("action" or "reset_options") as a packed Any.

        Raises:
            InputError: ``data`` is not a JSON object that parses as the role's type.
        """
        message_class = self._classes[role]
        name = message_class.DESCRIPTOR.full_name
        if not isinstance(data, dict):
            raise InputError(f"{role.replace('_', ' ')} must be a JSON object for {name}")
        try:
            expanded: dict[str, Any] = tensors.expand(data)
        except tensors.TensorInputError as exc:
            raise InputError(f"not a valid {name}: {exc}") from None
        try:
            message = json_format.ParseDict(expanded, message_class(), descriptor_pool=self._pool)
        except json_format.ParseError as exc:
            raise InputError(f"not a valid {name}: {exc}") from None
        return pack(message)

    def decode(self, role: str, payload: Message) -> Message:
        """A result's payload as a message of the role's type.

        An untyped session hands back a raw Any when the type is not compiled into this
        process (the usual case here); a compiled one arrives decoded already.

        Raises:
            InputError: the server sent a different type than its Info declared, or bytes
                that do not parse as it.
        """
        if not isinstance(payload, any_pb2.Any):
            return payload
        try:
            return unpack(payload, self._classes[role], f"the server's {role}")
        except PayloadError as exc:
            raise InputError(str(exc)) from None


def capacity_view(info: pb.InfoResponse) -> dict[str, Any]:
    """Capacity and activity of the process that answered ``info``."""
    capacity, activity = info.capacity, info.activity
    return {
        "max_sessions": capacity.max_sessions,
        "active_sessions": capacity.active_sessions,
        "draining": capacity.draining,
        "workers": capacity.workers,
        "steps": activity.steps,
        "sessions_opened": activity.sessions_opened,
        "sessions_refused": activity.sessions_refused,
        "uptime_seconds": activity.uptime_seconds,
        "pid": info.server_pid,
    }
