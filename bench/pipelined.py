"""One vector step in flight against two half-batches in flight (issue 22), N = 64 (or
``--num-envs``), ratios
measured side by side in one run.

    python -m bench.pipelined                         # echo + CartPole, ~2 minutes
    python -m bench.pipelined --seconds 6 --rounds 3 --policy-ms 1
    python -m bench.pipelined --num-envs 128 --skip-echo   # two batches of 64 in flight
    python -m bench.pipelined --skip-echo --base-tree /tmp/base  # before/after, one run

Systems, each a closed loop over one stream (servers are child ``openenv-grpc serve``
processes on loopback, unlimited capacity):

* ``echo-1`` / ``echo-2``: ``VectorSession`` of 64 echo envs: ``step`` (one request in
  flight) against ``send`` / ``recv`` of two halves of 32 (two in flight).
* ``echo-native-1`` / ``echo-native-2``: the same with the echo bench env's native batch
  (``openenv_grpc_envs.echo.batch``: one action and one observation message for all
  rows, no ``Any`` per env): the protocol's floor per env-step.
* ``sync``: Gymnasium's in-process ``SyncVectorEnv`` of 64 CartPole-v1 (the bar).
* ``gym-1`` / ``gym-2``: ``RemoteGymnasiumVectorEnv`` of 64, Gymnasium backend: ``step``
  against ``batch_size=32`` (``send(actions, env_id)`` / ``recv()``, two in flight);
  ``envpool-1`` / ``envpool-2``: the same with ``backend="envpool"``.

``--policy-ms P`` makes the trainer spend about P ms of CPU per N rows on a fixed numpy
matmul (half of it per half-batch), from which the actions are taken, as a policy would:
that is where overlap matters. Windows of every system are interleaved (``--rounds``), so
a burst of other load hits all alike (every other round runs them in reverse order); a
ratio is the median of the per-round ratios.
Each row gives env-steps/s, client and server CPU per env-step, the machine's other
CPU and how often the server's measured placement moved env calls back to its thread pool
during the system's windows (``moves_to_pool``, read from the server's log). Numbers are
measured, never asserted; results go to ``bench/results/pipelined-*.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

# One BLAS thread: the policy's matmuls must not spin threads on the cores the envs use.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import gymnasium
import numpy as np

from bench.systems import cpu_seconds, machine_busy

RESULTS = Path(__file__).resolve().parent / "results"
N = 64
HALF = N // 2
#: The echo bench env whose vector streams are one native batch.
ECHO_NATIVE = "openenv_grpc_envs.echo.batch:EchoBatchEnvironment"


#: The server's log lines of measured placement moving a group (see server/model/placement.py).
MOVED_TO_POOL = "move to the thread pool"
MOVED_TO_LOOP = "now run on the event loop"
#: Each served child's placement moves so far, by pid (read from its log by a thread).
MOVES: dict[int, dict[str, int]] = {}
#: The log lines of those moves, by pid (what the slow call took, wall and CPU).
MOVE_LINES: dict[int, list[str]] = {}


def _drain(pid: int, stream: Any) -> None:
    """Read a child server's log to its end (so it never blocks on a full pipe), counting
    measured placement's moves of env calls between the event loop and the thread pool."""
    moves = MOVES.setdefault(pid, {"to_pool": 0, "to_loop": 0})
    lines = MOVE_LINES.setdefault(pid, [])
    for line in stream:
        if MOVED_TO_POOL in line:
            moves["to_pool"] += 1
        elif MOVED_TO_LOOP in line:
            moves["to_loop"] += 1
        else:
            continue
        lines.append(line.strip()[-400:])


@contextmanager
def serve(env: str, tree: str | None = None) -> Iterator[tuple[str, int]]:
    """A child ``openenv-grpc serve ENV`` on a free loopback port: (target, pid). With
    ``tree``, the server runs that checkout's code (its directory first on the path; it
    needs ``openenv_grpc_envs`` importable there, e.g. a symlink to ``envs``)."""
    command = [sys.executable, "-m", "openenv_grpc.cli", "serve", env, "--port", "0",
               "--max-concurrent-envs", "0"]  # fmt: skip
    environ = None
    if tree is not None:
        environ = {**os.environ, "PYTHONPATH": tree}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, cwd=tree, env=environ)  # fmt: skip
    try:
        assert process.stdout is not None
        target = ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            if "openenv-grpc: serving " in line and " on " in line:
                target = line.split(" on ", 1)[1].split()[0]
                break
        if not target:
            raise RuntimeError(f"the {env} server did not start")
        threading.Thread(target=_drain, args=(process.pid, process.stdout), daemon=True).start()
        yield target, process.pid
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


