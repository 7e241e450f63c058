"""A deadline for the requests of every call but Session and VectorSession streams.

grpc.aio reads a unary request whole before the handler runs, and nothing else bounds how
long that may take: a client that announces a large request and never sends its last
bytes holds up to ``--max-request-bytes`` for as long as it keeps the connection alive
(health calls are exempt from ``AUTH_TOKEN``, so anyone could). This interceptor serves
such methods as request-streaming calls that take their one request within
``--request-arrival-timeout`` seconds, or end with ``DEADLINE_EXCEEDED`` and let go of
what arrived. Session and VectorSession streams have the idle timeout instead.

Other request-streaming methods (server reflection, v1 and v1alpha) read each next
request the same way: a reflection client sends its requests back to back, so a stream
whose next request has not arrived within the deadline ends ``DEADLINE_EXCEEDED``. Before,
slow senders on reflection held +1,543 MiB for as long as their connections lived.

An outsider's read (a caller without a valid token: every health call) also reserves the
request limit from the outsiders' budget first, and gets at most
:data:`~openenv_grpc.server.process.outsiders.OUTSIDER_ARRIVAL_SECONDS` (outsiders.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import grpc

from openenv_grpc.metadata import SERVICE_NAME
from openenv_grpc.server.process.outsiders import OUTSIDER_ARRIVAL_SECONDS, OutsiderBudget

__all__ = ["UnaryRequestDeadline"]

_Req = TypeVar("_Req")
_Res = TypeVar("_Res")
if TYPE_CHECKING:  # generic only in the type stubs, not at run time
    _Handler = grpc.RpcMethodHandler[Any, Any]
#: Streams that bound their client's silence themselves (the idle timeout).
_SESSIONS = (f"/{SERVICE_NAME}/Session", f"/{SERVICE_NAME}/VectorSession")


class UnaryRequestDeadline(grpc.aio.ServerInterceptor):
    """Serves every method but the session streams with a deadline on each request's
    arrival, and outsiders' reads within their budget (None: no budget, every read is let
    in)."""

    def __init__(self, seconds: float, outsiders: OutsiderBudget | None = None) -> None:
        self._seconds = seconds
        self._outsiders = outsiders

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[_Req, _Res] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Req, _Res] | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method in _SESSIONS:
            return handler
        outsiders = self._outsiders
        if outsiders is None or not outsiders.is_outsider(handler_call_details):
            reader = _Reader(self._seconds, None)
        else:
            reader = _Reader(min(self._seconds, OUTSIDER_ARRIVAL_SECONDS), outsiders)
        return _paced(handler, reader) if handler.request_streaming else _bounded(handler, reader)


class _Reader(NamedTuple):
    """How a call's one request is read: within ``seconds``, inside ``outsiders``'
    budget if it is an outsider's."""

    seconds: float
    outsiders: OutsiderBudget | None


async def _one_request(context: grpc.aio.ServicerContext[Any, Any], reader: _Reader) -> Any:
    """The call's one request, or the call ended (DEADLINE_EXCEEDED / INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED: no room in the outsiders' budget, or pushed out of it)."""
    request = await _next_request(context, reader)
    if request is grpc.aio.EOF:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request")
    return request


async def _requests(
    context: grpc.aio.ServicerContext[Any, Any], reader: _Reader
) -> AsyncIterator[Any]:
    """The call's requests until the client half-closes, each read with ``reader`` (the
    call ends as :func:`_one_request` says if one is late or finds no room)."""
    while (request := await _next_request(context, reader)) is not grpc.aio.EOF:
        yield request


async def _next_request(context: grpc.aio.ServicerContext[Any, Any], reader: _Reader) -> Any:
    if reader.outsiders is None:
        return await _read(context, reader.seconds, None)
    async with reader.outsiders.reading(context) as pushed_out:
        return await _read(context, reader.seconds, pushed_out)


async def _read(
    context: grpc.aio.ServicerContext[Any, Any],
    seconds: float,
    pushed_out: asyncio.Future[None] | None,
) -> Any:
    read = asyncio.ensure_future(context.read())
    waits: set[asyncio.Future[Any]] = {read} if pushed_out is None else {read, pushed_out}
    try:
        done, _ = await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not read.done():  # timed out, pushed out, or the call itself was cancelled
            read.cancel()
    if read not in done:
        if pushed_out is not None and pushed_out.done():
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "the request was still arriving when a newer unauthenticated call needed "
                "its room; retry later",
            )
        await context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"the request did not arrive within {seconds:g} s",
        )
    return read.result()


def _bounded(handler: _Handler, reader: _Reader) -> _Handler:
    """``handler`` as a request-streaming handler that reads its request with ``reader``."""
    # Any: the stubs type the behaviours as sync callables; on grpc.aio they are coroutines
    # (or async generators).
    if handler.unary_unary is not None:
        unary: Any = handler.unary_unary

        async def answer(_: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            return await unary(await _one_request(context, reader), context)

        return grpc.stream_unary_rpc_method_handler(
            answer,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    streaming: Any = handler.unary_stream

    async def answers(_: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        result = streaming(await _one_request(context, reader), context)
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


def _paced(handler: _Handler, reader: _Reader) -> _Handler:
    """Request-streaming ``handler`` with its requests read one by one with ``reader``."""
    make = (
        grpc.stream_stream_rpc_method_handler
        if handler.response_streaming
        else grpc.stream_unary_rpc_method_handler
    )
    behaviour: Any = handler.stream_stream or handler.stream_unary

    async def answers(_: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        result = behaviour(_requests(context, reader), context)
        if hasattr(result, "__aiter__"):  # an async generator of answers
            async for response in result:
                yield response
        else:  # a coroutine that writes its answers with context.write
            await result

    async def answer(_: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return await behaviour(_requests(context, reader), context)

    return make(
        answers if handler.response_streaming else answer,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
