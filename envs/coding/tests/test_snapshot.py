"""The coding env's snapshot in-process: the working directory (files, directories,
links, modes) and the counters come back in a fresh sandbox, links are never followed,
and the caps hold."""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from openenv_grpc import InvalidAction
from openenv_grpc_envs.coding import CodingAction, CodingLimits, CodingResetOptions
from openenv_grpc_envs.coding.environment import CodingEnvironment
from openenv_grpc_envs.coding.workspace import MAX_ENTRIES, MAX_FILE_BYTES

FAST = CodingLimits(cpu_seconds=2, wall_ms=8000, memory_mb=128, processes=16)
#: Builds a small tree: nested files, a binary file, modes, a link out, a fifo, a dir link.
BUILD = """\
import os
os.makedirs("pkg/sub", exist_ok=True)
open("pkg/__init__.py", "w").write("VALUE = 41\\n")
open("pkg/sub/data.bin", "wb").write(bytes(range(256)))
os.chmod("pkg/sub/data.bin", 0o640)
os.chmod("pkg/sub", 0o750)
os.symlink("/etc/shadow", "shadow")
os.symlink("pkg", "pkg_link")
os.mkfifo("pipe")
print("built")
"""
#: Lists the tree as the sandbox sees it.
LIST = """\
import os, json
seen = {}
for folder, dirs, files in os.walk("."):
    for name in sorted(dirs + files):
        path = os.path.join(folder, name)[2:]
        info = os.lstat(path)
        link = os.readlink(path) if os.path.islink(path) else None
        data = None
        if os.path.isfile(path) and not os.path.islink(path):
            data = open(path, "rb").read().hex()
        seen[path] = [oct(info.st_mode), info.st_uid == os.getuid(), link, data]
import pkg
print(json.dumps(seen, sort_keys=True), pkg.VALUE + 1)
"""


@pytest.fixture
def env() -> Iterator[CodingEnvironment]:
    made = CodingEnvironment()
    yield made
    made.close()


def started(env: CodingEnvironment) -> None:
    env.reset(seed=None, episode_id="e", options=CodingResetOptions(limits=FAST, max_steps=5))
    built = env.step(CodingAction(code=BUILD))
    assert built.observation.stdout == "built\n", built.observation.stderr


def listing(env: CodingEnvironment) -> dict[str, Any]:
    result = env.step(CodingAction(code=LIST))
    assert result.observation.exit_code == 0, result.observation.stderr
    text, value = result.observation.stdout.rsplit(" ", 1)
    assert value.strip() == "42"
    return dict(json.loads(text))


def test_the_working_directory_comes_back_in_a_fresh_sandbox(env: CodingEnvironment) -> None:
    started(env)
    snapshot = env.snapshot()
    expected = listing(env)
    fresh = CodingEnvironment()
    try:
        fresh.restore(snapshot)
        state = fresh.state()
        assert state.step_count == 1 and state.max_steps == 5
        assert state.limits.memory_mb == 128
        assert state.workdir != env.state().workdir
        seen = listing(fresh)
        del expected["pipe"]  # a fifo is left out
        assert seen == expected  # same bytes, modes, links; owned by the new sandbox's uid
        assert seen["shadow"][2] == "/etc/shadow" and seen["shadow"][3] is None
        assert stat.S_IMODE(int(seen["pkg/sub/data.bin"][0], 8)) == 0o640
        # The counters came back too: steps 3 to 5 of max_steps=5 (the listing was step 2).
        flags = [fresh.step(CodingAction(code="pass")).truncated for _ in range(3)]
        assert flags == [False, False, True]
    finally:
        fresh.close()


def test_a_link_is_recorded_as_a_link_never_followed(env: CodingEnvironment) -> None:
    started(env)
    body = json.loads(env.snapshot())
    entries = {e["path"]: e for e in body["files"]}
    link = {"path": "shadow", "kind": "link", "mode": 0, "target": "/etc/shadow"}
    assert entries["shadow"] == link
    assert "pkg_link/__init__.py" not in entries and "pipe" not in entries


def test_a_workspace_over_the_byte_cap_is_refused(env: CodingEnvironment) -> None:
    env.reset(seed=None, episode_id="e", options=CodingResetOptions(limits=FAST))
    big = f"open('big', 'wb').write(b'x' * {MAX_FILE_BYTES + 1})"
    assert env.step(CodingAction(code=big)).observation.exit_code == 0
    with pytest.raises(InvalidAction, match=f"more than {MAX_FILE_BYTES} bytes of files"):
        env.snapshot()


def test_a_workspace_over_the_entry_cap_is_refused(env: CodingEnvironment) -> None:
    env.reset(seed=None, episode_id="e", options=CodingResetOptions(limits=FAST))
    many = f"for i in range({MAX_ENTRIES + 1}): open(f'f{{i}}', 'w').close()"
    assert env.step(CodingAction(code=many)).observation.exit_code == 0
    with pytest.raises(InvalidAction, match=f"more than {MAX_ENTRIES} entries"):
        env.snapshot()


def file_entry(path: str, **extra: Any) -> dict[str, Any]:
    return {"path": path, "kind": "file", "mode": 0o644, "data": "aGk=", **extra}


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ([file_entry("../escape")], "'../escape' is not a plain relative path"),
        ([file_entry("/etc/x")], "'/etc/x' is not a plain relative path"),
        ([file_entry("a//b")], "'a//b' is not a plain relative path"),
        ([file_entry("a"), file_entry("a")], "'a' is listed twice"),
        (  # a file written through a link would land outside the directory
            [{"path": "l", "kind": "link", "mode": 0, "target": "/etc"}, file_entry("l/passwd")],
            "'l/passwd' is not inside a directory listed before it",
        ),
        ([file_entry("a", mode=0o4755)], "mode is 2541, outside 0..511"),
        ([file_entry("a", kind="fifo")], "kind is 'fifo', not one of dir, file, link"),
        ([file_entry("a", data="!!")], "files[0].data is not base64"),
    ],
)
def test_a_listing_that_could_escape_or_does_not_fit_is_refused(
    env: CodingEnvironment, tmp_path: Path, files: list[dict[str, Any]], message: str
) -> None:
    started(env)
    good = json.loads(env.snapshot())
    before = env.state()
    good["files"] = files
    with pytest.raises(InvalidAction, match=re.escape(message)):
        env.restore(json.dumps(good).encode())
    assert env.state() == before  # the episode and its sandbox stand
    assert os.path.isdir(before.workdir)
    assert not os.path.exists("/etc/x")


def test_limits_over_their_caps_are_refused(env: CodingEnvironment) -> None:
    started(env)
    body = json.loads(env.snapshot())
    body["limits"]["wallMs"] = 120_001
    with pytest.raises(InvalidAction, match=r"limits\.wall_ms is 120001; the server.s maximum"):
        env.restore(json.dumps(body).encode())


def test_the_network_is_refused_where_the_server_forbids_it(env: CodingEnvironment) -> None:
    started(env)
    body = json.loads(env.snapshot())
    body["allow_network"] = True  # taken on a server that allows it, say
    with pytest.raises(InvalidAction, match="this server does not allow the sandbox network"):
        env.restore(json.dumps(body).encode())
