"""The VectorSession stream: N environment instances bound to one stream.

Opening reads N (``openenv-num-envs``) and the autoreset mode (``openenv-autoreset``)
from the call's metadata, so a bad value is refused (INVALID_ARGUMENT) and N slots are
admitted all or nothing before any message is read or any env exists. From there the
stream is N sessions to the session manager (``session.py``): the same admission, idle
timeout, drain notice and ending, all N envs closed and all N slots freed once on every
ending. This module decides what backs the N envs: one batch in this process (the env's
native batch, or a loop over plain instances; ``vector_batch.py``), or, with
``--isolated``, sub-batches spread over the env processes (``vector_spread.py``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import grpc

from openenv_grpc.environment import AutoresetMode
from openenv_grpc.metadata import AUTORESET_KEY, AUTORESET_VALUES, BATCH_KEY, NUM_ENVS_KEY
from openenv_grpc.server.backend import SessionBackend
from openenv_grpc.server.calls import BatchCalls
from openenv_grpc.server.driver import Driver
from openenv_grpc.server.env_process_pool import EnvProcessPool
from openenv_grpc.server.phases import VECTOR_WORDS
from openenv_grpc.server.placement import CallPlacement, batch_threshold
from openenv_grpc.server.session import Held, SessionManager
from openenv_grpc.server.vector_batch import natively_batched
from openenv_grpc.server.vector_spread import SpreadBatchCalls
from openenv_grpc.server.vector_view import VectorView
from openenv_grpc.v1 import session_pb2 as pb

__all__ = ["VectorSessions", "read_open"]

_Context = grpc.aio.ServicerContext[bytes, bytes]

_MODES = {
    "next_step": AutoresetMode.NEXT_STEP,
    "same_step": AutoresetMode.SAME_STEP,
    "disabled": AutoresetMode.DISABLED,
}

#: Vector sizes whose batch calls are measured apart (a measured env; more go to the pool).
_MAX_PLACEMENTS = 64

#: The modes as Info lists them.
AUTORESET_MODES = (
    pb.AUTORESET_MODE_NEXT_STEP,
    pb.AUTORESET_MODE_SAME_STEP,
    pb.AUTORESET_MODE_DISABLED,
)


def read_open(metadata: Iterable[tuple[str, Any]] | None, most: int) -> tuple[int, AutoresetMode]:
    """N and the autoreset mode of a VectorSession open, from its call metadata.

    Raises:
        ValueError: N is missing, given more than once, not plain decimal digits (no sign,
            space or other characters), below 1 or above ``most``; or the mode is given
            more than once or is not one of next_step, same_step, disabled.
    """
    raw = _one(metadata, NUM_ENVS_KEY)
    if raw is None:
        raise ValueError(f"a VectorSession needs the number of envs in the {NUM_ENVS_KEY} metadata")
    if not _DIGITS.fullmatch(raw):
        raise ValueError(f"{NUM_ENVS_KEY} must be a whole number of envs, got {raw[:32]!r}")
    size = int(raw) if len(raw) <= _MAX_DIGITS else most + 1
    if size < 1 or size > most:
        shown = str(size) if len(raw) <= _MAX_DIGITS else f"{raw[:_MAX_DIGITS]}..."
        raise ValueError(
            f"{NUM_ENVS_KEY} is {shown}: a vector stream holds 1 to {most} envs on this server "
            "(--max-vector-envs)"
        )
    mode_text = _one(metadata, AUTORESET_KEY)
    if mode_text is None:
        mode_text = "next_step"
    if mode_text.lower() not in _MODES:
        raise ValueError(
            f"{AUTORESET_KEY} must be one of {', '.join(AUTORESET_VALUES)}, got {mode_text[:32]!r}"
        )
    return size, _MODES[mode_text.lower()]


#: What N may look like: ASCII digits only (str.isdecimal would take " 8 " once stripped,
#: and other scripts' digits).
_DIGITS = re.compile(r"[0-9]+")
#: Digits beyond this are refused as too many envs before int() sees them.
_MAX_DIGITS = 10


def _one(metadata: Iterable[tuple[str, Any]] | None, key: str) -> str | None:
    """The one value of ``key`` in the call's metadata (None: absent).

    Raises:
        ValueError: ``key`` came more than once (which one would win is the proxy's or
            the client library's choice, so none does).
    """
    values = [value for name, value in metadata or () if name == key]
    if len(values) > 1:
        raise ValueError(f"{key} was sent {len(values)} times: send it once")
    if not values:
        return None
    value = values[0]
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class VectorSessions:
    """Opens the VectorSession streams of one server process and hands each to the
    session manager as N sessions."""

    def __init__(self, manager: SessionManager, processes: EnvProcessPool | None) -> None:
        self._manager = manager
        self._processes = processes
        #: Most envs one stream may hold.
        self.max_envs = manager.config.max_vector_envs
        #: Requests one stream may have in flight at once.
        self.in_flight = manager.config.max_vector_in_flight
        #: The env may answer a stream as one native batch (Info says so).
        self.native = natively_batched(manager.spec.env_class)
        #: A measured env's batch calls, by N: measured apart from its single calls (a
        #: batch call costs N of them), shared by the streams of one size.
        self._placements: dict[int, CallPlacement] = {}

    def _placement(self, size: int) -> CallPlacement | None:
        """Where a measured env's batch calls of ``size`` envs run (None: the pool, also
        beyond :data:`_MAX_PLACEMENTS` sizes; not a measured env: unused), against the
        threshold of a batch of that size (``placement.batch_threshold``)."""
        measured = self._manager.spec.placement
        if measured is None:
            return None
        found = self._placements.get(size)
        if found is None and len(self._placements) < _MAX_PLACEMENTS:
            name = f"{self._manager.spec.name} (vector of {size})"
            threshold = batch_threshold(measured.threshold, size)
            found = self._placements[size] = CallPlacement(threshold, name)
        return found

    async def serve(self, context: _Context) -> None:
        """Run one VectorSession stream, given its RPC context, to its end."""
        try:
            size, autoreset = read_open(context.invocation_metadata(), self.max_envs)
        except ValueError as exc:
            await self._manager.limiter.refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        await self._manager.run(context, _VectorOpening(self, size, autoreset))

    async def open(self, held: Held, size: int, autoreset: AutoresetMode) -> VectorView:
        """The backend of one stream of ``size`` envs: its batch built (or spread).

        Raises:
            Exception: what building the envs raised.
        """
        manager = self._manager
        calls: BatchCalls
        if self._processes is not None:
            calls = await SpreadBatchCalls.open(self._processes, size, autoreset, self.native)
        else:
            # From here the runner frees the stream's slots when its batch is closed (or
            # could not be made), as for a single session's env.
            held.owns_slot = False
            calls = await manager.local_calls(size, autoreset, self._placement(size), VECTOR_WORDS)
        driver = Driver(
            manager.spec, size, autoreset, calls, VECTOR_WORDS, manager.snapshots,
            max_response=manager.config.max_message_bytes,
        )  # fmt: skip
        return VectorView(driver)


class _VectorOpening:
    """A VectorSession stream, for :meth:`SessionManager.run`."""

    request_class = pb.VectorSessionRequest
    response_class = pb.VectorSessionResponse

    def __init__(self, streams: VectorSessions, size: int, autoreset: AutoresetMode) -> None:
        self._streams = streams
        self.slots = size
        #: Requests in flight at once on the stream (``--max-vector-in-flight``).
        self.in_flight = streams.in_flight
        self._autoreset = autoreset
        self._driver: VectorView | None = None

    async def open(self, held: Held) -> SessionBackend:
        self._driver = await self._streams.open(held, self.slots, self._autoreset)
        return self._driver

    def headers(self) -> tuple[tuple[str, str], ...]:
        native = self._driver is not None and self._driver.native
        return ((BATCH_KEY, "native" if native else "loop"),)
