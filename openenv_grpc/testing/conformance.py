"""The conformance suite: what every environment must do over the protocol.

Subclass :class:`EnvConformance` in a pytest module, name the environment, and say how
to make a valid action; pytest then runs every check against a real server process::

    from openenv_grpc.testing import EnvConformance
    from openenv_grpc_envs.echo import EchoAction, EchoResetOptions

    class TestEchoConformance(EnvConformance):
        env = "echo"                       # or "my_package.module:MyEnv"

        def make_action(self, observation, step, rng):
            return EchoAction(message=f"message {step}")

        def ending_reset_options(self):    # options under which an episode ends
            return EchoResetOptions(max_steps=3)

The checks: the Info RPC declares the types the env really sends and its
FileDescriptorSet decodes a real observation; reset/step/state round trips; seeded
determinism; terminated/truncated, then reset on the same session; step before reset;
a wrong-typed action; concurrent sessions that never see each other's state; close
releases every session (plus :meth:`EnvConformance.check_released` for env resources).

Snapshots: an env whose Info says it supports them (set ``snapshots = True`` to fail when
it does not) must restore a snapshot so that the same actions give the same trajectory
-- on the same session, in a fresh session, in forks, and on a fresh server process with
the same key (the suite gives its servers a random ``SNAPSHOT_KEYS``, so an env that
keeps snapshot state in server memory fails) -- and refuse a tampered one with the
episode going on. An env without them must answer ``UNIMPLEMENTED`` and keep working.

Every check also holds for an env whose observations are not fully deterministic (set
``deterministic = False``, e.g. observations that carry timings): override
:meth:`EnvConformance.comparable` to return the part that must repeat, and the seeded and
isolation checks compare that part. Without the override they compare no observations,
but each session's own bookkeeping is always checked -- step counts that go up by one per
step from 0 after each reset, the client's episode id echoed on every result, and
sessions stepped interleaved that never move each other's step counts or episode ids.
"""

from __future__ import annotations

import asyncio
import random
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import grpc
import pytest
from google.protobuf import duration_pb2
from google.protobuf.message import Message

from openenv_grpc.client.async_session import AsyncSession
from openenv_grpc.client.errors import EnvError
from openenv_grpc.client.info import message_classes
from openenv_grpc.client.outcome import StepOutcome
from openenv_grpc.client.sync_session import Session
from openenv_grpc.testing.server_process import ServerProcess
from openenv_grpc.v1 import session_pb2 as pb

__all__ = ["EnvConformance"]

_Trace = list[tuple[bytes, float | None, bool, bool]]
#: What the server's bookkeeping said for each result of an episode.
_Books = list[tuple[str, int]]

_UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED


@dataclass(frozen=True, slots=True)
class _Branch:
    """A snapshot taken mid-episode and what the episode did after it."""

    snapshot: bytes
    #: The episode id and step count at the snapshot.
    at: tuple[str, int]
    #: The actions taken after it, and what they gave.
    actions: list[Message]
    trace: _Trace
    books: _Books


