"""Runs the atheris fuzzer (tests/fuzz/fuzz_session.py) for a bounded number of inputs,
and checks the answers its regression inputs must get.

The fuzzer drives the server's request handling in-process (``SessionView`` over the
echo env, ``openenv_grpc.codec``, the echo env's tools); see its docstring for the
properties. Everything here is strict: no input or bug class is skipped.

* each regression input (``regression-*`` in the fuzzer's seed corpus: an input that once
  crashed it, bugs 3 and 4 of docs/reliability.md) is replayed by the fuzzer on its own;
* the same inputs are decoded here and run through the library directly, to check the
  answer each must now get: a NaN or infinite tool argument is an ``INVALID_ARGUMENT``
  error carrying the toolbox's message and the episode goes on; an info map holding an
  infinity decodes to ``float("inf")``;
* the well-formed seeds, the regression inputs, and then 60,000 generated inputs (every
  one required: stopping short fails).

A fuzzer run passes when libFuzzer ends with exit code 0 and no crash/timeout/oom artifact.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from google.protobuf import struct_pb2

from openenv_grpc.codec import info_from_struct
from openenv_grpc.environment import AutoresetMode
from openenv_grpc.server.local.calls import local_calls
from openenv_grpc.server.model.phases import SESSION_WORDS
from openenv_grpc.server.model.spec import EnvSpec
from openenv_grpc.server.stream.session_view import SessionView
from openenv_grpc.tools.v1.tools_pb2 import ToolCall
from openenv_grpc.v1 import session_pb2 as pb
from openenv_grpc_envs.echo import EchoAction, EchoEnvironment, EchoObservation

FUZZER = Path(__file__).resolve().parent / "fuzz" / "fuzz_session.py"
#: Inputs the bounded run must get through, every one of them (the test fails short of it).
RUNS = 60_000
#: A safety cap on wall time only: ~15 s on a quiet 2-core machine, far less than this.
MAX_TOTAL_TIME = 240

pytestmark = pytest.mark.timeout(MAX_TOTAL_TIME + 80)

REGRESSIONS = [
    "regression-nan-tool-argument",
    "regression-infinite-tool-argument",
    "regression-infinite-info",
]
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]


def _run_fuzzer(tmp_path: Path, *flags: str) -> tuple[int, str]:
    """Run the fuzzer on a fresh (self-seeded) corpus, or replay the one input file in
    ``flags``; return how many inputs it tried and its output."""
    replay = bool(flags) and not flags[0].startswith("-")
    corpus = tmp_path / "corpus"
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            str(FUZZER),
            *(flags if replay else (str(corpus), *flags)),
            f"-max_total_time={MAX_TOTAL_TIME}",
            "-timeout=20",
            "-rss_limit_mb=2048",
            "-seed=1",
            f"-artifact_prefix={artifacts}/",
        ],
        capture_output=True,
        text=True,
        timeout=MAX_TOTAL_TIME + 60,
        env={**_environ(), "PYTHONHASHSEED": "0"},  # with -seed=1: as repeatable as it gets
        cwd=tmp_path,  # anything libFuzzer writes unasked lands here, not in the repo
    )
    output = proc.stdout + proc.stderr
    done = re.search(r"#(\d+)\s+DONE", output) or re.search(r"Done (\d+) runs", output)
    # Without a DONE line (a crash), the last status line says how far it got.
    progress = re.findall(r"^#(\d+)\s", output, re.MULTILINE)
    tried = int(done.group(1)) if done else (int(progress[-1]) if progress else 0)
    crashes = sorted(p.name for p in artifacts.iterdir())
    if replay:
        how = f"replayed={'Executed ' in output}"
    else:
        how = f"inputs tried={tried} finished={done is not None}"
    run = Path(flags[0]).name if replay else " ".join(flags)
    print(f"\nFUZZ atheris {run}: {how} exit={proc.returncode} artifacts={crashes}")
    assert proc.returncode == 0 and not crashes, (
        f"the fuzzer crashed (exit {proc.returncode}, artifacts {crashes}); replay with "
        f"{sys.executable} {FUZZER} {flags[0] if replay else '<artifact>'}\n{output[-6000:]}"
    )
    assert done is not None or "Executed " in output, output[-3000:]
    return tried, output


def _environ() -> dict[str, str]:
    # The switch that once skipped NaN/Infinity inputs is gone; make sure nothing stale
    # in the caller's environment could matter.
    return {k: v for k, v in os.environ.items() if not k.startswith("OPENENV_FUZZ_")}


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fuzzer's seed corpus, as ``fuzz_session.py --write-corpus`` writes it."""
    corpus = tmp_path_factory.mktemp("seeds")
    subprocess.run(
        [sys.executable, str(FUZZER), "--write-corpus", str(corpus)],
        check=True,
        capture_output=True,  # atheris lists every module it instruments
        timeout=60,
    )
    return corpus


def test_seed_corpus_holds_every_regression_input(seeds: Path) -> None:
    names = sorted(p.name for p in seeds.iterdir() if p.name.startswith("regression-"))
    assert names == sorted(REGRESSIONS)


