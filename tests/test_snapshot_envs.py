"""The catalogue's snapshots over real servers and real gRPC: for echo, wordle, openspiel
(a random opponent; chance deals), gymnasium (CartPole, slippery FrozenLake, Pong) and
coding, a snapshot taken on one server continues exactly on a second server process with
the same key, and forks continue exactly like their parent; with recovery on, an
unseeded episode survives its server's SIGKILL on a fallback. The ids and games that
cannot snapshot answer UNIMPLEMENTED (a workspace too large: INVALID_ARGUMENT) saying
why, and their sessions go on."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

from openenv_grpc import EnvError, Session
from openenv_grpc.client import Recovery
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.coding import CodingAction, CodingEnv, CodingLimits, CodingResetOptions
from openenv_grpc_envs.echo import EchoAction, EchoEnv, EchoResetOptions
from openenv_grpc_envs.gymnasium import GymnasiumAction, GymnasiumEnv, GymnasiumResetOptions, Value
from openenv_grpc_envs.openspiel import OpenSpielAction, OpenSpielEnv, OpenSpielResetOptions
from openenv_grpc_envs.wordle import WordleAction, WordleEnv

pytestmark = pytest.mark.timeout(120)

KEYS = "k1:0123456789abcdef0123456789abcdef"
#: (step number, observation, generator) -> the action to send.
Act = Callable[[int, Any, random.Random], Message]
Trace = list[tuple[bytes, float, bool, bool, int]]


def _timeless(observation: Any) -> bytes:
    """A coding observation without its timings (they differ from run to run)."""
    copy = type(observation)()
    copy.CopyFrom(observation)
    copy.wall_seconds = copy.cpu_seconds = 0.0
    return bytes(copy.SerializeToString())


def _no_fold(observation: Any) -> list[Any]:
    """Poker moves that keep the hand going (so the deal's chance nodes come up)."""
    return [a for a in observation.legal_actions if a.name != "Fold"]


@dataclass(frozen=True)
class Case:
    name: str
    server: str
    client: type[Session[Any, Any, Any, Any]]
    options: Message | None
    act: Act
    #: Steps played before the snapshot, and after it.
    prefix: int = 3
    steps: int = 12
    comparable: Callable[[Any], bytes] = lambda o: bytes(o.SerializeToString())


WORDS = ["crane", "sloth", "pious", "dumpy", "gawky", "fixed", "jumbo"]
CODE = "import os\nopen(f'step{0}', 'w').write('x' * {0})\nprint(sorted(os.listdir('.')))"
FAST = CodingLimits(cpu_seconds=2, wall_ms=8000, memory_mb=128, processes=16)

CASES = [
    Case("echo", "echo", EchoEnv, EchoResetOptions(max_steps=10),
         lambda i, _o, rng: EchoAction(message=f"m{i}-{rng.randrange(100)}")),
    Case("wordle", "wordle", WordleEnv, None,
         lambda _i, o, _rng: WordleAction(guess=WORDS[o.turn]), prefix=2, steps=5),
    Case("tic_tac_toe", "openspiel", OpenSpielEnv, OpenSpielResetOptions(game="tic_tac_toe"),
         lambda _i, o, rng: OpenSpielAction(id=rng.choice(o.legal_actions).id), prefix=1),
    Case("leduc_poker", "openspiel", OpenSpielEnv, OpenSpielResetOptions(game="leduc_poker"),
         lambda _i, o, rng: OpenSpielAction(id=rng.choice(_no_fold(o)).id), prefix=0),
    Case("CartPole-v1", "gymnasium", GymnasiumEnv, GymnasiumResetOptions(env_id="CartPole-v1"),
         lambda i, _o, _rng: GymnasiumAction(value=Value(discrete=i % 2)), steps=30),
    Case("FrozenLake-v1", "gymnasium", GymnasiumEnv,
         GymnasiumResetOptions(env_id="FrozenLake-v1", max_episode_steps=40),
         lambda _i, _o, rng: GymnasiumAction(value=Value(discrete=rng.randrange(4))), steps=30),
    Case("Pong", "gymnasium", GymnasiumEnv, GymnasiumResetOptions(env_id="ALE/Pong-v5"),
         lambda _i, _o, rng: GymnasiumAction(value=Value(discrete=rng.randrange(6))), steps=40),
    Case("coding", "coding", CodingEnv, CodingResetOptions(limits=FAST),
         lambda i, _o, _rng: CodingAction(code=CODE.format(i)), prefix=2, steps=2,
         comparable=_timeless),
]  # fmt: skip


@pytest.fixture(scope="module")
def servers() -> Iterator[Callable[[str, str], ServerProcess]]:
    """Servers by (env, role), started on first use and kept for the module; every one
    holds the same snapshot key."""
    started: dict[tuple[str, str], ServerProcess] = {}

    def server(env: str, role: str) -> ServerProcess:
        if (env, role) not in started:
            started[env, role] = ServerProcess(
                env, ["--max-concurrent-envs", "0"], {"SNAPSHOT_KEYS": KEYS}
            )
        return started[env, role]

    yield server
    for process in started.values():
        process.stop()


def play(case: Case, env: Session[Any, Any, Any, Any], observation: Any, first: int) -> Trace:
    """``case.steps`` steps (fewer if the episode ends) from step number ``first``."""
    rng = random.Random(first)
    trace: Trace = []
    for i in range(first, first + case.steps):
        result = env.step(case.act(i, observation, rng))
        observation = result.observation
        trace.append(
            (case.comparable(observation), result.reward, result.terminated, result.truncated,
             result.step_count)
        )  # fmt: skip
        if result.terminated or result.truncated:
            break
    return trace


def prefix(case: Case, env: Session[Any, Any, Any, Any], seed: int | None = 21) -> Any:
    """Reset (with ``seed``) and play the prefix; the last observation."""
    observation = env.reset(seed=seed, options=case.options).observation
    rng = random.Random(0)
    for i in range(case.prefix):
        observation = env.step(case.act(i, observation, rng)).observation
    return observation


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_snapshot_continues_exactly_on_another_server(
    case: Case, servers: Callable[[str, str], ServerProcess]
) -> None:
    with case.client(servers(case.server, "a").target) as env:
        observation = prefix(case, env)
        data = env.snapshot()
        expected = play(case, env, observation, case.prefix)
    assert expected
    with case.client(servers(case.server, "b").target) as fresh:  # a fresh session, never reset
        restored = fresh.restore(data)
        assert restored.step_count == case.prefix
        assert play(case, fresh, observation, case.prefix) == expected


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forks_continue_like_their_parent(
    case: Case, servers: Callable[[str, str], ServerProcess]
) -> None:
    with case.client(servers(case.server, "a").target) as env:
        observation = prefix(case, env)
        forks = env.fork(3)
        try:
            expected = play(case, env, observation, case.prefix)
            for fork in forks:
                assert play(case, fork, observation, case.prefix) == expected
        finally:
            for fork in forks:
                fork.close()


REFUSED = [
    ("gymnasium", GymnasiumEnv, GymnasiumResetOptions(env_id="LunarLander-v3"),
     GymnasiumAction(value=Value(discrete=0)),
     "LunarLander-v3 cannot snapshot: Box2D envs hold a pybox2d world",
     grpc.StatusCode.UNIMPLEMENTED),
    ("openspiel", OpenSpielEnv, OpenSpielResetOptions(game="negotiation"), None,
     "negotiation() cannot snapshot: its state does not deserialize in OpenSpiel",
     grpc.StatusCode.UNIMPLEMENTED),
    ("coding", CodingEnv, CodingResetOptions(limits=FAST),
     CodingAction(code="open('big', 'wb').write(b'x' * (5 << 20))"),
     "the working directory is too large to snapshot: more than 4194304 bytes of files",
     grpc.StatusCode.INVALID_ARGUMENT),
]  # fmt: skip


@pytest.mark.parametrize(("server", "client", "options", "action", "message", "code"), REFUSED,
                         ids=[r[0] for r in REFUSED])  # fmt: skip
def test_what_cannot_snapshot_says_why_and_the_session_goes_on(
    servers: Callable[[str, str], ServerProcess],
    server: str,
    client: type[Session[Any, Any, Any, Any]],
    options: Message,
    action: Message | None,
    message: str,
    code: grpc.StatusCode,
) -> None:
    with client(servers(server, "a").target) as env:
        first = env.reset(seed=3, options=options).observation
        if action is None:  # openspiel: any legal move
            action = OpenSpielAction(id=first.legal_actions[0].id)
        env.step(action)
        with pytest.raises(EnvError) as refused:
            env.snapshot()
        assert refused.value.code == code
        assert message in refused.value.message
        assert env.state() is not None  # the session goes on
        assert env.reset(seed=3, options=options).step_count == 0


RECOVERED = [c for c in CASES if c.name in ("tic_tac_toe", "CartPole-v1", "coding")]


@pytest.mark.parametrize("case", RECOVERED, ids=lambda c: c.name)
def test_recovery_finishes_the_episode_on_a_fallback_after_a_sigkill(case: Case) -> None:
    """An *unseeded* episode (only a snapshot can bring it back) is SIGKILLed mid-way;
    with recovery on, the session goes on on the fallback server (same key) and plays
    what a twin restored from the same snapshot plays: the same step counts and rewards
    (the random opponent's moves included, for tic-tac-toe)."""
    first = ServerProcess(case.server, [], {"SNAPSHOT_KEYS": KEYS})
    fallback = ServerProcess(case.server, [], {"SNAPSHOT_KEYS": KEYS})
    try:
        recovery = Recovery(every=1, targets=[fallback.target])
        with case.client(first.target, recovery=recovery) as env:
            observation = prefix(case, env, seed=None)
            data = env.snapshot()
            with case.client(fallback.target) as twin:
                twin.restore(data)
                expected = play(case, twin, observation, case.prefix)
            first.proc.kill()  # SIGKILL: no drain, no goodbye
            first.proc.wait(10)
            assert play(case, env, observation, case.prefix) == expected
            assert env.recoveries == 1
    finally:
        first.stop()
        fallback.stop()
