"""Replays the snapshot attacks of issue 14 against real servers; one JSON line each.

    python -m bench.attack_snapshots                # all of them
    python -m bench.attack_snapshots forge big      # some of them

- ``forge``: a real snapshot, then every one-bit flip of it, every truncation, appended
  bytes, random bytes of the same length and a re-signed copy under a key the server
  does not hold, each restored over the wire: what each is answered (never a restore,
  never INTERNAL: the env would have seen the bytes), and the refusal round trip.
- ``big``: a neighbour steps through three phases: quiet; while another process restores
  7.9 MiB of zeros back to back (refused at the header); while it restores an altered
  7.9 MiB snapshot (hashed in full on a thread, then refused):
  the neighbour's step latency, refusals per second, the server's RSS; and what one
  HMAC-SHA256 over 8 MiB costs here (what would stall the event loop if it ran there).
- ``oversize``: a snapshot one byte over ``--max-snapshot-bytes``, and a restore request
  over ``--max-message-bytes``.

The env is ``SnapshotEchoEnv`` from ``tests/support/envs.py``. Not a test: it measures,
it checks nothing (``tests/test_reliability_snapshots.py`` holds the promises).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import multiprocessing
import os
import random
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc

from bench.hostile import rss_mib
from openenv_grpc.client import EnvError
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.echo import AsyncEchoEnv, EchoAction, EchoResetOptions

TESTS = Path(__file__).resolve().parent.parent / "tests"
KEYS = {"SNAPSHOT_KEYS": "k1:0123456789abcdef0123456789abcdef"}
_BIG = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def _server(*args: str) -> ServerProcess:
    return ServerProcess("support.envs:SnapshotEchoEnv", list(args), KEYS, pythonpath=[TESTS])


def _percentiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "p50_ms": round(statistics.median(ordered) * 1000, 3),
        "p99_ms": round(ordered[int(len(ordered) * 0.99) - 1] * 1000, 3),
        "max_ms": round(ordered[-1] * 1000, 3),
        "n": len(ordered),
    }


def mutations(data: bytes, rng: random.Random) -> list[bytes]:
    """Every one-bit flip (bits 0 and 7 of each byte), every truncation, appended bytes,
    same-length random bytes, and a copy re-signed under a key id the server lacks."""
    out = []
    for index in range(len(data)):
        for bit in (0, 7):
            flipped = bytearray(data)
            flipped[index] ^= 1 << bit
            out.append(bytes(flipped))
    out += [data[:cut] for cut in range(len(data))]
    out += [data + bytes([rng.randrange(256)]) * n for n in (1, 32, 4096)]
    out += [rng.randbytes(len(data)) for _ in range(50)]
    # The same body, signed by an attacker with a key of their own named k2.
    head, key_id = data[:6], b"k2"
    body_at = 6 + data[5]
    signed = head[:5] + bytes([len(key_id)]) + key_id + data[body_at:-32]
    out.append(signed + hmac.digest(b"attacker-secret-attacker", signed, "sha256"))
    return out


async def _forge() -> dict[str, Any]:
    server = _server()
    try:
        async with AsyncEchoEnv(server.target) as env:
            await env.reset(seed=1, options=EchoResetOptions(max_steps=100))
            for message in ("a", "bb", "ccc"):
                await env.step(EchoAction(message=message))
            data = await env.snapshot()
            forged = mutations(data, random.Random(0))
            codes: Counter[str] = Counter()
            times = []
            for bad in forged:
                started = time.perf_counter()
                try:
                    await env.restore(bad)
                    codes["RESTORED"] += 1
                except EnvError as error:
                    codes[error.code.name] += 1
                times.append(time.perf_counter() - started)
            after = (await env.step(EchoAction(message="d"))).step_count
        return {
            "attack": "forge", "snapshot_bytes": len(data), "forgeries": len(forged),
            "answers": dict(codes), "step_count_after": after,
            "refusal_round_trip": _percentiles(times),
        }  # fmt: skip
    finally:
        server.stop()


def _restore_loop(target: str, forged: bytes, seconds: float, counted: Any) -> None:
    """The attacker's process: restore ``forged`` back to back for ``seconds``."""

    async def run() -> None:
        async with (
            grpc.aio.insecure_channel(target, options=_BIG) as channel,
            AsyncEchoEnv(channel) as env,
        ):
            stop = time.monotonic() + seconds
            while time.monotonic() < stop:
                try:
                    await env.restore(forged)
                except EnvError:
                    counted.value += 1

    asyncio.run(run())


