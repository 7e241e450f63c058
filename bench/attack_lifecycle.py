"""Replays the lifecycle and ``--isolated`` attacks of issue 19; one JSON line each.

    python -m bench.attack_lifecycle                      # all of them
    python -m bench.attack_lifecycle hung-closes busy-open

- ``hung-closes``: six sessions whose ``close()`` blocks 20 s (default threads: 6 on
  the 2-core VM), then with ``--env-threads 2`` two of them; how long a new session's
  open, reset and step take meanwhile.
- ``busy-open``: ``--isolated 1``, the one env process busy in a 5 s step; how long a new
  session's open, reset and step take, and whether the step still ran then.
- ``bridged-timeout``: a sync OpenEnv env under the bridge with ``--isolated 1
  --step-timeout 2``, a 10 s step: when DEADLINE_EXCEEDED arrives.
- ``isolated-drain``: ``--isolated 1 --grace 2``, three held sessions on the one env
  process, one hung in a step: when the others' streams end, envs closed, exit time.

The test envs come from ``tests/support`` (the server gets ``tests`` on its path). Not a
test: it checks nothing, it measures (``tests/test_reliability_lifecycle.py`` and
``tests/test_reliability_isolated.py`` hold the promises). Run it from any directory but
a checkout of another version: ``python -m`` puts the working directory first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from openenv_grpc import Session
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.echo import EchoAction, EchoEnv

TESTS = Path(__file__).resolve().parent.parent / "tests"


def _server(env: str, *args: str, extra: dict[str, str] | None = None) -> ServerProcess:
    return ServerProcess(env, list(args), extra, pythonpath=[TESTS])


def hung_closes() -> list[dict[str, Any]]:
    rows = []
    for closes, args in ((6, ()), (2, ("--env-threads", "2"))):
        server = _server("support.envs:FaultyEnv", *args)
        try:
            envs = []
            for _ in range(closes):
                env = EchoEnv(server.target)
                env.open()
                env.reset()
                env.step(EchoAction(message="slow-close:20"))
                envs.append(env)
            for env in envs:
                threading.Thread(target=env.close, daemon=True).start()
            time.sleep(0.5)  # every close is inside its 20 s close() now
            started = time.monotonic()
            fresh = EchoEnv(server.target)
            fresh.open()
            fresh.reset()
            fresh.step(EchoAction(message="x"))
            rows.append({
                "attack": "hung-closes", "args": list(args), "hung_closes": closes,
                "open_reset_step_s": round(time.monotonic() - started, 3),
            })  # fmt: skip
            fresh.abort()
        finally:
            server.stop()
    return rows


def busy_open() -> list[dict[str, Any]]:
    server = _server("support.envs:FaultyEnv", "--isolated", "1")
    try:
        busy = Session(server.target)
        busy.open()
        busy.reset()
        step = threading.Thread(target=lambda: busy.step(EchoAction(message="sleep:5")))
        step.start()
        time.sleep(0.2)
        started = time.monotonic()
        fresh = Session(server.target)
        fresh.open()
        fresh.reset()
        fresh.step(EchoAction(message="x"))
        took = time.monotonic() - started
        row = {"attack": "busy-open", "open_reset_step_s": round(took, 3),
               "busy_step_still_running": step.is_alive()}  # fmt: skip
        step.join()
        fresh.close()
        busy.close()
        return [row]
    finally:
        server.stop()


def bridged_timeout() -> list[dict[str, Any]]:
    from openenv_grpc import EnvError
    from openenv_grpc.integrations.openenv import described_session

    server = _server(
        "--openenv=support.openenv_sleepy:SleepyEnvironment",
        "--isolated", "1", "--step-timeout", "2",
    )  # fmt: skip
    try:
        described = described_session(server.target)
        with described(server.target) as env:
            env.reset()
            started = time.monotonic()
            code = "OK"
            try:
                env.step(described.Action(seconds=10))
            except EnvError as exc:
                code = exc.code.name
            return [{"attack": "bridged-timeout", "code": code,
                     "answered_after_s": round(time.monotonic() - started, 3)}]  # fmt: skip
    finally:
        server.stop()


def isolated_drain() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        ledger = Path(tmp) / "ledger"
        ledger.mkdir()
        server = _server(
            "support.envs:FaultyEnv", "--isolated", "1", "--grace", "2",
            extra={"OPENENV_TEST_LEDGER": str(ledger)},
        )  # fmt: skip
        try:
            sessions = [Session(server.target) for _ in range(3)]
            for env in sessions:
                env.open()
                env.reset()
            hung = threading.Thread(
                target=lambda: _quietly(sessions[0].step, EchoAction(message="sleep:120")),
                daemon=True,
            )
            hung.start()
            time.sleep(0.5)
            ended: dict[int, float] = {}
            started = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)

            def held(i: int) -> None:
                _quietly(sessions[i].state, timeout=30)
                ended[i] = round(time.monotonic() - started, 3)

            waiters = [threading.Thread(target=held, args=(i,), daemon=True) for i in (1, 2)]
            for waiter in waiters:
                waiter.start()
            code = server.proc.wait(30)
            exited = round(time.monotonic() - started, 3)
            for waiter in waiters:
                waiter.join(5)
            return [{
                "attack": "isolated-drain", "grace_s": 2, "exit": code, "exit_after_s": exited,
                "held_sessions_ended_after_s": sorted(ended.values()), "envs": 3,
                "closed": len(list(ledger.glob("*.closed"))),
            }]  # fmt: skip
        finally:
            server.stop()


def _quietly(call: Any, *args: Any, **kwargs: Any) -> None:
    with contextlib.suppress(Exception):  # the stream ended under it: measured is when
        call(*args, **kwargs)


ATTACKS = {
    "hung-closes": hung_closes,
    "busy-open": busy_open,
    "bridged-timeout": bridged_timeout,
    "isolated-drain": isolated_drain,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("attacks", nargs="*", help=f"some of {', '.join(ATTACKS)}")
    for name in parser.parse_args().attacks or ATTACKS:
        for row in ATTACKS[name]():
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
