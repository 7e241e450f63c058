"""Env code that raises what is no ``Exception`` -- ``SystemExit``, ``KeyboardInterrupt``,
a ``BaseException`` of its own -- fails that env's call, never the server: the caller gets
INTERNAL naming what was raised, the session (or the vector's other envs) go on, the
server keeps serving, and no env or slot leaks. In process (inline, pooled, async envs)
and ``--isolated``; from step, reset, close and the factory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from openenv_grpc import EnvError, SessionLost, SessionRefused, VectorSession
from openenv_grpc.testing import ServerProcess
from openenv_grpc_envs.echo import EchoAction, EchoEnv

# The module's servers (one per mode) are shared by its tests; the tests that start a
# server of their own say so (fresh_server).
pytestmark = [pytest.mark.timeout(60), pytest.mark.shared_server]

KINDS = {
    "sysexit": ("SystemExit: 4", "builtins.SystemExit"),
    "kbi": ("KeyboardInterrupt: env code, not a signal", "builtins.KeyboardInterrupt"),
    "base": ("Custom: an env's own BaseException", "support.exiting_envs.Custom"),
}
SEEDS = {"sysexit": 1, "kbi": 2, "base": 3}
TESTS = Path(__file__).resolve().parent


class LedgerServer(ServerProcess):
    """A server whose envs record their creation and close in ``ledger``."""

    def __init__(self, env: str, args: list[str], extra: dict[str, str], ledger: Path) -> None:
        self.ledger = ledger
        super().__init__(
            env, args, {"OPENENV_TEST_LEDGER": str(ledger), **extra}, pythonpath=[TESTS]
        )

    def open_envs(self) -> int:
        return len(list(self.ledger.glob("*.open")))


MODES = {
    "inline": ("support.exiting_envs:InlineExitEnv", []),
    "pooled": ("support.exiting_envs:PooledExitEnv", []),
    "async": ("support.exiting_envs:AsyncExitEnv", []),
    "isolated": ("support.exiting_envs:PooledExitEnv", ["--isolated", "1"]),
}


@pytest.fixture(scope="module", params=list(MODES))
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LedgerServer]:
    env, args = MODES[request.param]
    ledger: Path = tmp_path_factory.mktemp(f"ledger-{request.param}")
    started = LedgerServer(env, args, {}, ledger)
    yield started
    started.stop()


def _serving(server: LedgerServer) -> None:
    """The server still answers health and opens a session whose env works."""
    assert server.proc.poll() is None, server.stderr()
    assert server.health() == health_pb2.HealthCheckResponse.SERVING
    with EchoEnv(server.target) as env:
        env.reset()
        assert env.step(EchoAction(message="still here")).observation.echoed_message == (
            "still here"
        )


def _settled(server: LedgerServer) -> None:
    """Every env made was closed once and no slot is held."""
    server.wait_until(
        lambda: server.active() == 0 and server.open_envs() == 0, timeout=15, what="envs closed"
    )


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_step_that_raises_it_fails_that_step_only(server: LedgerServer, kind: str) -> None:
    message, exception_type = KINDS[kind]
    with EchoEnv(server.target) as env:
        env.reset()
        with pytest.raises(EnvError) as failed:
            env.step(EchoAction(message=kind))
        assert failed.value.code is grpc.StatusCode.INTERNAL
        assert failed.value.message == f"step failed: {message}"
        assert failed.value.exception_type == exception_type
        # The episode failed; a reset starts a new one on the same session.
        with pytest.raises(EnvError) as after:
            env.step(EchoAction(message="hello"))
        assert after.value.code is grpc.StatusCode.FAILED_PRECONDITION
        env.reset()
        assert env.step(EchoAction(message="hello")).observation.echoed_message == "hello"
    _serving(server)
    _settled(server)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_reset_that_raises_it_fails_that_reset_only(server: LedgerServer, kind: str) -> None:
    message, exception_type = KINDS[kind]
    with EchoEnv(server.target) as env:
        with pytest.raises(EnvError) as failed:
            env.reset(seed=SEEDS[kind])
        assert failed.value.code is grpc.StatusCode.INTERNAL
        assert failed.value.message == f"reset failed: {message}"
        assert failed.value.exception_type == exception_type
        env.reset()
        assert env.step(EchoAction(message="again")).observation.echoed_message == "again"
    _serving(server)
    _settled(server)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_vector_envs_raise_fails_its_row_and_its_neighbours_answer(
    server: LedgerServer, kind: str
) -> None:
    message, exception_type = KINDS[kind]
    with VectorSession(server.target, 4) as envs:
        envs.reset()
        actions = [EchoAction(message=m) for m in ("a", kind, "c", "d")]
        outcome = envs.step(actions)
        assert list(outcome.indices) == [0, 2, 3]
        assert [o.echoed_message for o in outcome.observations] == ["a", "c", "d"]
        error = outcome.errors[1]
        assert error.code is grpc.StatusCode.INTERNAL
        assert error.message == f"step failed: {message}"
        assert error.exception_type == exception_type
        # The neighbours' episodes go on; the failed env takes a reset.
        again = envs.step([EchoAction(message="e")] * 3, indices=[0, 2, 3])
        assert list(again.indices) == [0, 2, 3] and not again.errors
        envs.reset(indices=[1])
        assert list(envs.step([EchoAction(message="f")], indices=[1]).indices) == [1]
    _serving(server)
    _settled(server)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_close_that_raises_it_is_answered_and_the_env_is_gone(
    server: LedgerServer, kind: str
) -> None:
    message, exception_type = KINDS[kind]
    env = EchoEnv(server.target)
    env.open()
    env.reset()
    env.step(EchoAction(message=f"close:{kind}"))
    with pytest.raises(EnvError) as failed:
        env.close()
    assert failed.value.code is grpc.StatusCode.INTERNAL
    assert failed.value.message == f"close failed: {message}"
    assert failed.value.exception_type == exception_type
    _serving(server)
    _settled(server)


@pytest.mark.fresh_server
@pytest.mark.parametrize("mode", ["inline", "async", "isolated"])
def test_a_factory_that_raises_it_refuses_the_open_and_frees_the_slot(
    tmp_path: Path, mode: str
) -> None:
    env, args = MODES[mode]
    # The first env of each process is made; every later one raises SystemExit.
    server = LedgerServer(
        env, [*args, "--max-concurrent-envs", "1"], {"FACTORY_EXIT": "sysexit"}, tmp_path
    )
    try:
        first = EchoEnv(server.target)
        first.open()
        first.close()
        _settled(server)  # the slot is given back once the stream has ended, just after
        for _ in range(5):  # the slot is given back each time: every later open is refused too
            with pytest.raises(SessionRefused) as failed, EchoEnv(server.target):
                pass
            assert failed.value.code is grpc.StatusCode.INTERNAL
            assert "could not create the environment" in failed.value.message
            assert "SystemExit: 4" in failed.value.message
            assert "EnvExit" not in failed.value.message
        assert server.proc.poll() is None, server.stderr()
        assert server.health() == health_pb2.HealthCheckResponse.SERVING
        _settled(server)
    finally:
        server.stop()


@pytest.mark.fresh_server
@pytest.mark.parametrize("isolated", [False, True], ids=["in-process", "isolated"])
@pytest.mark.parametrize("kind", [*KINDS, "genexit"])
def test_a_native_batch_call_that_raises_it_is_answered(
    tmp_path: Path, kind: str, isolated: bool
) -> None:
    """The whole batch call raises (a native batch, on the pool): INTERNAL for the
    request, the stream goes on. A GeneratorExit left bare on a pool thread's future went
    unanswered (the awaiting task closed its coroutines instead)."""
    args = ["--isolated", "1"] if isolated else []
    server = LedgerServer("support.exiting_envs:ExitingBatchEnv", args, {}, tmp_path)
    try:
        with VectorSession(server.target, 3) as envs:
            assert envs.native
            envs.reset()
            with pytest.raises(EnvError) as failed:
                envs.step_batch(EchoAction(message=kind), timeout=20)
            assert failed.value.code is grpc.StatusCode.INTERNAL
            expected = KINDS[kind][0] if kind in KINDS else "GeneratorExit: an env's GeneratorExit"
            assert failed.value.message == f"step failed: {expected}"
            envs.reset()
            out = envs.step_batch(EchoAction(message="a\nb\nc"), timeout=20)
            assert out.batch_observation.echoed_message == "a\nb\nc"
        _serving(server)
        _settled(server)
    finally:
        server.stop()


@pytest.mark.fresh_server
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("started", ["task", "thread"])
def test_an_async_envs_own_task_that_raises_it_does_not_stop_the_server(
    tmp_path: Path, kind: str, started: str
) -> None:
    """A task the env started with ``create_task`` (``task``), or one of
    ``asyncio.to_thread`` (``thread``: asyncio's coroutine awaiting env code)."""
    server = LedgerServer("support.exiting_envs:TaskExitEnv", [], {}, tmp_path)
    try:
        with EchoEnv(server.target) as env:
            env.reset()
            spawned = env.step(EchoAction(message=f"{started}:{kind}"))
            assert spawned.observation.echoed_message == "spawned"
            message = KINDS[kind][0]
            server.wait_until(lambda: f"EnvExit: {message}" in server.stderr(), 15, "the task")
            assert env.step(EchoAction(message="after")).observation.echoed_message == "after"
        _serving(server)
        _settled(server)
    finally:
        server.stop()


@pytest.mark.fresh_server
@pytest.mark.parametrize("kind", [*KINDS, "invalid"])
def test_a_cost_class_that_raises_fails_that_call_only(tmp_path: Path, kind: str) -> None:
    """``cost_class()`` is env code the server calls before a measured env's call: what it
    raises fails that call (INTERNAL; InvalidAction refuses it), the session goes on."""
    server = LedgerServer("support.exiting_envs:CostClassExitEnv", [], {}, tmp_path)
    try:
        with EchoEnv(server.target) as env:
            env.reset()
            for _ in range(40):  # the env's step group moves onto the event loop
                env.step(EchoAction(message="warm"))
            assert env.step(EchoAction(message=f"cost:{kind}")).observation.echoed_message == (
                "armed"
            )
            with pytest.raises(EnvError) as failed:
                env.step(EchoAction(message="next"))
            if kind == "invalid":
                assert failed.value.code is grpc.StatusCode.INVALID_ARGUMENT
                assert "refused on purpose" in failed.value.message
            else:
                assert failed.value.code is grpc.StatusCode.INTERNAL
                assert KINDS[kind][0] in failed.value.message
                env.reset()  # an INTERNAL step breaks the env: a reset starts it over
            assert env.step(EchoAction(message="after")).observation.echoed_message == "after"
        _serving(server)
        _settled(server)
    finally:
        server.stop()


@pytest.mark.fresh_server
def test_a_reclaim_hook_that_raises_it_is_called_after_every_death(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    server = LedgerServer("support.exiting_envs:ExitingReclaimEnv", ["--isolated", "1"], {}, ledger)
    try:
        reclaims = Path(f"{ledger}.reclaims")

        def calls() -> int:
            return len(reclaims.read_text().split()) if reclaims.exists() else 0

        server.wait_until(lambda: calls() >= 1, 15, "the hook at start")
        for death in range(1, 4):
            before = calls()
            with EchoEnv(server.target) as env:
                env.reset()
                with pytest.raises(SessionLost):
                    env.step(EchoAction(message="exit"))
            server.wait_until(lambda b=before: calls() > b, 30, f"the hook after death {death}")
        assert "reclaim_orphans() raised" in server.stderr()
        _serving(server)
    finally:
        server.stop()


def test_only_tasks_env_code_may_have_started_are_wrapped() -> None:
    """The loop's task factory wraps a task in ``contained`` unless its coroutine is the
    server's own (its modules, grpc.aio's RPC handlers, uvicorn's WebSocket protocol):
    those call env code only through a runner, and the wrapper is a frame resumed at
    every wake-up. An env's own module -- the catalogue's ``openenv_grpc_envs`` too -- is
    wrapped, and so is the rest of a library: asyncio's (``asyncio.to_thread`` awaits env
    code), uvicorn's ``Server.serve`` (it calls ``sys.exit`` when it cannot bind)."""
    import asyncio
    import types

    from openenv_grpc.server.local import runner

    def coroutine_of(module: str) -> types.CoroutineType:  # type: ignore[type-arg]
        space: dict[str, object] = {"__name__": module}
        exec("async def work():\n    return 1\n", space)
        return space["work"]()  # type: ignore[operator,no-any-return]

    async def main() -> dict[str, bool]:
        loop = asyncio.get_running_loop()
        runner.contain_tasks(loop)
        wrapped = {}
        for module in (
            "openenv_grpc.server.stream.session",
            "asyncio.base_events",
            "uvicorn.server",
            "openenv_grpc_envs.echo",
            "support.exiting_envs",
            "my_env",
        ):
            task = loop.create_task(coroutine_of(module))
            wrapped[module] = task.get_coro().__qualname__ == "contained"  # type: ignore[union-attr]
            await task
        return wrapped

    async def grpc_handler_task() -> str:
        """The coroutine of the task grpc.aio runs a real call's handler in."""
        import grpc

        loop = asyncio.get_running_loop()
        runner.contain_tasks(loop)
        seen: list[str] = []

        async def handler(request: bytes, context: object) -> bytes:
            seen.append(asyncio.current_task().get_coro().__qualname__)  # type: ignore[union-attr]
            return request

        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "t.T", {"M": grpc.unary_unary_rpc_method_handler(handler)}
                ),
            )
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                assert await channel.unary_unary("/t.T/M")(b"x") == b"x"
        finally:
            await server.stop(None)
        return seen[0]

    # grpc.aio's own (compiled) coroutine, unwrapped: its frame names no module.
    assert asyncio.run(grpc_handler_task()) == "_handle_exceptions"
    assert asyncio.run(main()) == {
        "openenv_grpc.server.stream.session": False,
        "asyncio.base_events": True,
        "uvicorn.server": True,
        "openenv_grpc_envs.echo": True,
        "support.exiting_envs": True,
        "my_env": True,
    }
