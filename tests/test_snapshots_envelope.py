"""The snapshot envelope and key ring (``server/model/snapshots.py``), without a server: every
refusal with its code and message, key parsing, rotation, and that secrets never show.

The same refusals over real gRPC, with real server processes, are in
``test_snapshots.py``; these pin the exact checks and their order.
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import pytest

from openenv_grpc.server.config import ServerConfig
from openenv_grpc.server.model.snapshots import (
    Captured,
    KeyRing,
    SnapshotKey,
    SnapshotRefused,
    SnapshotSeal,
    ephemeral_ring,
)
from openenv_grpc.server.model.spec import EnvSpec
from openenv_grpc.v1 import snapshot_pb2
from support.envs import AsyncEchoEnv, FaultyEnv, HalfSnapshotEnv, SnapshotEchoEnv

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]

K1 = "k1:" + "1" * 32
K2 = "k2:" + "2" * 32
CAPTURED = Captured("episode-7", 3, snapshot_pb2.SNAPSHOT_PHASE_RUNNING, b'{"rng": 1}')


def seal(
    keys: str = K1, name: str = "echo", version: str = "1.0", limit: int = 4096
) -> SnapshotSeal:
    return SnapshotSeal(name, version, KeyRing.parse(keys, "test"), limit)


def refused(opener: SnapshotSeal, data: bytes) -> SnapshotRefused:
    with pytest.raises(SnapshotRefused) as caught:
        opener.open(data)
    return caught.value


def test_a_sealed_snapshot_opens_to_what_was_captured() -> None:
    data = seal().seal(CAPTURED)
    assert data.startswith(b"OGSN\x01\x02k1")
    assert seal().open(data) == CAPTURED


@pytest.mark.parametrize(
    ("mangle", "code", "words"),
    [
        (lambda d: b"", INVALID_ARGUMENT, "empty snapshot"),
        (lambda d: b"PK\x03\x04" + d[4:], INVALID_ARGUMENT, "not a snapshot"),
        (lambda d: d[:3], INVALID_ARGUMENT, "snapshot truncated: 3 bytes"),
        (lambda d: d[:8], INVALID_ARGUMENT, "snapshot truncated: 8 bytes, shorter than its header"),
        (lambda d: d[:-1], INVALID_ARGUMENT, "snapshot truncated: {short} of its {full} bytes"),
        (lambda d: d + b"\0", INVALID_ARGUMENT, "1 bytes after its end"),
        (lambda d: d[:-5] + bytes([d[-5] ^ 1]) + d[-4:], INVALID_ARGUMENT,
         "signature does not match under key 'k1'"),
        (lambda d: d[:20] + bytes([d[20] ^ 1]) + d[21:], INVALID_ARGUMENT,
         "signature does not match"),
        (lambda d: d[:6] + b"k9" + d[8:], FAILED_PRECONDITION,
         "signed with key 'k9', which this server does not hold (it verifies k1)"),
        (lambda d: d[:4] + b"\x02" + d[5:], FAILED_PRECONDITION, "snapshot format 2"),
    ],
    ids=["empty", "foreign", "stub", "header", "truncated", "trailing", "mac-bit", "body-bit",
         "key-id", "format"],
)  # fmt: skip
def test_bytes_that_are_not_one_intact_snapshot_are_refused(
    mangle: object, code: int, words: str
) -> None:
    data = seal().seal(CAPTURED)
    failure = refused(seal(), mangle(data))  # type: ignore[operator]
    assert failure.code == code
    assert words.format(short=len(data) - 1, full=len(data)) in failure.message


def test_every_single_bit_flip_is_refused() -> None:
    data = seal().seal(CAPTURED)
    opener = seal(K1 + "," + "k0:" + "0" * 32)  # a flipped key id may name another held key
    for index in range(len(data)):
        for bit in (0, 7):
            flipped = bytearray(data)
            flipped[index] ^= 1 << bit
            with pytest.raises(SnapshotRefused):
                opener.open(bytes(flipped))


def test_another_env_and_another_version_are_refused_after_the_signature() -> None:
    data = seal(name="wordle", version="1.0").seal(CAPTURED)
    failure = refused(seal(), data)
    assert failure.code == FAILED_PRECONDITION
    assert "snapshot of env 'wordle' (version 1.0); this server hosts env 'echo'" in failure.message
    data = seal(version="2.0").seal(CAPTURED)
    failure = refused(seal(), data)
    assert failure.code == FAILED_PRECONDITION
    assert "version 2.0; this server hosts version 1.0" in failure.message


def test_a_snapshot_over_the_limit_is_refused_either_way() -> None:
    big = Captured("e", 0, snapshot_pb2.SNAPSHOT_PHASE_RUNNING, b"x" * 5000)
    with pytest.raises(SnapshotRefused) as made:
        seal(limit=4096).seal(big)
    assert made.value.code == RESOURCE_EXHAUSTED
    assert "over this server's snapshot limit of 4096 bytes" in made.value.message
    data = seal(limit=8192).seal(big)
    failure = refused(seal(limit=4096), data)
    assert failure.code == INVALID_ARGUMENT
    assert f"snapshot is {len(data)} bytes, over this server's snapshot limit of 4096" in (
        failure.message
    )


def test_rotation_the_first_key_signs_and_every_key_verifies() -> None:
    old = seal(K1).seal(CAPTURED)
    rotated = seal(f"{K2},{K1}")
    assert rotated.open(old) == CAPTURED
    new = rotated.seal(CAPTURED)
    assert new.startswith(b"OGSN\x01\x02k2")
    failure = refused(seal(K1), new)
    assert failure.code == FAILED_PRECONDITION and "'k2'" in failure.message


def test_same_key_id_with_another_secret_is_a_signature_mismatch() -> None:
    data = seal(K1).seal(CAPTURED)
    failure = refused(seal("k1:" + "x" * 32), data)
    assert failure.code == INVALID_ARGUMENT
    assert "signed with another secret under the same key id" in failure.message


def test_the_ephemeral_ring_is_one_per_process_and_says_so() -> None:
    ring = ephemeral_ring()
    assert ring is ephemeral_ring() and ring.ephemeral
    assert ring.signing.id.startswith("ephemeral-")
    other = SnapshotSeal("echo", "1.0", KeyRing([SnapshotKey("ephemeral-0", b"z" * 32)],
                                                ephemeral=True), 4096)  # fmt: skip
    data = SnapshotSeal("echo", "1.0", ring, 4096).seal(CAPTURED)
    failure = refused(other, data)
    assert failure.code == FAILED_PRECONDITION
    assert "without SNAPSHOT_KEYS it signs with a random key made at start" in failure.message


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "no `id:secret` key"),
        ("k1", "entry 1 is not `id:secret`"),
        ("k 1:" + "s" * 20, "key id 'k 1' must be"),
        ("k1:short", "the secret of key 'k1' is 5 bytes; use at least 16"),
        (f"{K1},{K1}", "key id 'k1' appears twice"),
    ],
)
def test_malformed_keys_are_refused_without_showing_a_secret(text: str, words: str) -> None:
    with pytest.raises(ValueError, match="SNAPSHOT_KEYS") as caught:
        KeyRing.parse(text, "SNAPSHOT_KEYS")
    assert words in str(caught.value)
    assert "1" * 32 not in str(caught.value)


def test_keys_come_from_the_variable_or_a_file_not_both(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# rotated 2026-12-01\n{K2}\n{K1}\n")
    path.chmod(0o600)
    ring = KeyRing.from_config(ServerConfig(snapshot_keys_file=str(path)))
    assert ring.ids == ("k2", "k1") and not ring.ephemeral
    assert KeyRing.from_config(ServerConfig(snapshot_keys=K1)).ids == ("k1",)
    assert KeyRing.from_config(ServerConfig()) is ephemeral_ring()
    with pytest.raises(ValueError, match="not both"):
        KeyRing.from_config(ServerConfig(snapshot_keys=K1, snapshot_keys_file=str(path)))
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        KeyRing.from_config(ServerConfig(snapshot_keys_file=str(path)))
    assert "can be read by other users" in caplog.text
    with pytest.raises(OSError):
        KeyRing.from_config(ServerConfig(snapshot_keys_file=str(tmp_path / "missing")))


def test_secrets_never_show() -> None:
    keys = KeyRing.parse(f"{K2},{K1}", "test")
    assert "2222" not in repr(keys) and "2222" not in repr(keys.signing)
    assert "1111" not in repr(ServerConfig(snapshot_keys=K1))


def test_the_server_sees_whether_an_env_supports_snapshots() -> None:
    assert EnvSpec.from_factory(SnapshotEchoEnv).snapshots
    assert not EnvSpec.from_factory(FaultyEnv).snapshots
    assert not EnvSpec.from_factory(AsyncEchoEnv).snapshots
    with pytest.raises(TypeError, match="overrides snapshot\\(\\) but not restore\\(\\)"):
        EnvSpec.from_factory(HalfSnapshotEnv)


def test_the_limit_in_force_leaves_room_in_a_message() -> None:
    assert ServerConfig().snapshot_limit == 8 * 1024 * 1024
    assert ServerConfig(max_message_bytes=1 << 20).snapshot_limit == (1 << 20) - 1024
