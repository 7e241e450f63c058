"""Isolated mode under attack: a busy worker never stalls the front, step timeouts kill
and replace a stuck worker, a drain keeps its grace with a hung call, and the env's
``reclaim_orphans`` hook runs at start and after a worker dies.

Every server here is a real ``openenv-grpc serve ... --isolated K`` process. Sessions are
placed on the least-loaded worker, ties to the first, so the first and third session of a
fresh two-worker server share a worker and the second has the other one; the tests check
that with the ``pid`` command of ``support.envs:FaultyEnv`` before relying on it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from openenv_grpc import AsyncSession, EnvError, Session, SessionLost
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc.v1 import session_pb2_grpc as pb_grpc
from openenv_grpc_envs.echo import EchoAction
from support.envs import _process_exists

LOST = "session lost: the environment's worker process died"


def pid_of(env: Session) -> int:  # type: ignore[type-arg]
    """The pid of the worker process that holds ``env``'s environment."""
    return int(env.step(EchoAction(message="pid")).observation.echoed_message)


def three_sessions(target: str) -> tuple[Session, Session, Session]:  # type: ignore[type-arg]
    """Three reset sessions: the first and third on one worker, the second on the other."""
    sessions = (Session(target), Session(target), Session(target))
    for env in sessions:
        env.open()
        env.reset()
    first, second, third = (pid_of(env) for env in sessions)
    assert first == third != second
    return sessions


def in_thread(work, results: dict[str, object], key: str) -> threading.Thread:  # type: ignore[no-untyped-def]
    """Run ``work()`` in a thread; its result or exception lands in ``results[key]``."""

    def run() -> None:
        try:
            results[key] = work()
        except Exception as exc:
            results[key] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def reclaim_calls(ledger: Path) -> list[int]:
    """The pids that called OrphanReclaimingEnv.reclaim_orphans, in order."""
    calls = Path(f"{ledger}.reclaims")
    return [int(line) for line in calls.read_text().split()] if calls.exists() else []


def reclaimed(ledger: Path) -> int:
    return len(list(ledger.glob("*.reclaimed")))


def unread_bytes(pid: int) -> int:
    """Bytes waiting, unread, in the receive queues of ``pid``'s unix sockets (``ss``): a
    frame written to a worker that is busy in a step shows here."""
    out = subprocess.run(["ss", "-xpn"], capture_output=True, text=True, check=True).stdout
    return sum(int(line.split()[2]) for line in out.splitlines() if f",pid={pid}," in line)


#: Enough unread bytes to be a large frame, not a control message.
FRAME_ON_ITS_WAY = 64 * 1024


# -- (a) a busy worker and a 1 MB frame queued for it stall nothing else ---------------


ROUNDS = 30