class Policy:
    """About ``ms`` of CPU per N rows: a fixed matmul over the observations."""

    def __init__(self, ms: float) -> None:
        self.ms = ms
        rng = np.random.default_rng(0)
        self._w = rng.standard_normal((4, 256)).astype(np.float32)
        self._h = rng.standard_normal((256, 256)).astype(np.float32)
        self.repeats = 0
        if ms > 0:
            obs = np.ones((N, 4), dtype=np.float32)
            self.repeats = 1
            while True:
                started = time.process_time()
                for _ in range(20):
                    self.act(obs)
                per_call = (time.process_time() - started) / 20
                if per_call >= ms / 1000 or self.repeats > 100_000:
                    break
                self.repeats = max(
                    self.repeats + 1, int(self.repeats * (ms / 1000) / max(per_call, 1e-7))
                )

    def act(self, obs: Any) -> Any:
        """One action per row (CartPole: 0 or 1)."""
        x = np.asarray(obs, dtype=np.float32) @ self._w
        for _ in range(self.repeats):
            x = np.tanh(x @ self._h)
        return (x[:, 0] > 0).astype(np.int64)


class Loop:
    """One system: ``prime`` before a window, ``run`` for the window, ``settle`` after."""

    def __init__(self, name: str, server_pid: int | None) -> None:
        self.name = name
        self.server_pid = server_pid

    def prime(self) -> None: ...

    def run(self, deadline: float) -> int:
        raise NotImplementedError

    def settle(self) -> None: ...

    def close(self) -> None: ...


class GymOne(Loop):
    """A Gymnasium vector env stepped whole (``sync`` or a remote one in flight)."""

    def __init__(self, name: str, envs: Any, policy: Policy, pid: int | None) -> None:
        super().__init__(name, pid)
        self.envs = envs
        self.policy = policy
        rng = np.random.default_rng(1)
        self.actions = [rng.integers(0, 2, N) for _ in range(64)]
        self.obs, _ = envs.reset(seed=0)

    def run(self, deadline: float) -> int:
        envs, policy, actions = self.envs, self.policy, self.actions
        obs, steps = self.obs, 0
        while time.monotonic() < deadline:
            action = policy.act(obs) if policy.repeats else actions[steps % 64]
            obs = envs.step(action)[0]
            steps += 1
        self.obs = obs
        return steps * N

    def close(self) -> None:
        self.envs.close()


class GymTwo(Loop):
    """A remote Gymnasium vector env with ``batch_size=32``: two halves in flight."""

    def __init__(self, name: str, envs: Any, policy: Policy, pid: int) -> None:
        super().__init__(name, pid)
        self.envs = envs
        self.policy = policy
        rng = np.random.default_rng(1)
        self.actions = [rng.integers(0, 2, HALF) for _ in range(64)]
        self.obs, _ = envs.reset(seed=0)
        self.halves = [np.arange(HALF), np.arange(HALF, N)]

    def prime(self) -> None:
        policy = self.policy
        for ids in self.halves:
            obs = self.obs[ids]
            self.envs.send(policy.act(obs) if policy.repeats else self.actions[0], ids)

    def run(self, deadline: float) -> int:
        envs, policy, actions = self.envs, self.policy, self.actions
        steps = 0
        while time.monotonic() < deadline:
            obs, _, _, _, info = envs.recv()
            ids = info["env_id"]
            envs.send(policy.act(obs) if policy.repeats else actions[steps % 64], ids)
            steps += 1
        return steps * HALF

    def settle(self) -> None:
        obs = np.array(self.obs)
        for _ in range(2):
            got, _, _, _, info = self.envs.recv()
            obs[info["env_id"]] = got
        self.obs = obs

    def close(self) -> None:
        self.envs.close()


class EchoOne(Loop):
    def __init__(self, name: str, envs: Any, pid: int) -> None:
        super().__init__(name, pid)
        from openenv_grpc_envs.echo import EchoAction

        self.envs = envs
        self.actions = [EchoAction(message="x")] * N
        envs.reset()

    def run(self, deadline: float) -> int:
        envs, actions, steps = self.envs, self.actions, 0
        while time.monotonic() < deadline:
            envs.step(actions)
            steps += 1
        return steps * N

    def close(self) -> None:
        self.envs.close()


class EchoTwo(EchoOne):
    halves = (list(range(HALF)), list(range(HALF, N)))

    def prime(self) -> None:
        for ids in self.halves:
            self.envs.send(self.actions[:HALF], ids)

    def run(self, deadline: float) -> int:
        envs, actions, steps = self.envs, self.actions[:HALF], 0
        while time.monotonic() < deadline:
            outcome = envs.recv()
            envs.send(actions, outcome.indices)
            steps += 1
        return steps * HALF

    def settle(self) -> None:
        for _ in range(2):
            self.envs.recv()


