"""Snapshots on the wire: the env's bytes with the episode's bookkeeping, signed with
HMAC-SHA256 under the first key of a :class:`KeyRing` (:class:`SnapshotSeal`), and checked
completely (signature in constant time) before any env sees them; a refusal is a
:class:`SnapshotRefused` with its in-band code. The layout (as ``snapshot.proto`` says)::

    "OGSN" | format u8 | key id length u8 | key id | body length u32 LE | body | HMAC (32)

Keys come from ``SNAPSHOT_KEYS`` (or ``_FILE``): ``id:secret`` pairs, the first signs,
all verify. Without keys, one random key per server, inherited by forked workers.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import logging
import re
import secrets
import stat
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError

from openenv_grpc.server.config import ServerConfig
from openenv_grpc.server.model.phases import RESTORED_PHASE
from openenv_grpc.v1 import snapshot_pb2

__all__ = [
    "DEFAULT_LIMIT",
    "FORMAT",
    "MAGIC",
    "MIN_SECRET_BYTES",
    "OFF_LOOP_BYTES",
    "Captured",
    "KeyRing",
    "SnapshotKey",
    "SnapshotRefused",
    "SnapshotSeal",
    "default_seal",
    "ephemeral_ring",
    "sealing",
]

log = logging.getLogger(__name__)

MAGIC = b"OGSN"
#: The envelope format this server writes and reads.
FORMAT = 1
MIN_SECRET_BYTES = 16
#: Snapshots of one request larger than this are signed and checked off the event loop.
OFF_LOOP_BYTES = 1 << 20
#: The limit of a seal made without settings (tests).
DEFAULT_LIMIT = 8 * 1024 * 1024

_T = TypeVar("_T")
_A = TypeVar("_A")

_HEAD = struct.Struct("<4sBB")  # magic, format, key id length
_BODY_LENGTH = struct.Struct("<I")
_MAC_BYTES = hashlib.sha256().digest_size
_KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")

_INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


class SnapshotRefused(Exception):
    """A snapshot was not made or not accepted: ``code`` (a gRPC code number) and
    ``message`` go to the client in-band; the session goes on."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class SnapshotKey:
    """One key: its public id (written into each snapshot) and its secret."""

    id: str
    secret: bytes = field(repr=False)


class KeyRing:
    """The keys a server signs (the first) and verifies (all) snapshots with. It never
    shows a secret, and never reaches env processes (the front seals and opens)."""

    __slots__ = ("_secrets", "ephemeral", "signing")

    def __init__(self, keys: Sequence[SnapshotKey], *, ephemeral: bool = False) -> None:
        """Raises ValueError: no keys, or two with the same id."""
        if not keys:
            raise ValueError("a snapshot key ring needs at least one key")
        self._secrets: dict[str, bytes] = {}
        for key in keys:
            if key.id in self._secrets:
                raise ValueError(f"snapshot key id {key.id!r} appears twice")
            self._secrets[key.id] = key.secret
        self.signing = keys[0]
        #: A random key made at start, not configured: snapshots restore here only.
        self.ephemeral = ephemeral

    def __repr__(self) -> str:
        kind = "ephemeral " if self.ephemeral else ""
        return f"<{kind}KeyRing signing={self.signing.id!r} ids={list(self._secrets)!r}>"

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(self._secrets)

    def secret(self, key_id: str) -> bytes | None:
        return self._secrets.get(key_id)

    @classmethod
    def parse(cls, text: str, source: str) -> KeyRing:
        """``id:secret`` pairs separated by commas or newlines (``#`` starts a comment
        line); ``source`` names where they came from in errors.

        Raises:
            ValueError: a malformed pair, a bad id, a short secret, a repeated id, or no
                key at all (the message never shows a secret).
        """
        keys: list[SnapshotKey] = []
        lines = (line for line in text.splitlines() if not line.lstrip().startswith("#"))
        for number, item in enumerate(
            (part.strip() for line in lines for part in line.split(",")), start=1
        ):
            if not item:
                continue
            key_id, colon, secret = item.partition(":")
            key_id, secret = key_id.strip(), secret.strip()
            if not colon:
                raise ValueError(f"{source}: entry {number} is not `id:secret`")
            if not _KEY_ID.fullmatch(key_id):
                raise ValueError(f"{source}: key id {key_id!r} must be 1-64 of A-Z a-z 0-9 . _ -")
            raw = secret.encode()
            if len(raw) < MIN_SECRET_BYTES:
                raise ValueError(
                    f"{source}: the secret of key {key_id!r} is {len(raw)} bytes; use at "
                    f"least {MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)"
                )
            if any(key.id == key_id for key in keys):
                raise ValueError(f"{source}: key id {key_id!r} appears twice")
            keys.append(SnapshotKey(key_id, raw))
        if not keys:
            raise ValueError(f"{source}: no `id:secret` key in it")
        return cls(keys)

    @classmethod
    def from_config(cls, config: ServerConfig) -> KeyRing:
        """``SNAPSHOT_KEYS``, else ``SNAPSHOT_KEYS_FILE``, else :func:`ephemeral_ring`.

        Raises:
            ValueError: both are set, or the keys are malformed.
            OSError: the file cannot be read.
        """
        if config.snapshot_keys and config.snapshot_keys_file:
            raise ValueError("set SNAPSHOT_KEYS or SNAPSHOT_KEYS_FILE, not both")
        if config.snapshot_keys:
            return cls.parse(config.snapshot_keys, "SNAPSHOT_KEYS")
        if config.snapshot_keys_file:
            path = Path(config.snapshot_keys_file)
            text = path.read_text(encoding="utf-8")
            if stat.S_IMODE(path.stat().st_mode) & 0o077:
                log.warning("snapshot keys file %s can be read by other users: chmod 600 it", path)
            return cls.parse(text, str(path))
        return ephemeral_ring()