def test_a_busy_worker_and_a_large_frame_for_it_never_stall_the_front(
    start_server, tmp_path: Path
) -> None:
    """While one worker is held in a step (at a gate only the test opens) and a 1 MB
    action waits for that worker, health, Info and a session on the other worker keep
    answering: ROUNDS of each, every one before the gate opens (a front stalled behind
    the busy worker could answer none of them until then: the health and Info calls
    would hit their 10 s deadline, the step would wait for the gate). The 1 MB answer
    comes only after the gate opens. Latencies are printed, not asserted."""
    server = start_server("support.envs:FaultyEnv", "--isolated", "2")
    busy, other, queued = three_sessions(server.target)
    results: dict[str, object] = {}
    big = "x" * (1 << 20)
    gate = tmp_path / "busy-gate"
    worker = pid_of(busy)
    hung = in_thread(lambda: busy.step(EchoAction(message=f"gate:{gate}")), results, "busy")
    server.wait_until(lambda: Path(f"{gate}.entered").exists(), 30, "the busy step running")
    in_thread(lambda: queued.step(EchoAction(message=big)), results, "queued")
    server.wait_until(
        lambda: unread_bytes(worker) >= FRAME_ON_ITS_WAY, 30, "the 1 MB frame on its way"
    )
    print(f"ISOLATED busy worker: {unread_bytes(worker)} bytes of the 1 MB frame wait for it")
    latencies: dict[str, list[float]] = {"health": [], "info": [], "step": []}
    try:
        with grpc.insecure_channel(server.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            info = pb_grpc.EnvServiceStub(channel)
            calls = {
                "health": lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=10),
                "info": lambda: info.Info(pb.InfoRequest(), timeout=10),
                "step": lambda: other.step(EchoAction(message="quick")),
            }
            for _ in range(ROUNDS):
                for kind, call in calls.items():
                    started = time.perf_counter()
                    call()
                    latencies[kind].append(time.perf_counter() - started)
        # All of them answered while the busy worker was held and the 1 MB frame waited.
        assert hung.is_alive() and "busy" not in results and "queued" not in results
    finally:
        gate.touch()
    summary = {
        kind: (len(values), statistics.median(values), max(values))
        for kind, values in latencies.items()
    }
    print(
        "ISOLATED busy worker: "
        + ", ".join(
            f"{k} n={n} p50={p * 1e3:.1f}ms max={m * 1e3:.1f}ms" for k, (n, p, m) in summary.items()
        )
    )
    assert all(count == ROUNDS for count, _, _ in summary.values()), summary
    server.wait_until(lambda: "queued" in results and "busy" in results, what="both answers")
    for key, message in (("busy", f"gate:{gate}"), ("queued", big)):
        result = results[key]
        assert not isinstance(result, Exception), result
        assert result.observation.echoed_message == message  # type: ignore[attr-defined]
    for env in (busy, other, queued):
        env.close()
    server.wait_until(lambda: server.closed_envs() == 3, what="every env closed")


def test_a_worker_killed_with_a_large_frame_half_sent_ends_only_its_sessions(
    start_server, tmp_path: Path
) -> None:
    """A 1 MB action waits, partly written, for a busy worker that is then SIGKILLed: both
    sessions on it are lost, the other worker's session and health go on, and the
    replacement worker takes new sessions."""
    server = start_server("support.envs:FaultyEnv", "--isolated", "2")
    busy, other, queued = three_sessions(server.target)
    worker = pid_of(busy)
    results: dict[str, object] = {}
    gate = tmp_path / "never-opened"  # the worker is killed in the step
    threads = [in_thread(lambda: busy.step(EchoAction(message=f"gate:{gate}")), results, "busy")]
    server.wait_until(lambda: Path(f"{gate}.entered").exists(), 30, "the busy step running")
    threads.append(
        in_thread(lambda: queued.step(EchoAction(message="x" * (1 << 20))), results, "queued")
    )
    server.wait_until(
        lambda: unread_bytes(worker) >= FRAME_ON_ITS_WAY, 30, "the 1 MB frame half sent"
    )
    print(f"ISOLATED killed worker: {unread_bytes(worker)} bytes of the 1 MB frame unread")
    assert "busy" not in results and "queued" not in results  # both still wait
    os.kill(worker, signal.SIGKILL)
    for thread in threads:
        thread.join(10)
    for key in ("busy", "queued"):
        assert isinstance(results[key], SessionLost), results[key]
        assert results[key].message == LOST  # type: ignore[attr-defined]
    assert other.step(EchoAction(message="fine")).observation.echoed_message == "fine"
    assert server.health() == health_pb2.HealthCheckResponse.SERVING
    with Session(server.target) as fresh:
        fresh.reset()
        assert pid_of(fresh) not in (worker, pid_of(other))
    other.close()
    server.wait_until(lambda: server.active() == 0, what="slots released")


# -- (b) step timeouts: the stuck worker is killed, the session gets a fresh env --------


