"""Replays the vector-stream attacks against real servers; one JSON line each.

    python -m bench.attack_vectors                  # all five
    python -m bench.attack_vectors kill crash       # some of them

- ``admission``: ``--max-concurrent-envs 64``, 60 slots held by one vector stream, then
  200 opens of 8 envs at once and opens with N = 10^9, "many", 0: what each gets, how
  fast, and how many envs were built for them.
- ``kill``: a client process holding two vector streams (64 + 32 envs) is SIGKILLed:
  how long until every env is closed and every slot free.
- ``oversize``: ``--max-message-bytes 1048576``, 64 envs each returning 40 kB: the
  answer, and whether the stream goes on; then a 2 MB request.
- ``crash``: ``--isolated 2``, 32 envs, env 0's process exits mid-step: rows answered,
  envs lost, the step's wall time, and the next step once the lost envs are reset.
- ``drain``: ``--grace 2``, one vector stream of 64 envs stepping: when it hears of the
  drain, when the process exits, envs closed.

The test envs come from ``tests/support/envs.py``. Not a test: it measures (the promises
are in ``tests/test_vector_*.py``).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from openenv_grpc import EnvError, VectorSession
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.echo import EchoAction

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

from support.raw_vector import RawVector, open_metadata  # noqa: E402


def _server(env: str, *args: str, ledger: Path | None = None) -> ServerProcess:
    extra = {"OPENENV_TEST_LEDGER": str(ledger)} if ledger is not None else {}
    return ServerProcess(f"support.envs:{env}", list(args), extra, pythonpath=[TESTS])


def _ledger(ledger: Path) -> tuple[int, int]:
    """Envs created and closed, from a test ledger directory."""
    return len(list(ledger.iterdir())), len(list(ledger.glob("*.closed")))


def _say(count: int, message: str) -> list[EchoAction]:
    return [EchoAction(message=message)] * count


def admission(tmp: Path) -> dict[str, Any]:
    ledger = tmp / "admission"
    ledger.mkdir()
    server = _server("CountingEchoEnv", "--max-concurrent-envs", "64", ledger=ledger)
    try:
        holder = RawVector(server.target, 60)
        holder.reset()
        codes: list[str] = []
        times: list[float] = []
        lock = threading.Lock()

        def one() -> None:
            started = time.monotonic()
            refused = RawVector(server.target, 8).refusal()
            with lock:
                times.append(time.monotonic() - started)
                codes.append(f"{refused.code().name}: {refused.details()}")

        threads = [threading.Thread(target=one) for _ in range(200)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        bad = {}
        for n in ("1000000000", "many", "0"):
            refused = RawVector(server.target, 0, metadata=open_metadata(n)).refusal()
            bad[n] = refused.code().name
        times.sort()
        created, _ = _ledger(ledger)
        holder.close()
        return {
            "attack": "admission",
            "refused": len(codes),
            "sample": sorted(set(codes))[:2],
            "refusal_p50_ms": round(1000 * times[len(times) // 2], 1),
            "refusal_p99_ms": round(1000 * times[int(len(times) * 0.99)], 1),
            "bad_n": bad,
            "envs_created": created,
        }
    finally:
        server.stop()


_CLIENT = """
import sys, time
sys.path.insert(0, sys.argv[2])
from support.raw_vector import RawVector
from openenv_grpc_envs.echo import EchoAction
streams = [RawVector(sys.argv[1], 64), RawVector(sys.argv[1], 32)]
for s, n in zip(streams, (64, 32)):
    s.reset()
    s.step([EchoAction(message="x")] * n)