@functools.cache
def ephemeral_ring() -> KeyRing:
    """This server's random key ring, made on first use (before ``--workers`` fork)."""
    key = SnapshotKey(f"ephemeral-{secrets.token_hex(4)}", secrets.token_bytes(32))
    log.info(
        "no SNAPSHOT_KEYS: snapshots are signed with a random key (%s) and restore on "
        "this server only, until it exits",
        key.id,
    )
    return KeyRing([key], ephemeral=True)


@dataclass(frozen=True, slots=True)
class Captured:
    """What a snapshot holds: the episode's bookkeeping and the env's own bytes."""

    episode_id: str
    step_count: int
    #: A ``snapshot_pb2.SnapshotPhase`` other than UNSPECIFIED.
    phase: int
    env_state: bytes


class SnapshotSeal:
    """Seals and opens the snapshots of one env (name and version) under one key ring,
    within ``limit`` bytes (everything included)."""

    __slots__ = ("_env_name", "_env_version", "keys", "limit")

    def __init__(self, env_name: str, env_version: str, keys: KeyRing, limit: int) -> None:
        self._env_name = env_name
        self._env_version = env_version
        self.keys = keys
        self.limit = limit

    def seal(self, captured: Captured) -> bytes:
        """Raises SnapshotRefused: RESOURCE_EXHAUSTED, the snapshot is over the limit."""
        body = snapshot_pb2.SnapshotBody(
            env_name=self._env_name,
            env_version=self._env_version,
            episode_id=captured.episode_id,
            step_count=captured.step_count,
            phase=captured.phase,  # type: ignore[arg-type]
            env_state=captured.env_state,
        ).SerializeToString()
        key = self.keys.signing
        key_id = key.id.encode()
        size = _HEAD.size + len(key_id) + _BODY_LENGTH.size + len(body) + _MAC_BYTES
        if size > self.limit:
            raise SnapshotRefused(
                _RESOURCE_EXHAUSTED,
                f"the environment's snapshot is {len(captured.env_state)} bytes: with its "
                f"envelope {size} bytes, over this server's snapshot limit of {self.limit} "
                "bytes (MAX_SNAPSHOT_BYTES); the episode goes on",
            )
        signed = b"".join(
            (_HEAD.pack(MAGIC, FORMAT, len(key_id)), key_id, _BODY_LENGTH.pack(len(body)), body)
        )
        return signed + hmac.digest(key.secret, signed, "sha256")

    def open(self, data: bytes) -> Captured:
        """What ``data`` captured, checked completely.

        Raises:
            SnapshotRefused: INVALID_ARGUMENT, bytes that are not one intact snapshot;
                FAILED_PRECONDITION, one this server cannot take (key, format, env).
        """
        size = len(data)
        if size > self.limit:
            raise _invalid(
                f"snapshot is {size} bytes, over this server's snapshot limit of "
                f"{self.limit} bytes (MAX_SNAPSHOT_BYTES)"
            )
        if not size:
            raise _invalid("empty snapshot: restore takes the bytes of a snapshot result")
        if not (data.startswith(MAGIC) or (size < len(MAGIC) and MAGIC.startswith(data))):
            raise _invalid("not a snapshot: the bytes do not begin with a snapshot header")
        if size < _HEAD.size:
            raise _invalid(f"snapshot truncated: {size} bytes, shorter than its header")
        _, version, id_length = _HEAD.unpack_from(data)
        if version != FORMAT:
            raise SnapshotRefused(
                _FAILED_PRECONDITION,
                f"snapshot format {version} is not one this server reads (format {FORMAT})",
            )
        body_at = _HEAD.size + id_length + _BODY_LENGTH.size
        if size < body_at:
            raise _invalid(f"snapshot truncated: {size} bytes, shorter than its header")
        (body_length,) = _BODY_LENGTH.unpack_from(data, body_at - _BODY_LENGTH.size)
        end = body_at + body_length
        expected = end + _MAC_BYTES
        if size < expected:
            raise _invalid(f"snapshot truncated: {size} of its {expected} bytes")
        if size > expected:
            raise _invalid(
                f"snapshot has {size - expected} bytes after its end: not one intact snapshot"
            )
        key_id = data[_HEAD.size : _HEAD.size + id_length].decode("ascii", "replace")
        secret = self.keys.secret(key_id) if _KEY_ID.fullmatch(key_id) else None
        if secret is None:
            raise SnapshotRefused(_FAILED_PRECONDITION, self._unknown_key(key_id))
        view = memoryview(data)
        mac = hmac.digest(secret, view[:end], "sha256")
        if not hmac.compare_digest(mac, view[end:]):
            raise _invalid(
                f"snapshot signature does not match under key {key_id!r}: the bytes were "
                "altered, or signed with another secret under the same key id"
            )
        try:
            body = snapshot_pb2.SnapshotBody.FromString(view[body_at:end])  # type: ignore[arg-type]
        except DecodeError:  # signed by us, so only a server bug gets here
            raise _invalid("snapshot body does not parse") from None
        if (body.env_name, body.env_version) != (self._env_name, self._env_version):
            raise SnapshotRefused(_FAILED_PRECONDITION, self._foreign(body))
        # Only a phase the driver can restore: a new proto phase waits for CAPTURED_PHASE.
        if body.phase not in RESTORED_PHASE:
            raise _invalid(f"snapshot has no valid episode phase ({body.phase})")
        return Captured(body.episode_id, body.step_count, body.phase, body.env_state)

    def seal_each(self, captured: Sequence[Captured]) -> list[bytes | SnapshotRefused]:
        """The snapshot of each, or its refusal."""
        return [_or_refused(self.seal, one) for one in captured]

    def open_each(self, data: Sequence[bytes]) -> list[Captured | SnapshotRefused]:
        """What each captured, or its refusal."""
        return [_or_refused(self.open, one) for one in data]

    def _unknown_key(self, key_id: str) -> str:
        if self.keys.ephemeral:
            return (
                f"snapshot signed with key {key_id!r}, which this server does not hold: "
                "without SNAPSHOT_KEYS it signs with a random key made at start "
                f"({self.keys.signing.id!r}), so only its own snapshots since then restore "
                "here; give servers a shared SNAPSHOT_KEYS to restore across them"
            )
        held = ", ".join(self.keys.ids)
        return (
            f"snapshot signed with key {key_id!r}, which this server does not hold (it "
            f"verifies {held}); restore it on a server with that key in SNAPSHOT_KEYS"
        )

    def _foreign(self, body: snapshot_pb2.SnapshotBody) -> str:
        if body.env_name != self._env_name:
            return (
                f"snapshot of env {body.env_name!r} (version {body.env_version}); this "
                f"server hosts env {self._env_name!r}"
            )
        return (
            f"snapshot of {body.env_name!r} version {body.env_version}; this server hosts "
            f"version {self._env_version}, and snapshots restore on the same version only"
        )


def _invalid(message: str) -> SnapshotRefused:
    return SnapshotRefused(_INVALID_ARGUMENT, message)


def default_seal(env_name: str, env_version: str) -> SnapshotSeal:
    """The seal of a driver made without the server's (tests)."""
    return SnapshotSeal(env_name, env_version, ephemeral_ring(), DEFAULT_LIMIT)


async def sealing(work: Callable[[], _T], size: int) -> _T:
    """``work()`` (seals or opens of ``size`` bytes), on a thread past :data:`OFF_LOOP_BYTES`."""
    if size > OFF_LOOP_BYTES:
        return await asyncio.to_thread(work)
    return work()


def _or_refused(work: Callable[[_A], _T], argument: _A) -> _T | SnapshotRefused:
    try:
        return work(argument)
    except SnapshotRefused as refused:
        return refused
