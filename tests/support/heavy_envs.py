"""Envs that make their process hold a lot, for the tests that bound what the server and
its env processes hold for them (tests/test_reliability_isolated_bytes.py).

Sizes come from the server's environment, so one env serves every size a test needs.
"""

from __future__ import annotations

import os

from openenv_grpc import AutoresetMode
from openenv_grpc_envs.echo import EchoState
from openenv_grpc_envs.echo.batch import EchoBatch, EchoBatchEnvironment
from support.envs import CountingEchoEnv, Ledger

#: Bytes of each state and snapshot of :class:`HugeStateEchoEnv` (6.4 MiB by default,
#: as in the attack on e2841ac).
STATE_BYTES = "OPENENV_TEST_STATE_BYTES"
#: Bytes :class:`HeavyBuildEchoEnv` holds from its construction on.
BUILD_BYTES = "OPENENV_TEST_BUILD_BYTES"


def _size(variable: str, default: int) -> int:
    return int(os.environ.get(variable, default))


def _count(what: str) -> None:
    """Append ``what`` and this pid to ``<ledger>.reads``: what the envs were asked."""
    root = os.environ.get("OPENENV_TEST_LEDGER")
    if root:
        with open(f"{root}.reads", "a") as reads:
            reads.write(f"{what} {os.getpid()}\n")


class HugeStateEchoEnv(CountingEchoEnv):
    """The counting echo env whose every state and snapshot is :data:`STATE_BYTES`
    long; each read is recorded in the ledger (``<ledger>.reads``)."""

    def state(self) -> EchoState:
        _count("state")
        size = _size(STATE_BYTES, 6_710_886)
        return EchoState(total_length=size, history=["s" * size])

    def snapshot(self) -> bytes:
        _count("snapshot")
        return b"p" * _size(STATE_BYTES, 6_710_886)

    def restore(self, snapshot: bytes) -> None:
        pass


class HeavyBuildEchoEnv(CountingEchoEnv):
    """The counting echo env that holds :data:`BUILD_BYTES` (64 MiB by default), every
    page touched, from its constructor on."""

    def __init__(self) -> None:
        super().__init__()
        self._ballast = b"b" * _size(BUILD_BYTES, 64 * 1024 * 1024)


class HeavyEchoBatch(EchoBatch):
    """The echo env's native batch, holding :data:`BUILD_BYTES` per env from its
    construction on; recorded in the ledger as one env (made and closed)."""

    def __init__(self, size: int, autoreset: AutoresetMode) -> None:
        super().__init__(size, autoreset)
        self._ledger = Ledger()
        self._ballast = b"b" * (size * _size(BUILD_BYTES, 64 * 1024 * 1024))

    def close(self) -> None:
        self._ledger.closed()


class HeavyBatchEchoEnv(EchoBatchEnvironment):
    """The echo bench env whose native batch is :class:`HeavyEchoBatch`."""

    @classmethod
    def make_batch(cls, size: int, autoreset: AutoresetMode) -> HeavyEchoBatch:
        return HeavyEchoBatch(size, autoreset)