def test_a_step_past_the_timeout_replaces_the_stuck_worker(start_server, tmp_path: Path) -> None:
    """A step held at a gate that never opens: DEADLINE_EXCEEDED (the gate would have
    given up with a RuntimeError, an INTERNAL error, only after 30 s, so the answer is
    the timeout's), the stuck worker is killed and replaced, its other session lost."""
    server = start_server(
        "support.envs:OrphanReclaimingEnv", "--isolated", "2", "--step-timeout", "1"
    )
    hung, other, neighbour = three_sessions(server.target)
    stuck_pid, other_pid = pid_of(hung), pid_of(other)
    gate = tmp_path / "never-opened"
    started = time.monotonic()
    with pytest.raises(EnvError) as failed:
        hung.step(EchoAction(message=f"gate:{gate}"))
    elapsed = time.monotonic() - started
    print(f"ISOLATED step timeout 1s: DEADLINE_EXCEEDED after {elapsed:.2f}s")
    assert Path(f"{gate}.entered").exists()  # the env call did start
    assert failed.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert failed.value.message == (
        "step did not finish within 1s; the environment was replaced with a fresh one: call reset"
    )
    assert elapsed >= 0.9, elapsed  # not before the timeout (a lower bound)
    server.wait_until(lambda: not _process_exists(stuck_pid), what="stuck worker killed")
    # The session goes on with a fresh env, on the live worker.
    with pytest.raises(EnvError) as early:
        hung.step(EchoAction(message="too early"))
    assert early.value.code is grpc.StatusCode.FAILED_PRECONDITION
    hung.reset()
    assert pid_of(hung) == other_pid
    assert hung.step(EchoAction(message="fresh")).observation.echoed_message == "fresh"
    # The other session on the killed worker lost its env, as on a crash.
    with pytest.raises(SessionLost) as lost:
        neighbour.step(EchoAction(message="anyone there?"))
    assert lost.value.code is grpc.StatusCode.UNAVAILABLE
    assert lost.value.message == (
        "session lost: the environment's worker process was stopped: another session's "
        "call on it did not finish within 1s"
    )
    assert other.step(EchoAction(message="unaffected")).observation.echoed_message == "unaffected"
    server.wait_until(lambda: server.active() == 2, what="the lost session released")
    # The stuck worker was replaced: a new session lands on a third process.
    with Session(server.target) as newcomer:
        newcomer.reset()
        new_pid = pid_of(newcomer)
        assert new_pid not in (stuck_pid, other_pid)
        assert fetch_capacity(server.target) == (1024, 3)
    for env in (hung, other):
        env.close()
    server.wait_until(lambda: server.active() == 0, what="slots released")
    # No env leaks: the two on the killed worker were reclaimed, every other one closed.
    server.wait_until(lambda: reclaimed(server.ledger) == 2, what="killed envs reclaimed")
    assert server.closed_envs() == 3  # other's, hung's fresh one and the newcomer's
    assert server.open_envs() == 0
    assert server.proc.poll() is None


def fetch_capacity(target: str) -> tuple[int, int]:
    with grpc.insecure_channel(target) as channel:
        capacity = pb_grpc.EnvServiceStub(channel).Info(pb.InfoRequest(), timeout=10).capacity
    return capacity.max_sessions, capacity.active_sessions


def test_a_close_past_the_timeout_ends_the_session_and_frees_its_slot(start_server) -> None:
    """An env whose ``close`` hangs: the in-band close answers DEADLINE_EXCEEDED and ends
    the stream; a cancelled session's close kills its worker. Both slots are freed in
    about the timeout, not the 60 s hang."""
    server = start_server("support.envs:FaultyEnv", "--isolated", "2", "--step-timeout", "1")
    closing, aborting = Session(server.target), Session(server.target)
    pids = []
    for env in (closing, aborting):
        env.open()
        env.reset()
        pids.append(pid_of(env))
        env.step(EchoAction(message="slow-close:60"))
    assert pids[0] != pids[1]
    started = time.monotonic()
    with pytest.raises(EnvError) as failed:
        closing.close()
    assert failed.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert failed.value.message == (
        "close did not finish within 1s; the environment's worker process was stopped"
    )
    aborting.abort()
    # The closes hang for 60 s: freed slots within this deadline are the timeout's doing.
    server.wait_until(lambda: server.active() == 0, timeout=30, what="both slots freed")
    print(f"ISOLATED close timeout 1s: both slots freed after {time.monotonic() - started:.2f}s")
    assert server.closed_envs() == 0  # neither close returned: the workers were killed
    for pid in pids:
        server.wait_until(lambda pid=pid: not _process_exists(pid), what=f"worker {pid} killed")
    with Session(server.target) as fresh:  # both workers were replaced
        fresh.reset()
        assert fresh.step(EchoAction(message="ok")).observation.echoed_message == "ok"