class EnvConformance:
    """Base class of an environment's conformance tests; see the module docstring."""

    #: What ``openenv-grpc serve`` gets: a packaged env name or ``module:factory``.
    env: ClassVar[str]
    #: Extra ``serve`` flags.
    server_args: ClassVar[Sequence[str]] = ()
    #: Extra environment variables for the server process.
    server_env: ClassVar[dict[str, str]] = {}
    #: Folders to prepend to the server's PYTHONPATH (for ``module:factory`` envs).
    server_pythonpath: ClassVar[Sequence[str]] = ()
    #: Seed used by the determinism and isolation checks.
    seed: ClassVar[int] = 1234
    #: Steps played per episode by the determinism and isolation checks (fewer if done).
    steps: ClassVar[int] = 8
    #: An episode started with ``ending_reset_options()`` must end within this many steps.
    max_steps_to_end: ClassVar[int] = 1000
    #: Sessions stepped at once by the isolation check.
    concurrent_sessions: ClassVar[int] = 6
    #: Same seed and same actions give the same observations (set False if not).
    deterministic: ClassVar[bool] = True
    #: The env supports snapshots: True or False makes the suite fail when Info says
    #: otherwise; None goes by Info.
    snapshots: ClassVar[bool | None] = None

    # -- what a subclass provides -----------------------------------------------------

    def make_action(self, observation: Any, step: int, rng: random.Random) -> Message:
        """A valid action for ``observation`` (a decoded observation message)."""
        raise NotImplementedError

    def reset_options(self) -> Message | None:
        """Reset options used by every check but the ending one; None sends none."""
        return None

    def ending_reset_options(self) -> Message | None:
        """Reset options under which an episode ends within ``max_steps_to_end`` steps."""
        return self.reset_options()

    def check_released(self, server: ServerProcess) -> None:
        """Assert that the env's own resources are gone once its sessions closed."""

    def comparable(self, observation: Message) -> Message:
        """The part of ``observation`` that must repeat for the same seed and actions: all
        of it by default. An env with ``deterministic = False`` returns a copy without
        the fields that vary from run to run (timings, say)."""
        return observation

    @property
    def _compares(self) -> bool:
        """Whether the seeded and isolation checks compare observations."""
        overridden = type(self).comparable is not EnvConformance.comparable
        return self.deterministic or overridden

    # -- fixtures ---------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def conformance_environ(cls) -> dict[str, str]:
        """The servers' environment: ``server_env`` and, unless it names keys, a random
        snapshot key shared by every server of this class."""
        return {"SNAPSHOT_KEYS": f"conformance:{secrets.token_hex(16)}", **cls.server_env}

    @pytest.fixture(scope="class")
    @classmethod
    def conformance_server(cls, conformance_environ: dict[str, str]) -> Iterator[ServerProcess]:
        server = cls._start_server(conformance_environ)
        yield server
        server.stop()

    @classmethod
    def _start_server(cls, environ: dict[str, str]) -> ServerProcess:
        return ServerProcess(
            cls.env,
            ["--max-concurrent-envs", "0", *cls.server_args],
            environ,
            pythonpath=cls.server_pythonpath,
        )

    # -- helpers ----------------------------------------------------------------------

    def _play(
        self, env: Session[Any, Any, Any, Any], seed: int, episode_id: str | None = None
    ) -> _Trace:
        """One seeded episode of ``steps`` steps (or until done); what it observed. The
        server's bookkeeping is checked on the way: step counts 0, 1, 2, ... and one
        episode id (``episode_id`` when given) on every result."""
        rng = random.Random(seed)
        result = env.reset(seed=seed, episode_id=episode_id, options=self.reset_options())
        trace, books = [self._entry(result)], [_books(result)]
        for step in range(self.steps):
            if result.done:
                break
            result = env.step(self.make_action(result.observation, step, rng))
            trace.append(self._entry(result))
            books.append(_books(result))
        _check_books(books, episode_id)
        return trace

    def _entry(self, result: StepOutcome[Any]) -> tuple[bytes, float | None, bool, bool]:
        observation = self.comparable(result.observation).SerializeToString(deterministic=True)
        reward = None if result.no_reward else result.reward  # no reward differs from 0
        return observation, reward, result.terminated, result.truncated

    # -- the checks -------------------------------------------------------------------

    def test_info_declares_types(self, conformance_server: ServerProcess) -> None:
        info = conformance_server.info()
        assert info.env_name, "Info must name the environment"
        assert info.protocol == pb.DESCRIPTOR.package
        classes = message_classes(info)
        assert set(classes) == {"action", "observation", "state", "reset_options"}
        for role, cls in classes.items():
            assert cls.DESCRIPTOR.full_name == getattr(info, f"{role}_type")

    def test_round_trip_has_the_declared_types(self, conformance_server: ServerProcess) -> None:
        info = conformance_server.info()
        with _session(conformance_server) as env:
            result = env.reset(seed=self.seed, options=self.reset_options())
            assert _full_name(result.observation) == info.observation_type
            assert result.step_count == 0 and not result.done
            stepped = env.step(self.make_action(result.observation, 0, random.Random(0)))
            assert _full_name(stepped.observation) == info.observation_type
            assert stepped.step_count == 1
            assert stepped.episode_id == result.episode_id
            assert _full_name(env.state()) == info.state_type

    def test_descriptor_set_decodes_a_real_observation(
        self, conformance_server: ServerProcess
    ) -> None:
        info = conformance_server.info()
        observation_class = message_classes(info)["observation"]
        with _session(conformance_server) as env:
            result = env.reset(seed=self.seed, options=self.reset_options())
            wire = result.observation.SerializeToString()
            # A class built from the FileDescriptorSet alone reads the same message.
            decoded = observation_class.FromString(wire)
            assert decoded.SerializeToString(deterministic=True) == (
                result.observation.SerializeToString(deterministic=True)
            )

    def test_seeded_episodes_repeat(self, conformance_server: ServerProcess) -> None:
        with (
            _session(conformance_server) as first,
            _session(conformance_server) as second,
        ):
            a = self._play(first, self.seed, episode_id="conformance-a")
            b = self._play(second, self.seed, episode_id="conformance-b")
            # A reused session starts over: its step count is back at 0 (checked by _play).
            again = self._play(first, self.seed, episode_id="conformance-again")
            assert first.episode_id == "conformance-again"
            assert second.episode_id == "conformance-b"
        if self._compares:
            assert a == b == again

    def test_episode_end_then_reset_on_the_same_session(
        self, conformance_server: ServerProcess
    ) -> None:
        rng = random.Random(self.seed)
        with _session(conformance_server) as env:
            result = env.reset(seed=self.seed, options=self.ending_reset_options())
            first_episode = result.episode_id
            for step in range(self.max_steps_to_end):
                if result.done:
                    break
                result = env.step(self.make_action(result.observation, step, rng))
            assert result.done, f"episode did not end within {self.max_steps_to_end} steps"
            with pytest.raises(EnvError) as failed:
                env.step(self.make_action(result.observation, 0, rng))
            assert failed.value.code is grpc.StatusCode.FAILED_PRECONDITION
            again = env.reset(seed=self.seed + 1, options=self.reset_options())
            assert again.step_count == 0 and not again.done
            assert again.episode_id != first_episode
            stepped = env.step(self.make_action(again.observation, 0, rng))
            assert stepped.step_count == 1

    def test_step_before_reset_is_failed_precondition(
        self, conformance_server: ServerProcess
    ) -> None:
        with _session(conformance_server) as env:
            probe = env.reset(seed=self.seed, options=self.reset_options())
            action = self.make_action(probe.observation, 0, random.Random(0))
        with _session(conformance_server) as env:
            with pytest.raises(EnvError) as failed:
                env.step(action)
            assert failed.value.code is grpc.StatusCode.FAILED_PRECONDITION
            assert env.reset(seed=self.seed, options=self.reset_options()).step_count == 0

    def test_wrong_typed_action_is_invalid_argument(
        self, conformance_server: ServerProcess
    ) -> None:
        with _session(conformance_server) as env:
            result = env.reset(seed=self.seed, options=self.reset_options())
            with pytest.raises(EnvError) as failed:
                env.step(duration_pb2.Duration(seconds=1))  # never an env's action type
            assert failed.value.code is grpc.StatusCode.INVALID_ARGUMENT
            stepped = env.step(self.make_action(result.observation, 0, random.Random(0)))
            assert stepped.step_count == 1  # the bad action changed nothing

    def test_concurrent_sessions_do_not_share_state(
        self, conformance_server: ServerProcess
    ) -> None:
        seeds = [self.seed + i for i in range(self.concurrent_sessions)]
        traces = asyncio.run(self._play_interleaved(conformance_server.target, seeds))
        assert [trace_id for trace_id, _ in traces] == [f"conformance-{s}" for s in seeds]
        if self._compares:
            with _session(conformance_server) as env:
                for seed, (_, trace) in zip(seeds, traces, strict=True):
                    assert self._play(env, seed) == trace, f"seed {seed} saw another's state"

    async def _play_interleaved(self, target: str, seeds: list[int]) -> list[tuple[str, _Trace]]:
        """Play one episode per seed, all sessions stepping in lock-step on one channel."""
        async with grpc.aio.insecure_channel(target) as channel:
            envs: list[AsyncSession[Any, Any, Any, Any]] = [AsyncSession(channel) for _ in seeds]
            for env in envs:
                await env.open()
            rngs = [random.Random(seed) for seed in seeds]
            results = await asyncio.gather(
                *(
                    e.reset(seed=s, episode_id=f"conformance-{s}", options=self.reset_options())
                    for e, s in zip(envs, seeds, strict=True)
                )
            )
            traces: list[_Trace] = [[self._entry(r)] for r in results]
            books: list[_Books] = [[_books(r)] for r in results]
            for step in range(self.steps):
                live = [i for i, r in enumerate(results) if not r.done]
                if not live:
                    break
                stepped = await asyncio.gather(
                    *(envs[i].step(self.make_action(results[i].observation, step, rngs[i]))
                      for i in live)
                )  # fmt: skip
                for i, result in zip(live, stepped, strict=True):
                    results[i] = result
                    traces[i].append(self._entry(result))
                    books[i].append(_books(result))
            # Only the first session steps now: nobody else's step count may move.
            if not results[0].done:
                action = self.make_action(results[0].observation, self.steps, rngs[0])
                results[0] = await envs[0].step(action)
                books[0].append(_books(results[0]))
            for seed, episode in zip(seeds, books, strict=True):
                _check_books(episode, f"conformance-{seed}")
            for env in envs:
                await env.close()
        return [(r.episode_id, t) for r, t in zip(results, traces, strict=True)]

    def test_interleaved_sessions_keep_their_own_books(
        self, conformance_server: ServerProcess
    ) -> None:
        """Stepping one session never moves another's step count or episode id -- a check
        that holds whether or not the env is deterministic."""
        rng = random.Random(self.seed)
        with _session(conformance_server) as a, _session(conformance_server) as b:
            first_a = a.reset(seed=self.seed, episode_id="iso-a", options=self.reset_options())
            first_b = b.reset(seed=self.seed, episode_id="iso-b", options=self.reset_options())
            result, steps = first_a, 0
            for step in range(min(self.steps, 3)):
                if result.done:
                    break
                result = a.step(self.make_action(result.observation, step, rng))
                steps += 1
                assert (result.episode_id, result.step_count) == ("iso-a", steps)
            if first_b.done:
                return
            stepped_b = b.step(self.make_action(first_b.observation, 0, rng))
            assert (stepped_b.episode_id, stepped_b.step_count) == ("iso-b", 1)
            assert (a.episode_id, a.step_count) == ("iso-a", steps)

    def test_close_releases_every_session(self, conformance_server: ServerProcess) -> None:
        sessions = [_session(conformance_server) for _ in range(3)]
        for env in sessions:
            env.open()
            env.reset(seed=self.seed, options=self.reset_options())
        assert conformance_server.active() >= 3
        sessions[0].close()
        sessions[1].abort()
        sessions[2].close()
        conformance_server.wait_until(
            lambda: conformance_server.active() == 0, what="every session released"
        )
        self.check_released(conformance_server)

    # -- snapshots --------------------------------------------------------------------

    def _has_snapshots(self, server: ServerProcess) -> bool:
        """Whether the env supports snapshots (as Info says, and ``snapshots`` if set);
        without them, checks that a snapshot is UNIMPLEMENTED and the session goes on."""
        supported = server.info().snapshots.supported
        if self.snapshots is not None:
            assert supported == self.snapshots, (
                f"the suite says snapshots={self.snapshots}, Info says supported={supported}"
            )
        if not supported:
            with _session(server) as env:
                result = env.reset(seed=self.seed, options=self.reset_options())
                with pytest.raises(EnvError) as failed:
                    env.snapshot()
                assert failed.value.code is _UNIMPLEMENTED
                env.step(self.make_action(result.observation, 0, random.Random(0)))
        return supported

    def _branch(self, env: Session[Any, Any, Any, Any]) -> _Branch:
        """Play a seeded episode, snapshot it at its middle (or at its last step before the
        end, if it ends sooner), and record what the actions after the snapshot gave. The
        branch always holds at least one action: a replay that compares nothing proves
        nothing."""
        rng = random.Random(self.seed)
        result = env.reset(
            seed=self.seed, episode_id="conformance-snapshot", options=self.reset_options()
        )
        assert not result.done, "the reset ended the episode: there is nothing to snapshot"
        middle = max(1, self.steps // 2)
        actions: list[Message] = []
        trace: _Trace = []
        books: _Books = []
        snapshot, at, taken = env.snapshot(), (result.episode_id, result.step_count), 0
        for step in range(self.steps):
            if result.done:
                break
            if 0 < step <= middle:  # the latest live state up to the middle
                snapshot, at, taken = env.snapshot(), (result.episode_id, result.step_count), step
            action = self.make_action(result.observation, step, rng)
            result = env.step(action)
            actions.append(action)
            trace.append(self._entry(result))
            books.append(_books(result))
        return _Branch(snapshot, at, actions[taken:], trace[taken:], books[taken:])

    def _check_replay(self, env: Session[Any, Any, Any, Any], branch: _Branch) -> None:
        """``env`` holds ``branch``'s snapshot: its actions must give what they gave."""
        assert (env.episode_id, env.step_count) == branch.at, "restore lost the bookkeeping"
        assert branch.actions, "the branch recorded no action after its snapshot"
        trace: _Trace = []
        books: _Books = []
        for action in branch.actions:
            result = env.step(action)
            trace.append(self._entry(result))
            books.append(_books(result))
            if result.done:
                break
        if self._compares:  # a deterministic env replays the whole branch, step for step
            assert len(books) == len(branch.books), (
                f"the replay took {len(books)} steps, the original {len(branch.books)}"
            )
            assert trace == branch.trace, "the same actions after a restore gave another trajectory"
            assert books == branch.books, f"step counts {books} vs {branch.books}"
        else:  # another may end elsewhere; the bookkeeping of the shared steps still holds
            shared = min(len(books), len(branch.books))
            assert books[:shared] == branch.books[:shared], f"step counts {books} vs {branch.books}"

    def test_snapshots_are_supported_or_unimplemented(
        self, conformance_server: ServerProcess
    ) -> None:
        if not self._has_snapshots(conformance_server):
            with _session(conformance_server) as env:
                env.reset(seed=self.seed, options=self.reset_options())
                with pytest.raises(EnvError) as failed:
                    env.restore(b"OGSN")
                assert failed.value.code is _UNIMPLEMENTED
            return
        limit = conformance_server.info().snapshots.max_bytes
        with _session(conformance_server) as env:
            with pytest.raises(EnvError) as early:
                env.snapshot()
            assert early.value.code is grpc.StatusCode.FAILED_PRECONDITION
            env.reset(seed=self.seed, options=self.reset_options())
            assert 0 < len(env.snapshot()) <= limit

    def test_restore_then_the_same_actions_repeat_the_trajectory(
        self, conformance_server: ServerProcess
    ) -> None:
        if not self._has_snapshots(conformance_server):
            return
        with _session(conformance_server) as env, _session(conformance_server) as fresh:
            branch = self._branch(env)
            env.restore(branch.snapshot)  # the same session, after it moved on
            self._check_replay(env, branch)
            fresh.restore(branch.snapshot)  # a session that never reset
            self._check_replay(fresh, branch)

    def test_forks_repeat_the_trajectory(self, conformance_server: ServerProcess) -> None:
        if not self._has_snapshots(conformance_server):
            return
        with _session(conformance_server) as env:
            branch = self._branch(env)
            env.restore(branch.snapshot)
            forks = env.fork(2)
            try:
                for fork in forks:
                    self._check_replay(fork, branch)
            finally:
                for fork in forks:
                    fork.close()

    def test_a_snapshot_restores_on_a_fresh_server_process(
        self, conformance_server: ServerProcess, conformance_environ: dict[str, str]
    ) -> None:
        if not self._has_snapshots(conformance_server):
            return
        with _session(conformance_server) as env:
            branch = self._branch(env)
        fresh = self._start_server(conformance_environ)  # same key, nothing in memory
        try:
            with _session(fresh) as env:
                env.restore(branch.snapshot)
                self._check_replay(env, branch)
        finally:
            fresh.stop()

    def test_a_tampered_snapshot_is_refused_and_the_episode_goes_on(
        self, conformance_server: ServerProcess
    ) -> None:
        if not self._has_snapshots(conformance_server):
            return
        with _session(conformance_server) as env:
            branch = self._branch(env)
            env.restore(branch.snapshot)
            tampered = bytearray(branch.snapshot)
            tampered[-1] ^= 0x01
            with pytest.raises(EnvError) as refused:
                env.restore(bytes(tampered))
            assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
            self._check_replay(env, branch)  # the refusal left the episode where it was


def _session(server: ServerProcess) -> Session[Any, Any, Any, Any]:
    """An untyped session: it decodes whatever types the env's imported modules define."""
    return Session(server.target)


def _books(result: StepOutcome[Any]) -> tuple[str, int]:
    return result.episode_id, result.step_count


def _check_books(books: _Books, episode_id: str | None) -> None:
    """One episode's results: one episode id (the given one, if any) and step counts 0,
    1, 2, ... in order."""
    ids = {episode for episode, _ in books}
    assert len(ids) == 1, f"one episode, several ids: {sorted(ids)}"
    if episode_id is not None:
        assert ids == {episode_id}, f"the episode id {episode_id!r} was not echoed: {ids}"
    counts = [count for _, count in books]
    assert counts == list(range(len(books))), f"step counts {counts}"


def _full_name(message: Message) -> str:
    return message.DESCRIPTOR.full_name
