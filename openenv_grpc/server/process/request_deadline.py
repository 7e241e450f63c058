"""A deadline on the arrival of each request of every call but the session streams
(``--request-arrival-timeout``; docs/settings.md says why): such methods, and the
reflection streams request by request, are served as request-streaming calls. An
outsider's read also reserves its room in the outsiders' budget first (outsiders.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from openenv_grpc.metadata import SERVICE_NAME
from openenv_grpc.server.process.outsiders import OUTSIDER_ARRIVAL_SECONDS, OutsiderBudget

__all__ = ["UnaryRequestDeadline", "request_streaming"]

_Req = TypeVar("_Req")
_Res = TypeVar("_Res")
if TYPE_CHECKING:  # generic only in the type stubs, not at run time
    _Handler = grpc.RpcMethodHandler[Any, Any]
#: Streams that bound their client's silence themselves (the idle timeout).
_SESSIONS = (f"/{SERVICE_NAME}/Session", f"/{SERVICE_NAME}/VectorSession")


class UnaryRequestDeadline(grpc.aio.ServerInterceptor):
    """Serves every method but the session streams with a deadline on each request's
    arrival, and outsiders' reads within their budget (None: every read is let in)."""

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
        if outsiders is not None and outsiders.is_outsider(handler_call_details):
            return _wrapped(handler, min(self._seconds, OUTSIDER_ARRIVAL_SECONDS), outsiders)
        return _wrapped(handler, self._seconds, None)


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


def _wrapped(handler: _Handler, seconds: float, outsiders: OutsiderBudget | None) -> _Handler:
    """``handler`` reading each request within ``seconds``, inside ``outsiders``' budget
    for an outsider's call."""
    # Exactly one is set. Any: the stubs type behaviours as sync callables; on grpc.aio
    # they are coroutines (or async generators).
    behaviour: Any = (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )

    async def next_request(context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if outsiders is None:
            return await _read(context, seconds, None)
        async with outsiders.reading(context) as pushed_out:
            return await _read(context, seconds, pushed_out)

    async def requests(context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        while (one := await next_request(context)) is not grpc.aio.EOF:
            yield one  # until the client half-closes

    async def request(context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if handler.request_streaming:
            return requests(context)
        one = await next_request(context)
        if one is grpc.aio.EOF:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request")
        return one

    async def answers(_: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        result = behaviour(await request(context), context)
        if hasattr(result, "__aiter__"):  # an async generator of answers
            async for response in result:
                yield response
        else:  # a coroutine that writes its answers with context.write
            await result

    async def answer(_: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return await behaviour(await request(context), context)

    return request_streaming(handler, answers if handler.response_streaming else answer)


def request_streaming(handler: _Handler, behaviour: Any) -> _Handler:
    """A handler for ``handler``'s method that runs ``behaviour``, taking the requests
    itself: grpc.aio reads a unary request whole before calling the handler, so a caller
    could make it buffer up to the request limit before a refusal or a deadline."""
    make = (
        grpc.stream_stream_rpc_method_handler
        if handler.response_streaming
        else grpc.stream_unary_rpc_method_handler
    )
    return make(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
