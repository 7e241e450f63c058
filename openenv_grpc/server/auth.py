"""Bearer-token authentication: a server interceptor that refuses calls without the token.

Health checks are exempt so that load balancers and probes keep working. A refused
Session never reaches the limiter, so no env is created and no slot is taken.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

__all__ = ["AUTHORIZATION_KEY", "TokenAuthInterceptor"]

AUTHORIZATION_KEY = "authorization"
_Req = TypeVar("_Req")
_Res = TypeVar("_Res")
if TYPE_CHECKING:  # generic only in the type stubs, not at run time
    _Handler = grpc.RpcMethodHandler[Any, Any]
_EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through only if its metadata has ``authorization: Bearer <token>``."""

    def __init__(self, token: str, exempt_prefixes: Sequence[str] = _EXEMPT_PREFIXES) -> None:
        if not token:
            raise ValueError("an empty auth token would let everyone in")
        self._expected = f"Bearer {token}".encode()
        self._exempt = tuple(exempt_prefixes)

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
            or handler_call_details.method.startswith(self._exempt)
            or self._allowed(handler_call_details.invocation_metadata)
        ):
            return handler
        return _refusing(handler)

    def _allowed(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        for key, value in metadata or ():
            if key == AUTHORIZATION_KEY:
                presented = value.encode() if isinstance(value, str) else value
                # Constant time: the comparison does not reveal how much of a guess matched.
                return hmac.compare_digest(presented, self._expected)
        return False


async def _deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")


def _refusing(handler: _Handler) -> _Handler:
    """A handler of the same streaming kind as ``handler`` that refuses every call.

    The kind must match: a unary handler on a streaming method would wait for a request
    that a client waiting for headers never sends.
    """
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        _deny,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