class EchoNative(Loop):
    """The echo bench env's native batch: one action and one observation message for all
    rows, no ``Any`` per env (``openenv_grpc_envs.echo.batch``)."""

    def __init__(self, name: str, envs: Any, pid: int) -> None:
        super().__init__(name, pid)
        from openenv_grpc_envs.echo.batch import EchoBatchAction

        self.envs = envs
        self.action = EchoBatchAction(messages=["x"] * N)
        self.half = EchoBatchAction(messages=["x"] * HALF)
        envs.reset(batch=True)

    def run(self, deadline: float) -> int:
        envs, action, steps = self.envs, self.action, 0
        while time.monotonic() < deadline:
            envs.step_batch(action)
            steps += 1
        return steps * N

    def close(self) -> None:
        self.envs.close()


class EchoNativeTwo(EchoNative):
    """The native batch in two halves, both in flight (``send_batch`` / ``recv``)."""

    halves = EchoTwo.halves

    def prime(self) -> None:
        for ids in self.halves:
            self.envs.send_batch(self.half, ids)

    def run(self, deadline: float) -> int:
        envs, half, steps = self.envs, self.half, 0
        while time.monotonic() < deadline:
            outcome = envs.recv()
            envs.send_batch(half, outcome.indices)
            steps += 1
        return steps * HALF

    def settle(self) -> None:
        for _ in range(2):
            self.envs.recv()


def window(loop: Loop, seconds: float) -> dict[str, float]:
    loop.prime()
    pid = loop.server_pid
    server0 = cpu_seconds(pid) if pid else 0.0
    wall0, busy0 = time.monotonic(), machine_busy()
    me0 = cpu_seconds(os.getpid(), tree=False)
    moved0 = MOVES.get(pid or 0, {}).get("to_pool", 0)
    steps = loop.run(wall0 + seconds)
    wall = time.monotonic() - wall0
    client = cpu_seconds(os.getpid(), tree=False) - me0
    server = (cpu_seconds(pid) - server0) if pid else 0.0
    other = machine_busy() - busy0 - client - server
    loop.settle()
    moved = MOVES.get(pid or 0, {}).get("to_pool", 0) - moved0
    return {"env_steps": steps, "wall": wall, "client": client, "server": server,
            "other": max(other, 0.0), "moves_to_pool": moved}  # fmt: skip


def measure(loops: list[Loop], seconds: float, rounds: int) -> dict[str, list[dict[str, float]]]:
    out: dict[str, list[dict[str, float]]] = {loop.name: [] for loop in loops}
    for loop in loops:  # warm up
        window(loop, 0.5)
    for round_ in range(rounds):  # every other round in reverse: no system always last
        for loop in loops if round_ % 2 == 0 else loops[::-1]:
            out[loop.name].append(window(loop, seconds / rounds))
    return out


