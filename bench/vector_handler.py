"""Server CPU per vector message in the request handler alone: no gRPC, no socket.

Steps one vector stream of N envs through the handler the server builds for it
(``VectorView`` over the driver and the local batch calls) and reports
``time.process_time`` per message and per env-step, for the server's per-row Python on
each batch path (what a message costs beyond gRPC's own write and read)::

    python -m bench.vector_handler                       # every system, N = 64
    python -m bench.vector_handler --systems gym-envpool --messages 5000

Systems: ``echo-loop`` (64 echo envs, one Any per env), ``echo-native`` (the echo bench
env's native batch, ``openenv_grpc_envs.echo.batch``), ``gym-gymnasium`` and
``gym-envpool`` (CartPole-v1 on the gymnasium env's native batch, each backend). The
process's CPU is split into the event loop's thread and the others (the thread pool's, and
EnvPool's own worker threads). Numbers are measured, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from openenv_grpc.codec import pack
from openenv_grpc.environment import AutoresetMode
from openenv_grpc.server.local.calls import local_calls
from openenv_grpc.server.model.phases import VECTOR_WORDS
from openenv_grpc.server.model.placement import CallPlacement, batch_threshold
from openenv_grpc.server.model.spec import EnvSpec
from openenv_grpc.server.stream.driver import Driver
from openenv_grpc.server.stream.vector_view import VectorView
from openenv_grpc.v1 import session_pb2 as pb

SYSTEMS = ("echo-loop", "echo-native", "gym-gymnasium", "gym-envpool")


def _system(name: str, n: int) -> tuple[Callable[[], Any], pb.VectorSessionRequest, bytes]:
    """(factory, reset request, serialized step request) of one system."""
    reset = pb.VectorSessionRequest(request_id=1)
    reset.reset.SetInParent()
    step = pb.VectorSessionRequest(request_id=2)
    if name == "echo-loop":
        from openenv_grpc_envs.echo import EchoAction, EchoEnvironment

        for _ in range(n):
            step.step.actions.append(pack(EchoAction(message="x")))
        return EchoEnvironment, reset, step.SerializeToString()
    if name == "echo-native":
        from openenv_grpc_envs.echo.batch import EchoBatchAction, EchoBatchEnvironment

        reset.reset.batch_observation = True
        step.step.batch_action.CopyFrom(pack(EchoBatchAction(messages=["x"] * n)))
        return EchoBatchEnvironment, reset, step.SerializeToString()
    import gymnasium

    from openenv_grpc_envs.gymnasium import GymnasiumEnvironment
    from openenv_grpc_envs.gymnasium.batch_convert import encode_stacked
    from openenv_grpc_envs.gymnasium.v1.gymnasium_pb2 import (
        Backend,
        GymnasiumAction,
        GymnasiumResetOptions,
    )

    backend = Backend.BACKEND_ENVPOOL if name == "gym-envpool" else Backend.BACKEND_GYMNASIUM
    options = GymnasiumResetOptions(env_id="CartPole-v1", backend=backend)
    reset.reset.batch_observation = True
    for i in range(n):
        command = reset.reset.envs.add(seed=i)
        command.options.CopyFrom(pack(options))
    action = GymnasiumAction()
    encode_stacked(action.value, np.zeros(n, dtype=np.int64), gymnasium.spaces.Discrete(2))
    step.step.batch_action.CopyFrom(pack(action))
    return GymnasiumEnvironment, reset, step.SerializeToString()


def _placement(spec: EnvSpec, n: int, where: str) -> CallPlacement | None:
    """A measured env's batch placement, as the server makes it for N envs (``where``:
    ``measured``), or one that keeps its calls on the pool or moves them to the loop."""
    measured = spec.placement
    if measured is None or where == "pool":
        return None
    threshold = batch_threshold(measured.threshold, n) if where == "measured" else 1e9
    return CallPlacement(threshold, f"{spec.name} (vector of {n})")


async def measure(name: str, n: int, messages: int, where: str = "measured") -> dict[str, Any]:
    factory, reset, step = _system(name, n)
    spec = EnvSpec.from_factory(factory)
    with ThreadPoolExecutor(2) as pool:
        calls = await local_calls(
            spec, n, AutoresetMode.NEXT_STEP, pool, words=VECTOR_WORDS,
            placement=_placement(spec, n, where),
        )  # fmt: skip
        view = VectorView(Driver(spec, n, AutoresetMode.NEXT_STEP, calls, VECTOR_WORDS))
        answer = await view.handle(reset.SerializeToString())
        assert pb.VectorSessionResponse.FromString(answer.response).WhichOneof("outcome") == (
            "result"
        )
        for _ in range(500):  # warm up (and let a measured env's calls move to the loop)
            await view.handle(step)
        profile = None
        if os.environ.get("VECTOR_HANDLER_PROFILE"):  # a cProfile of the measured window
            import cProfile

            profile = cProfile.Profile()
            profile.enable()
        started, loop_started = time.process_time(), time.thread_time()
        for _ in range(messages):
            await view.handle(step)
        seconds = time.process_time() - started
        loop_seconds = time.thread_time() - loop_started  # the event loop's thread alone
        if profile is not None:
            profile.disable()
            profile.dump_stats(f"{os.environ['VECTOR_HANDLER_PROFILE']}.{name}")
        await view.close()
    per_message = seconds / messages * 1e6
    loop = loop_seconds / messages * 1e6
    return {"system": name, "n": n, "placement": where,
            "cpu_us_per_message": round(per_message, 1),
            "cpu_us_per_env_step": round(per_message / n, 2),
            "loop_thread_cpu_us_per_message": round(loop, 1),
            "other_threads_cpu_us_per_message": round(per_message - loop, 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--num-envs", type=int, default=64)
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument(
        "--placement", choices=("measured", "pool", "inline"), default="measured",
        help="where a measured env's batch calls run: as the server measures them, always "
        "on the thread pool, or on the event loop",
    )  # fmt: skip
    args = parser.parse_args(argv)
    for name in args.systems:
        print(asyncio.run(measure(name, args.num_envs, args.messages, args.placement)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
