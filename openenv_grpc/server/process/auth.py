"""Bearer-token authentication: a server interceptor that refuses calls without the token
(UNAUTHENTICATED) before any env or slot exists. Health checks are exempt.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from openenv_grpc.server.process.request_deadline import request_streaming

__all__ = ["AUTHORIZATION_KEY", "TokenAuthInterceptor"]

AUTHORIZATION_KEY = "authorization"
_Req = TypeVar("_Req")
_Res = TypeVar("_Res")
#: Health checks are exempt, so load balancers and probes keep working.
_EXEMPT_PREFIX = "/grpc.health.v1.Health/"


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through only if its metadata has ``authorization: Bearer <token>``."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("an empty auth token would let everyone in")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[_Req, _Res] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Req, _Res] | None:
        handler = await continuation(handler_call_details)
        if (
            handler is None
            or handler_call_details.method.startswith(_EXEMPT_PREFIX)
            or self.allows(handler_call_details.invocation_metadata)
        ):
            return handler
        return request_streaming(handler, _deny)  # refused without reading a byte

    def allows(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        """Whether ``metadata`` carries the token (an insider's call)."""
        for key, value in metadata or ():
            if key == AUTHORIZATION_KEY:
                presented = value.encode() if isinstance(value, str) else value
                # Constant time: the comparison does not reveal how much of a guess matched.
                return hmac.compare_digest(presented, self._expected)
        return False


async def _deny(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