@pytest.mark.parametrize("name", REGRESSIONS)
def test_fuzzer_regression_input_passes(tmp_path: Path, seeds: Path, name: str) -> None:
    _run_fuzzer(tmp_path, str(seeds / name))


# -- the regression inputs, decoded and run through the library directly -------------------


def _frames(data: bytes) -> list[bytes]:
    """The fuzzer's framing: a 2-byte big-endian length, then that many bytes."""
    out: list[bytes] = []
    i = 0
    while i + 2 <= len(data):
        size = int.from_bytes(data[i : i + 2], "big")
        out.append(data[i + 2 : i + 2 + size])
        i += 2 + size
    return out


def _run_session(requests: list[pb.SessionRequest]) -> list[pb.SessionResponse]:
    """Hand ``requests`` in turn to one ``SessionView`` over a fresh echo env, as the
    server does for one stream."""
    spec = EnvSpec.from_factory(EchoEnvironment)

    async def main(pool: ThreadPoolExecutor) -> list[pb.SessionResponse]:
        calls = await local_calls(
            spec, 1, AutoresetMode.DISABLED, pool, words=SESSION_WORDS, native=False
        )
        driver = SessionView(spec, calls)
        try:
            answers = [await driver.handle(r.SerializeToString()) for r in requests]
            return [pb.SessionResponse.FromString(a.response) for a in answers]
        finally:
            await driver.close()

    with ThreadPoolExecutor(1) as pool:
        return asyncio.run(main(pool))


def _step(request_id: int, action: EchoAction) -> pb.SessionRequest:
    request = pb.SessionRequest(request_id=request_id)
    request.step.action.Pack(action)
    return request


def _assert_refused_then_goes_on(
    responses: list[pb.SessionResponse], call: ToolCall, message: str
) -> None:
    reset, refused, after = responses
    assert reset.WhichOneof("outcome") == "result", reset
    assert refused.WhichOneof("outcome") == "error", f"{call.name} ran: {refused}"
    assert (refused.error.code, refused.error.message) == (INVALID_ARGUMENT, message), refused
    assert refused.error.exception_type.endswith("InvalidAction"), refused.error
    # Not INTERNAL: the episode is not broken, and the refused step did not count.
    assert after.WhichOneof("outcome") == "result", after
    assert after.result.step_count == 1
    observation = EchoObservation()
    assert after.result.observation.Unpack(observation)
    assert observation.echoed_message == "still running"


def test_regression_nan_tool_argument_is_invalid_argument(seeds: Path) -> None:
    """Bug 3: ``count(message="abc", letter=NaN)`` answered INTERNAL and broke the episode."""
    data = (seeds / "regression-nan-tool-argument").read_bytes()
    assert data[0] % 4 in (0, 1)  # the session target
    requests = [pb.SessionRequest.FromString(raw) for raw in _frames(data[1:])]
    action = EchoAction()
    assert requests[1].step.action.Unpack(action)
    assert math.isnan(action.tool_call.arguments["letter"])
    _assert_refused_then_goes_on(
        _run_session(requests),
        action.tool_call,
        "tool 'count': argument 'letter' must be string, got float",
    )


def test_regression_infinite_tool_argument_is_invalid_argument(seeds: Path) -> None:
    """Bug 3: ``history(last=inf)`` answered INTERNAL and broke the episode."""
    data = (seeds / "regression-infinite-tool-argument").read_bytes()
    assert data[0] % 4 == 3  # the tools target
    call = ToolCall.FromString(data[1:])
    assert call.arguments["last"] == math.inf
    reset = pb.SessionRequest(request_id=1)
    reset.reset.SetInParent()
    requests = [
        reset,
        _step(2, EchoAction(tool_call=call)),
        _step(3, EchoAction(message="still running")),
    ]
    _assert_refused_then_goes_on(
        _run_session(requests), call, "tool 'history': argument 'last' must be finite, got inf"
    )


def test_regression_infinite_info_decodes(seeds: Path) -> None:
    """Bug 4: an info map holding Infinity made ``info_from_struct`` raise ValueError."""
    data = (seeds / "regression-infinite-info").read_bytes()
    assert data[0] % 4 == 2  # the codec target
    struct = struct_pb2.Struct.FromString(_frames(data[1:])[2])
    assert info_from_struct(struct) == {"loss": math.inf}
    # And the rest of the non-finite family, nested as envs report them.
    mixed = struct_pb2.Struct()
    mixed.update({"nan": math.nan, "low": -math.inf, "nested": {"l": [math.inf, 1.5, None]}})
    decoded = info_from_struct(struct_pb2.Struct.FromString(mixed.SerializeToString()))
    assert math.isnan(decoded["nan"])
    assert decoded["low"] == -math.inf
    assert decoded["nested"] == {"l": [math.inf, 1.5, None]}


def test_fuzzer_runs_bounded_without_crash(tmp_path: Path) -> None:
    tried, output = _run_fuzzer(tmp_path, f"-runs={RUNS}")
    # The promise is RUNS inputs, not "some": a time cap reached first is a failure.
    assert tried >= RUNS, f"the fuzzer stopped after {tried} of {RUNS} inputs\n{output[-3000:]}"
