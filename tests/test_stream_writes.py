"""The stream loop's writes when the call is over: grpc-core fails a write only once
the client has gone, and the loop then ends the stream as a client's end (``eof``),
quietly -- for an answer's write and for a drain notice deferred behind it alike."""

from __future__ import annotations

import asyncio

from openenv_grpc.server.stream.session import Held, _StreamLoop


class _GoneAfterFirstWrite:
    """A call whose first write (the answer) succeeds while a drain notice arrives,
    and whose next write (that notice) fails: the client went meanwhile."""

    def __init__(self) -> None:
        self.held: Held | None = None
        self.written: list[bytes] = []

    async def write(self, message: bytes) -> None:
        if self.written:
            raise RuntimeError("the call is over")  # what grpc.aio raises, in kind
        assert self.held is not None
        self.held.notify(b"notice", set())  # arrives during the answer's write: deferred
        self.written.append(message)


def test_a_deferred_notice_whose_write_fails_ends_the_stream_as_the_clients_end() -> None:
    async def main() -> tuple[object, list[bytes], bool]:
        context = _GoneAfterFirstWrite()
        held = Held(asyncio.current_task(), context, 1)  # type: ignore[arg-type]
        held.ready = True
        context.held = held
        loop = _StreamLoop.__new__(_StreamLoop)  # only what a write reads
        loop.live, loop._context = held, context  # type: ignore[assignment]
        loop._loop = asyncio.get_running_loop()
        loop._ended = loop._loop.create_future()
        await loop._write_now(b"answer")  # does not raise
        assert held.deferred is None  # the notice was taken to be written
        return loop._ended.result(), context.written, held.writing

    ended, written, writing = asyncio.run(main())
    assert ended == ("eof",)
    assert written == [b"answer"]
    assert writing is False
