"""OpenEnv's catalogue through ``openenv-grpc serve --openenv``: which envs serve with one
command, and which answer exactly as OpenEnv's own server does.

For every env in OpenEnv's repository ``envs/`` folder (a checkout: ``fetch`` the repo,
then ``git --git-dir=... archive HEAD envs | tar -x -C ROOT``), from ``ROOT/envs`` (the
directory each env's own docs run uvicorn from):

1. ``openenv-grpc serve --openenv NAME.server.app:app`` -- the string uvicorn is given --
   must announce itself within the start timeout (else: its first error line);
2. OpenEnv's own server, ``python -m uvicorn NAME.server.app:app``, likewise;
3. when both serve: one episode (the seed, reset options and actions of
   :data:`SCENARIOS`, or a bare reset for an env without one) on both, compared as JSON
   text with :func:`openenv_grpc.integrations.openenv.parity.differences` (``1`` and
   ``1.0`` differ; a refused step must be refused on both).

Nothing is installed here: an env whose dependencies are missing is reported as such.
Each env runs in a subprocess of its own (their modules and descriptor files never
meet). Loopback only.

    python bench/openenv_catalogue.py --root /tmp/openenv-cat            # a table
    python bench/openenv_catalogue.py --root /tmp/openenv-cat --only connect4_env -v
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

START_TIMEOUT = 90.0
SERVING = re.compile(r"serving .* on 127\.0\.0\.1:(\d+)")
UVICORN = re.compile(r"running on http://127\.0\.0\.1:(\d+)")

#: Per env: (reset arguments as OpenEnv's client sends them, actions as OpenEnv's JSON,
#: environment variables both servers get).
SCENARIOS: dict[str, tuple[dict[str, Any], list[dict[str, Any]], dict[str, str]]] = {
    "echo_env": (
        {},
        [
            {"type": "list_tools"},
            {"type": "call_tool", "tool_name": "echo_message", "arguments": {"message": "hi"}},
            {"type": "call_tool", "tool_name": "echo_with_length",
             "arguments": {"message": "hello"}},
        ],
        {},
    ),
    "connect4_env": ({"seed": 0}, [{"column": c} for c in (3, 3, 4, 4, 5, 5, 6)], {}),
    "chess_env": ({"seed": 1}, [{"move": "e2e4"}, {"move": "e2e5"}, {"move": "d2d4"}], {}),
    "grid_world_env": (
        {"seed": 1},
        [{"action": a} for a in ("UP", "RIGHT", "DOWN", "DOWN", "RIGHT", "RIGHT", "DOWN")],
        {},
    ),
    "maze_env": ({"seed": 3}, [{"action": a} for a in (0, 1, 2, 3, 1, 1)], {}),
    "reasoning_gym_env": (
        {"seed": 42, "dataset_name": "leg_counting", "size": 3,
         "dataset_config": {"min_animals": 2, "max_animals": 3}},
        [{"answer": "4"}, {"answer": "7"}, {"answer": "10"}],
        {},
    ),
    # Wordle (the default) needs nltk's words corpus, a download: a game that needs none.
    "textarena_env": (
        {"seed": 1},
        [{"message": "[50]"}, {"message": "[25]"}, {"message": "guess"}, {"message": "[75]"}],
        {"TEXTARENA_DOWNLOAD_NLTK": "0", "TEXTARENA_ENV_ID": "GuessTheNumber-v0"},
    ),
    "repl_env": (
        {"seed": 1},
        [{"code": "x = 1 + 1\nprint(x)"}, {"code": "print(undefined_name)"},
         {"code": "print('FINAL(2)')"}],
        {},
    ),
    "openspiel_env": ({}, [{"action_id": 1}] * 12, {"OPENSPIEL_GAME": "catch"}),
    "coding_env": ({}, [{"code": "print(1 + 1)"}, {"code": "1 / 0"}, {"code": "x = 3"}], {}),
    # reset takes no seed: without a problem id it draws one at random.
    "kernrl": ({"problem_id": "L8_6_ChromaUpsampling"}, [], {}),
    # A second configuration of one folder: FOLDER:VARIANT. tic_tac_toe with an illegal
    # move (4 twice): an error on both servers, and the game goes on.
    "openspiel_env:tic_tac_toe": (
        {},
        [{"action_id": a} for a in (4, 4, 8, 2, 6, 3, 5, 7)],
        {"OPENSPIEL_GAME": "tic_tac_toe", "OPENSPIEL_OPPONENT_POLICY": "first"},
    ),
}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", required=True, type=Path, help="holds OpenEnv's envs/")
    parser.add_argument("--only", help="comma-separated env folder names")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the per-env subprocess
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument(
        "--control",
        action="store_true",
        help="compare OpenEnv's server with a second OpenEnv server instead of ours: "
        "what differs then is the env's own nondeterminism",
    )
    args = parser.parse_args()
    envs_dir = (args.root / "envs").resolve()
    if args.one:
        print(json.dumps(measure(envs_dir, args.one, args.control)), flush=True)
        return 0
    names = sorted(p.name for p in envs_dir.iterdir() if p.is_dir() and (p / "server").is_dir())
    names = sorted(names + [k for k in SCENARIOS if k.partition(":")[0] in names and ":" in k])
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    rows = []
    for name in names:
        started = time.monotonic()
        try:
            done = subprocess.run(
                [sys.executable, __file__, "--root", str(args.root), "--one", name]
                + (["--control"] if args.control else []),
                capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            # The env's own logging may follow (atexit handlers): the row is the last
            # line that is one.
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith('{"env"')]
            row = json.loads(lines[-1])
        except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError) as exc:
            row = {"env": name, "ours": f"measure failed: {type(exc).__name__}"}
        row["seconds"] = round(time.monotonic() - started, 1)
        rows.append(row)
        if args.verbose:
            print(json.dumps(row), file=sys.stderr)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def measure(envs_dir: Path, name: str, control: bool = False) -> dict[str, Any]:
    ref = f"{name.partition(':')[0]}.server.app:app"
    reset, actions, extra_env = SCENARIOS.get(name, ({}, [], {}))
    # One hash seed for both servers: an env that lists a set (repl_env's variables)
    # lists it in the same order on both.
    environ = {**os.environ, **extra_env, "PYTHONPATH": str(envs_dir), "PYTHONHASHSEED": "0"}
    row: dict[str, Any] = {"env": name, "scenario": name in SCENARIOS}
    with (
        _process(
            [sys.executable, "-m", "uvicorn", ref, "--host", "127.0.0.1", "--port", "0"]
            if control else
            [sys.executable, "-m", "openenv_grpc", "serve", "--openenv", ref,
             "--host", "127.0.0.1", "--port", "0", "--max-concurrent-envs", "1"],
            envs_dir, environ, UVICORN if control else SERVING,
        ) as (ours, our_error),
        _process(
            [sys.executable, "-m", "uvicorn", ref, "--host", "127.0.0.1", "--port", "0"],
            envs_dir, environ, UVICORN,
        ) as (theirs, their_error),
    ):  # fmt: skip
        row["ours"] = "serves" if ours else our_error
        row["openenv"] = "serves" if theirs else their_error
        if not (ours and theirs):
            return row
        sys.path.insert(0, str(envs_dir))
        os.environ.update(extra_env)
        from openenv_grpc.integrations.openenv.parity import (
            compared,
            differences,
            grpc_episode,
            openenv_episode,
        )
        from openenv_grpc.integrations.openenv.serving import adapter_for

        try:
            theirs_answers = openenv_episode(f"http://127.0.0.1:{theirs}", reset, actions)
            if control:
                ours_answers = openenv_episode(f"http://127.0.0.1:{ours}", reset, actions)
            else:
                ours_answers = grpc_episode(adapter_for(ref), f"127.0.0.1:{ours}", reset, actions)
        except Exception as exc:
            row["same"] = f"episode failed: {type(exc).__name__}: {str(exc)[:200]}"
            return row
        found = differences(ours_answers, theirs_answers)
        count = compared(ours_answers, theirs_answers)
        row["answers"] = count
        row["after_done"] = len(theirs_answers) - count
        row["errors"] = sum("error" in a for a in theirs_answers[:count])
        row["same"] = "yes" if not found else "no"
        row["differences"] = found[:5]
    return row


@contextlib.contextmanager
def _process(
    command: list[str], cwd: Path, environ: dict[str, str], announce: re.Pattern[str]
) -> Iterator[tuple[int | None, str]]:
    """Start ``command``; yields (its port, "") once it announces one, else (None, why)."""
    process = subprocess.Popen(
        command, cwd=cwd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    port: int | None = None
    deadline = time.monotonic() + START_TIMEOUT
    try:
        assert process.stdout is not None
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip())
            match = announce.search(line)
            if match:
                port = int(match.group(1))
                break
        if port is None:
            yield None, _why(lines)
        else:
            # Keep reading its output, so a chatty server never blocks on a full pipe.
            threading.Thread(target=_drain, args=(process.stdout,), daemon=True).start()
            yield port, ""
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 9)
        process.wait(10)


def _drain(stream: Any) -> None:
    for _ in stream:
        pass


def _why(lines: list[str]) -> str:
    """The line that says why a server did not start (an exception's last line)."""
    for line in reversed(lines):
        if re.match(r"^\w*(Error|Exception|openenv-grpc:)", line.strip()) or "Error:" in line:
            return line.strip()[:160]
    return (lines[-1].strip()[:160] if lines else "no output") or "no output"


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| env | `serve --openenv NAME.server.app:app` | OpenEnv's `uvicorn` | same answers |",
        "|---|---|---|---|",
    ]
    for row in rows:
        same = row.get("same", "—")
        if same in ("yes", "no"):
            after = row.get("after_done")
            same = (
                f"{same} ({row['answers']} answers, {row['errors']} errors"
                f"{'' if row.get('scenario') else ', reset only'}"
                f"{f'; {after} steps after done not compared' if after else ''})"
            )
            if row.get("differences"):
                same += ": " + "; ".join(d[:120] for d in row["differences"][:2])
        out.append(
            f"| {row['env']} | {_cell(row.get('ours', '—'))} | "
            f"{_cell(row.get('openenv', '—'))} | {_cell(same)} |"
        )
    return "\n".join(out)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


if __name__ == "__main__":
    sys.exit(main())