def rows(windows: dict[str, list[dict[str, float]]]) -> list[dict[str, Any]]:
    def rate(w: dict[str, float]) -> float:
        return w["env_steps"] / w["wall"]

    def ratio(a: str, b: str) -> float | None:
        if a not in windows or b not in windows:
            return None
        return float(
            np.median([rate(x) / rate(y) for x, y in zip(windows[a], windows[b], strict=True)])
        )

    out = []
    for name, mine in windows.items():
        total = {key: sum(w[key] for w in mine) for key in mine[0]}
        pair = name[:-1] + "1" if name.endswith("-2") else None
        out.append({
            "system": name,
            "env_steps_per_s": round(total["env_steps"] / total["wall"]),
            "ratio_to_sync": None if name.startswith("echo") else ratio(name, "sync"),
            "two_over_one": ratio(name, pair) if pair else None,
            "over_base": ratio(name, f"base:{name}"),  # with --base-tree (None without)
            "client_cpu_us_per_env_step": round(total["client"] / total["env_steps"] * 1e6, 2),
            "server_cpu_us_per_env_step": round(total["server"] / total["env_steps"] * 1e6, 2),
            "other_cpu_cores": round(total["other"] / total["wall"], 2),
            "moves_to_pool": int(total["moves_to_pool"]),
        })  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="per system, all rounds")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--policy-ms", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--skip-echo", action="store_true")
    parser.add_argument("--num-envs", type=int, default=64, help="N (two in flight: N/2 each)")
    parser.add_argument(
        "--one-only", action="store_true",
        help="only one request in flight (sync, echo-1, gym-1, envpool-1): e.g. to compare "
        "against a server that predates send/recv, running this file from its checkout",
    )  # fmt: skip
    parser.add_argument(
        "--base-tree", metavar="DIR",
        help="also serve the gymnasium env from this checkout (before/after side by side: "
        "base:envpool-1/-2 in the same interleaved rounds; its openenv_grpc_envs must import "
        "from DIR, e.g. a symlink to envs)",
    )  # fmt: skip
    parser.add_argument(
        "--base-gym", action="store_true", help="with --base-tree: base:gym-1/-2 as well"
    )
    args = parser.parse_args(argv)
    global N, HALF
    N, HALF = args.num_envs, args.num_envs // 2
    from openenv_grpc.client import VectorSession
    from openenv_grpc_envs.gymnasium.adapters import RemoteGymnasiumVectorEnv

    report: dict[str, Any] = {"when": dt.datetime.now(dt.UTC).isoformat(), "n": N, "runs": []}
    log: Callable[[str], None] = lambda line: print(line, flush=True)  # noqa: E731
    if not args.skip_echo:
        with serve("echo") as (target, pid):
            loops: list[Loop] = [EchoOne("echo-1", VectorSession(target, N).__enter__(), pid)]
            if not args.one_only:
                loops.append(EchoTwo("echo-2", VectorSession(target, N).__enter__(), pid))
            try:
                found = rows(measure(loops, args.seconds, args.rounds))
            finally:
                for loop in loops:
                    loop.close()
            report["runs"].append({"env": "echo", "policy_ms": 0, "rows": found})
            for row in found:
                log(json.dumps({"env": "echo", **row}))
        with serve(ECHO_NATIVE) as (target, pid):
            from openenv_grpc_envs.echo.batch import EchoBatchVectorEnv

            loops = [EchoNative("echo-native-1", EchoBatchVectorEnv(target, N).__enter__(), pid)]
            if not args.one_only:
                loops.append(
                    EchoNativeTwo("echo-native-2", EchoBatchVectorEnv(target, N).__enter__(), pid)
                )
            try:
                found = rows(measure(loops, args.seconds, args.rounds))
            finally:
                for loop in loops:
                    loop.close()
            report["runs"].append({"env": "echo-native", "policy_ms": 0, "rows": found})
            for row in found:
                log(json.dumps({"env": "echo-native", **row}))
    with ExitStack() as servers:
        target, pid = servers.enter_context(serve("gymnasium"))
        base_target, base_pid = "", 0
        if args.base_tree:
            base_target, base_pid = servers.enter_context(serve("gymnasium", args.base_tree))
        for ms in args.policy_ms:
            policy = Policy(ms)

            def remote(backend: str, batch: int, at: str = target) -> Any:
                if batch == N:  # no batch_size argument: also for older clients
                    return RemoteGymnasiumVectorEnv(at, N, "CartPole-v1", backend=backend)
                return RemoteGymnasiumVectorEnv(
                    at, N, "CartPole-v1", backend=backend, batch_size=batch
                )

            loops = [
                GymOne("sync", gymnasium.vector.SyncVectorEnv(
                    [lambda: gymnasium.make("CartPole-v1")] * N), policy, None),
                GymOne("gym-1", remote("gymnasium", N), policy, pid),
                GymOne("envpool-1", remote("envpool", N), policy, pid),
            ]  # fmt: skip
            if not args.one_only:
                loops.insert(2, GymTwo("gym-2", remote("gymnasium", HALF), policy, pid))
                loops.append(GymTwo("envpool-2", remote("envpool", HALF), policy, pid))
            if args.base_tree:  # the same systems served by the other checkout, each
                at = base_target  # right after its counterpart
                backends = ("envpool", "gym") if args.base_gym else ("envpool",)
                for name in [loop.name for loop in loops if loop.name.startswith(backends)]:
                    backend = "envpool" if name.startswith("envpool") else "gymnasium"
                    two = name.endswith("-2")
                    made = remote(backend, HALF if two else N, at)
                    base: Loop = (GymTwo if two else GymOne)(f"base:{name}", made, policy,
                                                            base_pid)  # fmt: skip
                    loops.insert([loop.name for loop in loops].index(name) + 1, base)
            try:
                found = rows(measure(loops, args.seconds, args.rounds))
            finally:
                for loop in loops:
                    loop.close()
            report["runs"].append({"env": "CartPole-v1", "policy_ms": ms,
                                   "policy_repeats": policy.repeats, "rows": found})  # fmt: skip
            for row in found:
                log(json.dumps({"env": "CartPole-v1", "policy_ms": ms, **row}))
        report["placement_log"] = MOVE_LINES.get(pid, [])
        if args.base_tree:
            report["base_tree"] = args.base_tree
            report["base_placement_log"] = MOVE_LINES.get(base_pid, [])
    RESULTS.mkdir(exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S")
    path = RESULTS / f"pipelined-{stamp}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