print("ready", flush=True)
time.sleep(600)
"""


def kill(tmp: Path) -> dict[str, Any]:
    ledger = tmp / "kill"
    ledger.mkdir()
    server = _server("CountingEchoEnv", ledger=ledger)
    client = subprocess.Popen(
        [sys.executable, "-c", _CLIENT, server.target, str(TESTS)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert client.stdout is not None and client.stdout.readline().strip() == "ready"
        held = server.active()
        client.send_signal(signal.SIGKILL)
        client.wait(10)
        killed = time.monotonic()
        while time.monotonic() - killed < 60 and (server.active() or _ledger(ledger)[1] < 96):
            time.sleep(0.01)
        return {
            "attack": "kill",
            "held": held,
            "freed_after_s": round(time.monotonic() - killed, 3),
            "active_after": server.active(),
            "created_closed": _ledger(ledger),
        }
    finally:
        client.kill()
        server.stop()


def oversize(tmp: Path) -> dict[str, Any]:
    server = _server("FaultyEnv", "--max-message-bytes", str(1 << 20))
    try:
        envs = RawVector(server.target, 64, options=[("grpc.max_send_message_length", 8 << 20)])
        envs.reset()
        started = time.monotonic()
        answer = envs.step(_say(64, "big:40000"))
        took = time.monotonic() - started
        after = envs.step(_say(64, "small"))
        try:
            envs.step(_say(64, "x" * 32000))
            request = "answered"
        except grpc.RpcError as exc:
            request = f"{exc.code().name}: {exc.details()}"
        return {
            "attack": "oversize",
            "answer": f"{grpc.StatusCode(_code(answer.error.code)).name}: {answer.error.message}",
            "answer_ms": round(1000 * took, 1),
            "next_step_rows": len(after.result.indices),
            "step_counts_after": sorted(set(after.result.step_counts)),
            "request_2mb": request,
        }
    finally:
        server.stop()


def _code(value: int) -> tuple[int, str]:
    return next(code.value for code in grpc.StatusCode if code.value[0] == value)


def crash(tmp: Path) -> dict[str, Any]:
    server = _server("FaultyEnv", "--isolated", "2")
    try:
        with VectorSession(server.target, 32) as envs:
            envs.reset()
            envs.step(_say(32, "warm"))
            started = time.monotonic()
            out = envs.step([EchoAction(message="exit"), *_say(31, "x")])
            took = time.monotonic() - started
            lost = sorted(out.errors)
            codes = sorted({error.code.name for error in out.errors.values()})
            envs.reset(indices=lost)
            again = envs.step(_say(32, "y"))
            return {
                "attack": "crash",
                "rows_answered": len(out.indices),
                "envs_lost": len(lost),
                "lost_codes": codes,
                "step_ms": round(1000 * took, 1),
                "next_step_rows": len(again.indices),
                "active": server.active(),
            }
    finally:
        server.stop()


def drain(tmp: Path) -> dict[str, Any]:
    ledger = tmp / "drain"
    ledger.mkdir()
    server = _server("CountingEchoEnv", "--grace", "2", ledger=ledger)
    try:
        envs = VectorSession(server.target, 64)
        envs.open()
        envs.reset()
        sent = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        heard = ended = None
        how = ""
        while time.monotonic() - sent < 30:
            try:
                envs.step(_say(64, "tick"), timeout=5)
            except (EnvError, Exception) as exc:
                ended = time.monotonic() - sent
                how = type(exc).__name__ + ": " + str(getattr(exc, "code", ""))
                break
            if heard is None and envs.draining is not None:
                heard = time.monotonic() - sent
            time.sleep(0.02)
        code = server.proc.wait(30)
        return {
            "attack": "drain",
            "notice_after_s": None if heard is None else round(heard, 3),
            "stream_ended_after_s": None if ended is None else round(ended, 3),
            "ended_with": how,
            "exit_code": code,
            "exited_after_s": round(time.monotonic() - sent, 3),
            "created_closed": _ledger(ledger),
        }
    finally:
        server.stop()


ATTACKS = {
    "admission": admission,
    "kill": kill,
    "oversize": oversize,
    "crash": crash,
    "drain": drain,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("attacks", nargs="*", help=f"some of: {', '.join(ATTACKS)} (default all)")
    args = parser.parse_args()
    unknown = set(args.attacks) - set(ATTACKS)
    if unknown:
        parser.error(f"unknown attack(s): {', '.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.attacks or list(ATTACKS):
            print(json.dumps(ATTACKS[name](Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