def test_a_failed_replacement_after_a_timeout_ends_the_session(start_server) -> None:
    server = start_server(
        "support.envs:FlakyFactoryEnv", "--isolated", "1", "--step-timeout", "0.5"
    )
    with Session(server.target) as env:
        env.reset()
        Path(f"{server.ledger}.no-factory").touch()
        # The timeout is answered at once; the fresh env is made meanwhile (issue 19).
        with pytest.raises(EnvError) as timed_out:
            env.step(EchoAction(message="sleep:60"))
        assert timed_out.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        # The next request learns that it could not be made, and the session ends.
        with pytest.raises(EnvError) as failed:
            env.reset()
        assert failed.value.code is grpc.StatusCode.INTERNAL
        assert failed.value.message == (
            "the environment hung and a new one could not be created: "
            "RuntimeError: the factory is switched off"
        )
        with pytest.raises(SessionLost):  # the stream ended after that answer
            env.reset()
    server.wait_until(lambda: server.active() == 0, what="slot released")
    Path(f"{server.ledger}.no-factory").unlink()
    with Session(server.target) as fresh:
        fresh.reset()


def test_an_async_env_past_the_timeout_is_cancelled_in_its_worker(start_server) -> None:
    """Async envs are cancelled inside the worker, as in-process: the worker lives and
    its other sessions keep their envs."""
    server = start_server("support.envs:AsyncEchoEnv", "--isolated", "1", "--step-timeout", "0.3")
    with Session(server.target) as slow, Session(server.target) as neighbour:
        slow.reset()
        neighbour.reset()
        neighbour.step(EchoAction(message="before"))
        cancels = Path(f"{server.ledger}.cancelled")
        started = time.monotonic()
        with pytest.raises(EnvError) as failed:
            slow.step(EchoAction(message="sleep:60"))
        assert failed.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "within 0.3s" in failed.value.message
        # The call was cancelled in the worker (the env says so, with the worker's pid).
        server.wait_until(cancels.exists, 10, "the cancel in the worker")
        [worker] = [int(pid) for pid in cancels.read_text().split()]
        assert worker != server.proc.pid
        # Not an event to wait for but one that must not come: the front's watchdog for
        # this call (timeout + a 1 s margin from its start) must have been disarmed by the
        # worker's answer. Wait its deadline out, touching nothing that would re-arm it.
        time.sleep(max(0.0, started + 0.3 + 1.0 + 0.5 - time.monotonic()))
        assert _process_exists(worker), "the front killed the worker"
        assert "killing it" not in server.stderr()
        assert neighbour.step(EchoAction(message="after")).observation.echoed_message == "after"
        slow.reset()
        assert slow.step(EchoAction(message="again")).observation.echoed_message == "again"
    server.wait_until(lambda: server.closed_envs() == 3, what="every env closed")


def test_a_session_cancelled_while_its_env_is_built_leaks_nothing(start_server) -> None:
    server = start_server("support.envs:SlowStartEnv", "--isolated", "1")

    async def give_up() -> None:
        session = AsyncSession(server.target)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(session.open(), 0.3)

    asyncio.run(give_up())
    server.wait_until(lambda: server.created() == 1, what="the env was built")
    server.wait_until(lambda: server.closed_envs() == 1, what="and then closed")
    server.wait_until(lambda: server.active() == 0, what="slot released")


# -- (c) drain keeps its grace with a hung call ----------------------------------------