async def _big() -> dict[str, Any]:
    server = _server()
    try:
        size, seconds = 7_900_000, 4.0
        async with AsyncEchoEnv(server.target) as neighbour:
            await neighbour.reset(seed=1, options=EchoResetOptions(max_steps=10**6))
            await neighbour.step(EchoAction(message=f"snapshot:big:{size}"))
            data = bytearray(await neighbour.snapshot())  # 7.9 MB: the big channel is not needed
            data[len(data) // 2] ^= 1  # altered: hashed in full (on a thread), then refused
            phases = {
                "quiet": None,
                "not_a_snapshot": bytes(len(data)),  # refused at the header: no hashing
                "altered": bytes(data),
            }
            await neighbour.reset(seed=2, options=EchoResetOptions(max_steps=10**6))
            rss_before = rss_mib(server.proc.pid)
            results: dict[str, Any] = {}
            context = multiprocessing.get_context("spawn")
            for phase, forged in phases.items():
                counted = context.Value("i", 0)
                attacker = None
                if forged is not None:
                    attacker = context.Process(
                        target=_restore_loop, args=(server.target, forged, seconds, counted)
                    )
                    attacker.start()
                    await asyncio.sleep(1.0)  # the attacker is up and sending
                latencies = []
                stop = time.monotonic() + seconds - 1.5
                while time.monotonic() < stop:
                    started = time.perf_counter()
                    await neighbour.step(EchoAction(message="hi"))
                    latencies.append(time.perf_counter() - started)
                    await asyncio.sleep(0.005)
                if attacker is not None:
                    await asyncio.to_thread(attacker.join, 30)
                results[phase] = {
                    "refusals_per_s": round(counted.value / seconds, 1),
                    "neighbour_step": _percentiles(latencies),
                }
            rss_after = rss_mib(server.proc.pid)
        payload = os.urandom(8 << 20)
        started = time.perf_counter()
        hmac.digest(b"k" * 32, payload, hashlib.sha256)
        hmac_ms = (time.perf_counter() - started) * 1000
        return {
            "attack": "big", "forged_snapshot_bytes": len(data), **results,
            "rss_mib_before_after": [round(rss_before), round(rss_after)],
            "hmac_8mib_ms_here": round(hmac_ms, 2),
        }  # fmt: skip
    finally:
        server.stop()


async def _oversize() -> dict[str, Any]:
    server = _server("--max-snapshot-bytes", "4096", "--max-message-bytes", "65536")
    try:
        async with AsyncEchoEnv(server.target) as env:
            await env.reset(seed=1)
            try:
                await env.restore(b"OGSN" + bytes(4093))
                over_limit = "RESTORED"
            except EnvError as error:
                over_limit = f"{error.code.name}: {error.message}"
            step = (await env.step(EchoAction(message="a"))).step_count
            try:
                await env.restore(bytes(70_000))
                over_message = "RESTORED"
            except Exception as error:  # the stream ends: SessionLost
                over_message = f"{type(error).__name__}: {error}"
        return {
            "attack": "oversize", "limit_plus_one": over_limit, "step_after": step,
            "over_message_limit": over_message,
        }  # fmt: skip
    finally:
        server.stop()


ATTACKS = {"forge": _forge, "big": _big, "oversize": _oversize}


def main() -> None:
    parser = argparse.ArgumentParser(description="Replay the snapshot attacks.")
    parser.add_argument("attacks", nargs="*", help=f"some of {', '.join(ATTACKS)} (default all)")
    names = parser.parse_args().attacks or list(ATTACKS)
    for name in names:
        print(json.dumps(asyncio.run(ATTACKS[name]())), flush=True)


if __name__ == "__main__":
    main()
