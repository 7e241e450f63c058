"""A burst of Session opens at once over raw grpc.aio channels: no client library, no
retry, so the outcomes are exactly what the server answered (and what grpc.aio made of
it)."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc

from openenv_grpc.metadata import ADMITTED_KEY, RETRY_PUSHBACK_KEY
from openenv_grpc.v1 import session_pb2 as pb

SESSION = "/openenv_grpc.v1.EnvService/Session"


def _reset() -> bytes:
    request = pb.SessionRequest(request_id=1)
    request.reset.SetInParent()
    return request.SerializeToString()


async def _burst(target: str, count: int, channels: int, write_first: bool) -> Counter[str]:
    options = [("grpc.use_local_subchannel_pool", 1)]  # one connection per channel
    pool = [grpc.aio.insecure_channel(target, options=options) for _ in range(channels)]
    for channel in pool:
        await channel.channel_ready()
    held: list[grpc.aio.StreamStreamCall] = []
    answered = 0
    everyone_answered = asyncio.Event()
    reset = _reset()

    def one_answered() -> None:
        nonlocal answered
        answered += 1
        if answered == count:
            everyone_answered.set()

    async def one(index: int) -> str:
        call = pool[index % channels].stream_stream(SESSION)()
        try:
            if write_first:
                await call.write(reset)
            headers = await call.initial_metadata()
            if any(key == ADMITTED_KEY for key, _ in headers or ()):
                held.append(call)
                one_answered()
                await everyone_answered.wait()  # hold the session until all are answered
                await call.done_writing()
                return "admitted"
            code, details = await call.code(), await call.details()
            trailers = await call.trailing_metadata()
        except grpc.aio.AioRpcError as exc:
            code, details, trailers = exc.code(), exc.details() or "", exc.trailing_metadata()
        one_answered()
        pushback = dict(trailers or ()).get(RETRY_PUSHBACK_KEY)
        return f"{code.name} pushback={pushback}: {details}"

    try:
        return Counter(await asyncio.gather(*(one(i) for i in range(count))))
    finally:
        for call in held:
            call.cancel()
        for channel in pool:
            await channel.close()


def burst(target: str, count: int, channels: int = 1, write_first: bool = False) -> Counter[str]:
    """Open ``count`` Session streams at once over ``channels`` connections, each sending a
    reset before its headers came (``write_first``) or waiting for them; hold the admitted
    ones until every open has its answer. Returns the outcomes: ``"admitted"`` or
    ``"CODE pushback=MS: details"``."""
    return asyncio.run(_burst(target, count, channels, write_first))
