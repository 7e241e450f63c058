"""Server CPU per Session step, layer by layer: what each layer of the step path adds.

Steps one echo session from each layer's entry down (no gRPC, no socket) and reports
``time.process_time`` per step, the lowest of ``--repeats`` rounds in which the layers
take turns (the machine is shared: the lowest is the least disturbed). Each layer's own
cost is its row minus the row below.

    python -m bench.step_layers --steps 20000 --repeats 5

Layers, top down: ``view`` (SessionView.handle: parse, dispatch, decode the action, fill
and serialize the answer), ``driver`` (Driver.step: phases, counts, timing), ``calls``
(LocalBatchCalls.step: the stream's lock, the call's error mapping), ``runner``
(EnvRunner: containment of env code's SystemExit), ``batch`` (the loop batch of one:
checks, the observation serialized), ``env`` (EchoEnvironment.step and its observation
serialized). ``bare`` is the floor's own work on a step (bench.bare_echo's handler, parse
and serialize included): what the ``view`` row is compared with.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from openenv_grpc.codec import pack
from openenv_grpc.environment import AutoresetMode
from openenv_grpc.server.local.calls import StepArgs, local_calls
from openenv_grpc.server.model.phases import SESSION_WORDS
from openenv_grpc.server.model.spec import EnvSpec
from openenv_grpc.server.stream.session_view import SessionView
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc_envs.echo import EchoAction, EchoEnvironment

_OBSERVATION_URL = "type.googleapis.com/openenv_grpc_envs.echo.v1.EchoObservation"


async def _per_step(step: Callable[[], Any], steps: int, awaited: bool) -> float:
    """CPU microseconds per call of ``step``, over ``steps`` calls."""
    started = time.process_time()
    if awaited:
        for _ in range(steps):
            await step()
    else:
        for _ in range(steps):
            step()
    return (time.process_time() - started) / steps * 1e6


async def main(steps: int, repeats: int) -> dict[str, float]:
    spec = EnvSpec.from_factory(EchoEnvironment)
    with ThreadPoolExecutor(2) as pool:
        calls = await local_calls(
            spec, 1, AutoresetMode.DISABLED, pool, words=SESSION_WORDS, native=False,
            placement=spec.placement,
        )  # fmt: skip
        view = SessionView(spec, calls)
        await view.handle(
            pb.SessionRequest(request_id=1, reset=pb.ResetCommand()).SerializeToString()
        )
        action = EchoAction(message="hello")
        wire = pack(action)
        raw = pb.SessionRequest(request_id=2, step=pb.StepCommand(action=wire)).SerializeToString()
        driver = view.driver
        runner: Any = calls._runner  # the bench looks inside on purpose
        batch = runner.env
        env = batch._envs[0]

        def args() -> StepArgs:
            return StepArgs((0,), (action,), False)

        def env_step() -> Any:
            return env.step(action).observation.SerializeToString()

        layers: list[tuple[str, Callable[[], Any], bool]] = [
            ("view", lambda: view.handle(raw), True),
            ("driver", lambda: driver.step(args()), True),
            ("calls", lambda: calls.step(args()), True),
            ("runner", lambda: _runner_call(runner, batch, action), True),
            ("batch", lambda: batch.step((0,), (action,), False), False),
            ("env", env_step, False),
            ("bare", lambda: _bare(raw), False),
        ]
        out = {name: float("inf") for name, _, _ in layers}
        for _ in range(repeats + 1):  # the first round warms up; layers take turns
            for name, step, awaited in layers:
                out[name] = min(out[name], await _per_step(step, steps, awaited))
        await view.close()
    return out


def _bare(raw: bytes) -> bytes:
    """What bench.bare_echo's handler does with a step, parse and serialize included
    (grpc.aio does those two there, in its (de)serializers)."""
    request = pb.SessionRequest.FromString(raw)
    response = pb.SessionResponse(request_id=request.request_id)
    if request.HasField("close"):
        return b""
    result = response.result
    result.observation.type_url = _OBSERVATION_URL
    if request.HasField("step"):
        result.observation.value = request.step.action.value
    return response.SerializeToString()


def _runner_call(runner: Any, batch: Any, action: Any) -> Awaitable[Any]:
    """The runner's call of one step as the calls layer makes it."""
    if getattr(runner, "inline", False):
        return _ready(runner.call_inline(batch.step, (0,), (action,), False))
    result: Awaitable[Any] = runner.call_within(None, batch.step, (0,), (action,), False)
    return result


async def _ready(value: Any) -> Any:
    return value


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    cli = parser.parse_args()
    rows = asyncio.run(main(cli.steps, cli.repeats))
    print(json.dumps({name: round(us, 2) for name, us in rows.items()}), flush=True)
