"""A deadline for the request of every unary-request call (Info, health Check and Watch).

grpc.aio reads a unary request whole before the handler runs, and nothing else bounds how
long that may take: a client that announces a large request and never sends its last
bytes holds up to ``--max-request-bytes`` for as long as it keeps the connection alive
(health calls are exempt from ``AUTH_TOKEN``, so anyone could). This interceptor serves
such methods as request-streaming calls that take their one request within
``--request-arrival-timeout`` seconds, or end with ``DEADLINE_EXCEEDED`` and let go of
what arrived. Session and VectorSession streams have the idle timeout instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

__all__ = ["UnaryRequestDeadline"]

_Req = TypeVar("_Req")
_Res = TypeVar("_Res")
if TYPE_CHECKING:  # generic only in the type stubs, not at run time
    _Handler = grpc.RpcMethodHandler[Any, Any]


class UnaryRequestDeadline(grpc.aio.ServerInterceptor):
    """Serves every unary-request method with a deadline on its request's arrival."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[_Req, _Res] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Req, _Res] | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        return _bounded(handler, self._seconds)


async def _one_request(context: grpc.aio.ServicerContext[Any, Any], seconds: float) -> Any:
    """The call's one request, or the call ended (DEADLINE_EXCEEDED / INVALID_ARGUMENT)."""
    try:
        request = await asyncio.wait_for(context.read(), seconds)
    except asyncio.TimeoutError:
        await context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"the request did not arrive within {seconds:g} s",
        )
    if request is grpc.aio.EOF:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request")
    return request


def _bounded(handler: _Handler, seconds: float) -> _Handler:
    """``handler`` as a request-streaming handler that waits ``seconds`` for its request."""
    # Any: the stubs type the behaviours as sync callables; on grpc.aio they are coroutines
    # (or async generators).
    if handler.unary_unary is not None:
        unary: Any = handler.unary_unary

        async def answer(_: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            return await unary(await _one_request(context, seconds), context)

        return grpc.stream_unary_rpc_method_handler(
            answer,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    streaming: Any = handler.unary_stream

    async def answers(_: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        result = streaming(await _one_request(context, seconds), context)
        if hasattr(result, "__aiter__"):  # an async generator of answers
            async for response in result:
                yield response
        else:  # a coroutine that writes its answers with context.write
            await result

    return grpc.stream_stream_rpc_method_handler(
        answers,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