def test_drain_with_a_hung_call_exits_within_the_grace(start_server, tmp_path: Path) -> None:
    """A step held at a gate that never opens (it would give up after 30 s): the drain
    kills its worker once the grace is over and the process exits 0 before the gate would
    give up, with the hung env reclaimed and every other env closed."""
    server = start_server("support.envs:OrphanReclaimingEnv", "--isolated", "2", "--grace", "2")
    hung, other, neighbour = three_sessions(server.target)
    results: dict[str, object] = {}
    gate = tmp_path / "never-opened"
    in_thread(lambda: hung.step(EchoAction(message=f"gate:{gate}")), results, "hung")
    server.wait_until(lambda: Path(f"{gate}.entered").exists(), 30, "the hung step running")
    started = time.monotonic()
    try:
        code = server.terminate(timeout=20)  # a deadline short of the gate's 30 s
    finally:
        for env in (hung, other, neighbour):
            env.abort()
    elapsed = time.monotonic() - started
    print(f"ISOLATED drain with a hung call: exit {code} after {elapsed:.2f}s (grace 2s)")
    assert code == 0
    # The healthy worker closed its env, and the killed worker closed the idle one it
    # shared with the hung call on its side thread (issue 19); the hung one was reclaimed.
    assert server.closed_envs() == 2
    assert reclaimed(server.ledger) == 1
    assert server.open_envs() == 0


# -- (d) reclaim_orphans at start and after a worker dies ------------------------------


def test_reclaim_orphans_runs_at_start_and_after_a_worker_is_killed(
    start_server, tmp_path: Path
) -> None:
    # A previous run, SIGKILLed with an env open, leaves a ledger entry behind.
    previous = start_server("support.envs:OrphanReclaimingEnv")
    ledger = previous.ledger
    env = Session(previous.target)
    env.open()
    env.reset()
    os.killpg(previous.proc.pid, signal.SIGKILL)
    previous.proc.wait(10)
    env.abort()
    assert reclaim_calls(ledger) == [previous.proc.pid]  # threaded servers call it at start
    assert previous.open_envs() == 1
    server = start_server(
        "support.envs:OrphanReclaimingEnv",
        "--isolated",
        "2",
        extra_env={"OPENENV_TEST_LEDGER": str(ledger)},
    )
    assert reclaim_calls(ledger) == [previous.proc.pid, server.proc.pid]  # before serving
    assert reclaimed(ledger) == 1 and previous.open_envs() == 0
    with Session(server.target) as doomed, Session(server.target) as survivor:
        doomed.reset()
        survivor.reset()
        worker = pid_of(doomed)
        assert worker != pid_of(survivor)
        results: dict[str, object] = {}
        gate = tmp_path / "never-opened"  # the worker is killed in the step
        stepping = in_thread(
            lambda: doomed.step(EchoAction(message=f"gate:{gate}")), results, "doomed"
        )
        server.wait_until(lambda: Path(f"{gate}.entered").exists(), 30, "the step running")
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        stepping.join(10)
        assert isinstance(results["doomed"], SessionLost)
        assert results["doomed"].message == LOST  # type: ignore[attr-defined]
        server.wait_until(lambda: len(reclaim_calls(ledger)) == 3, what="reclaim after the kill")
        print(f"ISOLATED reclaim_orphans {time.monotonic() - killed:.2f}s after the SIGKILL")
        assert reclaim_calls(ledger)[2] == server.proc.pid  # the front calls it
        assert reclaimed(ledger) == 2  # the killed worker's env; the survivor's untouched
        assert previous.open_envs() == 1
        assert survivor.step(EchoAction(message="alive")).observation.echoed_message == "alive"
    server.wait_until(lambda: server.active() == 0, what="slots released")


