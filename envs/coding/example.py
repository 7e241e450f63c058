"""A runnable tour of the coding environment.

Run it with ``python -m openenv_grpc_envs.coding.example HOST:PORT``. It runs a program,
a crash and a runaway loop, then fixes a buggy function against its tests until every
test passes, which ends the episode.
"""

from __future__ import annotations

import sys

from openenv_grpc_envs.coding import (
    CodingAction,
    CodingEnv,
    CodingIoCase,
    CodingLimits,
    CodingResetOptions,
    CodingTestCase,
    Limit,
)

#: Two tests of an ``add`` function that reads "a b" from stdin.
TESTS = [
    CodingTestCase(name="add_zero", assertion="assert add(2, 0) == 2"),
    CodingTestCase(name="add_io", io=CodingIoCase(stdin="2 3\n", expected_stdout="5\n")),
]
PROGRAM = """\
def add(a, b):
    return a {op} b

if __name__ == "__main__":
    print(add(*map(int, input().split())))
"""


def main(target: str) -> None:
    with CodingEnv(target) as env:
        env.reset(options=CodingResetOptions(limits=CodingLimits(wall_ms=1000)))
        print(f"reset: workdir files {list(env.state().files)}")

        result = env.step(
            CodingAction(code="print('hello from the sandbox')\nopen('notes.txt', 'w')")
        )
        obs = result.observation
        print(f"step 1: stdout={obs.stdout!r} exit_code={obs.exit_code} {Limit.Name(obs.limit)}")

        obs = env.step(CodingAction(code="print(1 / 0)")).observation
        last_line = obs.stderr.strip().splitlines()[-1]
        print(f"step 2: exit_code={obs.exit_code} {Limit.Name(obs.limit)} {last_line!r}")

        obs = env.step(CodingAction(code="import time\ntime.sleep(60)")).observation
        print(f"step 3: exit_code={obs.exit_code} {Limit.Name(obs.limit)}")

        for op in ("-", "+"):  # a buggy add, then the fix
            result = env.step(CodingAction(code=PROGRAM.format(op=op), stdin="1 1\n", tests=TESTS))
            print(
                f"step {result.step_count}: add uses {op!r}: reward={result.reward:.2f} "
                f"terminated={result.terminated}"
            )
            for test in result.observation.tests:
                print(f"  {test.name}: {'passed' if test.passed else 'failed: ' + test.message}")

        state = env.state()
        print(f"state: step_count={state.step_count} files={list(state.files)}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051")
