"""The metrics endpoint's eviction rule, in-process over real loopback sockets.

The endpoint closes a connection that has sent no whole request head EVICT_AFTER seconds
after it was taken, when others wait behind it. A scrape whose bytes have arrived but
that the event loop has not read yet (the loop was busy or the process descheduled) is
not such a connection: closing it cost a scrape under load.
"""

from __future__ import annotations

import asyncio
import socket

from prometheus_client import CollectorRegistry, Counter

from openenv_grpc.server.process.metrics_endpoint import EVICT_AFTER, MetricsEndpoint

_SCRAPE = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


async def _until(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def _evict_while_the_loop_lags(send_first: bool) -> bytes:
    """One slot: connection A is served, B waits in the listen queue. A sends (or not)
    while the loop does not run; then, EVICT_AFTER later by the loop's clock, the loop
    checks for slow connections before it reads A's bytes. Returns what A got."""
    registry = CollectorRegistry()
    Counter("scrapes_seen", "a metric to expose", registry=registry).inc()
    endpoint = MetricsEndpoint(registry, max_connections=1)
    port = await endpoint.start("127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    first = socket.create_connection(("127.0.0.1", port), timeout=10)
    second = socket.create_connection(("127.0.0.1", port), timeout=10)  # in the backlog
    try:
        await _until(lambda: endpoint.connections == 1, "the first connection is taken")
        assert endpoint._sock is not None
        # No await from here on: the loop cannot read what A sends.
        if send_first:
            first.sendall(_SCRAPE)  # on loopback, in A's receive buffer on return
        endpoint._evict_slow_if_others_wait(endpoint._sock, loop.time() + EVICT_AFTER)
        first.settimeout(10)
        answer = await loop.run_in_executor(None, _read_all, first)
        first.close()  # frees the one slot
        second.sendall(_SCRAPE)
        second_answer = await loop.run_in_executor(None, _read_all, second)
        assert second_answer.startswith(b"HTTP/1.1 200 "), "the waiting scrape is answered"
        return answer
    finally:
        first.close()
        second.close()
        await endpoint.close()


def test_a_scrape_whose_bytes_the_loop_has_not_read_is_not_evicted() -> None:
    answer = asyncio.run(_evict_while_the_loop_lags(send_first=True))
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert b"scrapes_seen_total 1.0" in answer


def test_a_connection_that_sent_nothing_is_evicted_for_the_one_waiting() -> None:
    assert asyncio.run(_evict_while_the_loop_lags(send_first=False)) == b""