def test_opens_right_after_a_worker_is_killed_land_on_a_live_worker(start_server) -> None:
    """A worker killed a moment before the front notices: opens that picked it are made on
    another worker instead of failing with INTERNAL "could not create the environment"."""
    server = start_server("support.envs:FaultyEnv", "--isolated", "2")
    with Session(server.target) as probe:
        probe.reset()
        for _ in range(5):
            victim = pid_of(probe)
            os.kill(victim, signal.SIGKILL)

            async def open_many() -> list[str]:
                async def one() -> str:
                    async with AsyncSession(server.target) as env:
                        await env.reset()
                        return (await env.step(EchoAction(message="ok"))).observation.echoed_message  # type: ignore[attr-defined,no-any-return]

                return await asyncio.gather(*(one() for _ in range(4)))

            assert asyncio.run(open_many()) == ["ok"] * 4
            with pytest.raises(SessionLost):  # the probe's env died with its worker
                probe.step(EchoAction(message="x"))
            probe.close()
            probe.open()
            probe.reset()


# -- issue 19: the rough edges of --isolated 1 ------------------------------------------


@pytest.mark.timeout(300)  # two bridged env processes start: slow on a loaded machine
def test_a_bridged_step_past_the_timeout_is_answered_before_its_replacement_exists(
    tmp_path: Path,
) -> None:
    """Under the OpenEnv bridge with ``--isolated 1``, a 2 s step timeout was answered
    after 12.9 s: the DEADLINE_EXCEEDED waited for the killed worker's replacement to
    start and make the fresh env. Now it is answered at the timeout, and the fresh env is
    made meanwhile (here held at a gate until the answer came: the event that proves it);
    the session's next request waits for it and goes on."""
    from openenv_grpc.integrations.openenv import described_session
    from openenv_grpc.testing import ServerProcess

    gate = tmp_path / "replacement"
    server = ServerProcess(
        "--openenv=support.openenv_sleepy:SleepyEnvironment",
        ["--isolated", "1", "--step-timeout", "2"],
        {"SLEEPY_GATE": str(gate)},
        pythonpath=[Path(__file__).resolve().parent],
    )
    try:
        Env = described_session(server.target)
        with Env(server.target) as env:
            env.reset()
            Path(f"{gate}.hold").touch()  # from now on a new env waits at the gate
            with pytest.raises(EnvError) as failed:
                env.step(Env.Action(seconds=60))
            assert failed.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
            assert "step did not finish within 2s" in failed.value.message
            assert not gate.exists()  # answered while the fresh env was not made yet
            gate.touch()
            env.reset()
            assert env.step(Env.Action(seconds=0)).step_count == 1
            assert Path(f"{gate}.entered").exists()  # the fresh env did wait at the gate
        server.wait_until(lambda: server.active() == 0, 10, "the slot freed")
    finally:
        server.stop()


def test_an_open_never_waits_behind_another_sessions_step(start_server, tmp_path: Path) -> None:
    """``--isolated 1``, the one env process busy in a step (held at a gate): a new
    session opens, resets and steps while that step still runs (before: it waited for
    it, 4.8 s behind a 5 s step). It gets a worker of its own, which retires once its
    env is closed; the pool is back to one process."""
    server = start_server("support.envs:FaultyEnv", "--isolated", "1")
    gate = tmp_path / "step-gate"
    busy = Session(server.target)
    busy.open()
    busy.reset()
    busy_pid = pid_of(busy)
    results: dict[str, object] = {}
    thread = in_thread(lambda: busy.step(EchoAction(message=f"gate:{gate}")), results, "busy")
    server.wait_until(lambda: Path(f"{gate}.entered").exists(), 30, "the step running")
    with Session(server.target) as fresh:
        fresh.reset()
        assert pid_of(fresh) != busy_pid  # a worker of its own
        assert fresh.step(EchoAction(message="hello")).step_count == 2
        assert thread.is_alive() and "busy" not in results  # the other step still runs
    gate.touch()
    thread.join(30)
    assert results["busy"].step_count == 2  # type: ignore[attr-defined]
    assert pid_of(busy) == busy_pid
    # A vector stream too: made and stepped while the busy step runs again.
    from openenv_grpc import VectorSession

    second = tmp_path / "second-gate"
    thread = in_thread(lambda: busy.step(EchoAction(message=f"gate:{second}")), results, "again")
    server.wait_until(lambda: Path(f"{second}.entered").exists(), 30, "the step running again")
    with VectorSession(server.target, 2) as envs:
        envs.reset()
        assert envs.step([EchoAction(message="a"), EchoAction(message="b")]).step_counts == [1, 1]
        assert thread.is_alive() and "again" not in results
    second.touch()
    thread.join(30)
    busy.close()
    server.wait_until(lambda: "retired (1 now)" in server.stderr(), 10, "the extra worker retired")
    server.wait_until(lambda: server.active() == 0, 10, "no session left")
    server.wait_until(lambda: server.closed_envs() == 4, 10, "every env closed")
    assert server.created() == 4


