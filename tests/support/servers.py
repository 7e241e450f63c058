"""Start a module's servers together: each start is mostly a child's imports, so several
overlap instead of queueing (a dozen roles took ~10 s one after another)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from openenv_grpc.testing import ServerProcess

S = TypeVar("S", bound=ServerProcess)


@contextlib.contextmanager
def started_together(makers: Mapping[str, Callable[[], S]]) -> Iterator[dict[str, S]]:
    """Run every maker at once; yield the servers by role; stop them all at the end.
    If one fails to start, the others that did are stopped and its error is raised."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {role: pool.submit(make) for role, make in makers.items()}
    made = {role: f.result() for role, f in futures.items() if f.exception() is None}
    try:
        for future in futures.values():
            future.result()  # the first failure, once every start has settled
        yield made
    finally:
        for server in made.values():
            server.stop()
