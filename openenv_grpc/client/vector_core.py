"""What ``VectorSession`` and ``AsyncVectorSession`` share that does no I/O: N, the
autoreset mode, the stream's metadata and the envs' last known episodes.

A vector stream is opened, retried, timed out, reconnected and closed exactly like a
one-env session (the transport shells ``SyncStream`` and ``AsyncStream``, over
:mod:`openenv_grpc.client.session_core`); only its commands and answers differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from openenv_grpc.client.errors import SessionStateError
from openenv_grpc.client.notices import read_notice
from openenv_grpc.client.session_core import SessionCore, StreamBase
from openenv_grpc.client.vector_protocol import VectorProtocol
from openenv_grpc.environment import AutoresetMode
from openenv_grpc.metadata import AUTORESET_KEY, AUTORESET_VALUES, BATCH_KEY, NUM_ENVS_KEY

if TYPE_CHECKING:  # typing.Self is 3.11+; only the type checker needs it
    from typing_extensions import Self

__all__ = ["Inbox", "VectorBase"]


class Inbox:
    """Which requests of a vector stream await an answer, and answers read early.

    A vector stream may have several requests in flight (``send`` / ``recv``), each on
    envs of its own; the server answers each as it completes, so answers come in any
    order and are matched by request id. Requests a call gave up on (its timeout) are
    ``abandoned``: their late answers are dropped, and a blocking call first waits for
    them, since the server refuses a request naming envs a request in flight holds.
    """

    __slots__ = ("abandoned", "early", "sent")

    def __init__(self) -> None:
        #: Requests of ``send`` whose answer ``recv`` has not returned, in send order.
        self.sent: dict[int, None] = {}
        #: Answers to ``sent`` requests read while waiting for another one.
        self.early: dict[int, Any] = {}
        self.abandoned: set[int] = set()

    def clear(self) -> None:
        """Forget everything (the stream is gone)."""
        self.sent.clear()
        self.early.clear()
        self.abandoned.clear()

    def take(self, wanted: int | None) -> Any:
        """An answer read already: to ``wanted``, or (None) to any sent request, the
        first read; None if there is none.

        Raises:
            SessionStateError: ``wanted`` is None and no request was sent.
        """
        early = self.early
        if wanted is None:
            if not self.sent:
                raise SessionStateError("recv() with no request in flight: send() first")
            if early:
                request_id = next(iter(early))
                del self.sent[request_id]
                return early.pop(request_id)
            return None
        self.sent.pop(wanted, None)
        return early.pop(wanted, None)

    def route(self, response: Any, wanted: int | None, protocol: VectorProtocol) -> bool:
        """File one answer read from the stream; True if it is the one the caller waits
        for (``wanted``, or any sent request for None)."""
        request_id = response.request_id
        if request_id == wanted:
            return True
        if request_id in self.sent:
            if wanted is None:
                del self.sent[request_id]
                return True
            self.early[request_id] = response
        elif request_id == 0 and response.WhichOneof("outcome") == "notice":
            protocol.draining = read_notice(response.notice) or protocol.draining
        else:  # the late answer to a call given up on
            self.abandoned.discard(request_id)
        return False


class VectorBase(StreamBase):
    """The vector stream's identity: how many envs, which autoreset, native or not."""

    _rpc = "VectorSession"
    _core: SessionCore[VectorProtocol]
    _num_envs: int
    _autoreset: str
    _inbox: Inbox

    def _configure(
        self, num_envs: int, autoreset: str | AutoresetMode, options: Mapping[str, Any]
    ) -> None:
        """Check and keep N and the mode (before the base constructor reads them).

        Raises:
            ValueError: N is not a positive int, or the mode is not one of Gymnasium's.
            TypeError: ``recovery`` was given (vector streams do not recover).
        """
        if options.get("recovery") is not None:
            raise TypeError("recovery is for one-env sessions (a vector stream does not recover)")
        if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
            raise ValueError(f"num_envs must be a positive int, got {num_envs!r}")
        mode = autoreset.value if isinstance(autoreset, AutoresetMode) else str(autoreset)
        if mode.lower() not in AUTORESET_VALUES:
            raise ValueError(
                f"autoreset must be one of {', '.join(AUTORESET_VALUES)}, got {mode!r}"
            )
        self._num_envs = num_envs
        self._autoreset = mode.lower()
        self._inbox = Inbox()

    def _new_protocol(self) -> VectorProtocol:
        return VectorProtocol(self._types, self._num_envs)

    def _open_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((NUM_ENVS_KEY, str(self._num_envs)), (AUTORESET_KEY, self._autoreset))

    @property
    def in_flight(self) -> int:
        """Requests sent with ``send`` whose answer ``recv`` has not returned yet."""
        return len(self._inbox.sent)

    @property
    def num_envs(self) -> int:
        """How many envs the stream holds."""
        return self._num_envs

    @property
    def autoreset(self) -> AutoresetMode:
        """What the server does when an env's episode ends."""
        return AutoresetMode(self._autoreset)

    @property
    def native(self) -> bool:
        """The server answers this stream as one native batch (``step_batch`` and
        ``batch=True`` work); False for a loop over plain instances, or before open."""
        return self._core.headers.get(BATCH_KEY) == "native"

    @property
    def episode_ids(self) -> list[str]:
        """Each env's current episode, as the server last said ("" before its reset)."""
        return list(self._core.protocol.episode_ids)

    @property
    def step_counts(self) -> list[int]:
        """Each env's step count, as the server last said."""
        return list(self._core.protocol.step_counts)

    @classmethod
    def _unopened_fork(
        cls,
        target: Any,
        snapshots: Sequence[bytes],
        autoreset: str | AutoresetMode,
        options: Mapping[str, Any],
    ) -> Self:
        """The unopened vector stream of ``forked``: one env per snapshot, on ``target``
        -- a target string, channel or stub, or an open session (then on its server and
        channel, with its options unless ``options`` says otherwise).

        Raises:
            ValueError: no snapshots.
            TypeError: a session of the other kind (blocking for asyncio, or back).
        """
        if isinstance(snapshots, bytes | bytearray | memoryview) or not snapshots:
            raise ValueError("forked takes a non-empty list of snapshots, one per env")
        make: Any = cls  # a shell: (target, num_envs, *, autoreset, **options)
        if not isinstance(target, StreamBase):
            fresh: Self = make(target, len(snapshots), autoreset=autoreset, **options)
            return fresh
        if target._channel_class is not cls._channel_class:
            raise TypeError(
                f"a {cls.__qualname__} cannot fork from a {type(target).__qualname__}: "
                "blocking and asyncio sessions do not share channels"
            )
        inherited = {k: v for k, v in target._options.items() if k != "recovery"}
        fork: Self = make(
            target._core.stub, len(snapshots), autoreset=autoreset, **{**inherited, **options}
        )
        target._share_with(fork)
        return fork