def test_a_drain_closes_the_envs_that_share_a_worker_with_a_hung_call(
    start_server, tmp_path: Path
) -> None:
    """``--isolated 1 --grace 2``: three held sessions on the one env process, one of them
    hung in a step for good. Before: their closes queued behind the hung call, the
    sessions ended at grace + 2 s when the drain killed the process, 0 of 3 envs closed.
    Now the two idle envs are closed on the env process's side thread at the grace's
    end, without waiting for the hung call; the process exits within grace + 3 s."""
    grace = 2.0
    server = start_server("support.envs:FaultyEnv", "--isolated", "1", "--grace", str(grace))
    gate = tmp_path / "never-opened"
    sessions = [Session(server.target) for _ in range(3)]
    for env in sessions:
        env.open()
        env.reset()
    assert len({pid_of(env) for env in sessions}) == 1  # one process holds all three
    results: dict[str, object] = {}
    in_thread(lambda: sessions[0].step(EchoAction(message=f"gate:{gate}")), results, "hung")
    server.wait_until(lambda: Path(f"{gate}.entered").exists(), 30, "the hung step running")
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    # A deadline short of the gate's 30 s: the exit did not wait for the hung call.
    assert server.proc.wait(20) == 0
    elapsed = time.monotonic() - signalled
    print(f"\n--isolated 1 drain with a hung call, --grace {grace:g}: exit 0 after {elapsed:.2f}s")
    assert server.created() == 3
    assert server.closed_envs() == 2  # every env but the hung one's
    for env in sessions[1:]:
        with pytest.raises(SessionLost) as lost:
            env.state()
        assert lost.value.code is grpc.StatusCode.UNAVAILABLE


def test_a_hung_vector_block_is_answered_before_its_replacement_exists(start_server) -> None:
    """The vector form of the bridged case above: ``--isolated 1``, a block's step past
    the timeout is answered (DEADLINE_EXCEEDED for its envs) while its fresh sub-batch is
    still being made (held at a factory gate here); the next call waits for it."""
    from openenv_grpc import VectorSession

    server = start_server(
        "support.lifecycle_envs:GatedFactoryEnv", "--isolated", "1", "--step-timeout", "1"
    )
    hold = Path(f"{server.ledger}.hold-factory")
    gate = Path(f"{server.ledger}.factory-gate")
    with VectorSession(server.target, 2) as envs:
        envs.reset()
        hold.touch()  # from now on a new env waits at the gate
        out = envs.step([EchoAction(message="sleep:60"), EchoAction(message="x")])
        assert out.indices == []
        for index in (0, 1):
            assert out.errors[index].code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert not gate.exists()  # answered while the fresh sub-batch was not made yet
        server.wait_until(
            lambda: len(list(gate.parent.glob(f"{gate.name}.*.entered"))) >= 1,
            30,
            "the fresh sub-batch's factory waiting at the gate",
        )
        hold.unlink()
        gate.touch()
        envs.reset()
        assert envs.step([EchoAction(message="a"), EchoAction(message="b")]).step_counts == [1, 1]
    server.wait_until(lambda: server.active() == 0, 10, "the slots freed")
