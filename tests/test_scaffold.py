"""``openenv-grpc init``: the walkthrough in docs/write-your-own-env.md, run as written.

The doc's checked blocks scaffold a project, generate its code, run *its* tests
unmodified (conformance suite + game tests, real servers) and ``buf lint`` its proto.
Then the project is installed into a scratch folder (not this venv) and served by its
entry-point name, which the Dockerfile's CMD relies on, and the Dockerfile's HEALTHCHECK
command runs against it. Name checks and refusing to overwrite come last.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from openenv_grpc.scaffold import ScaffoldError, scaffold, validate_name
from openenv_grpc.scaffold.project import FILES, ProjectNames, render
from openenv_grpc.testing import EnvConformance, ServerProcess

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "write-your-own-env.md"
BUF = ROOT / "node_modules" / ".bin" / "buf"
BIN = Path(sys.executable).parent  # openenv-grpc, protoc-gen-mypy, pytest live here
CHECKED = "<!-- checked by tests/test_scaffold.py -->"
NAME = "guess"


def checked_commands() -> list[str]:
    """The commands of the doc's checked ```bash blocks, in order."""
    blocks = re.findall(re.escape(CHECKED) + r"\n```bash\n(.*?)```", DOC.read_text(), re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def tool_env() -> dict[str, str]:
    """This venv's tools and buf first on PATH, as for a reader with an active venv."""
    path = os.pathsep.join([str(BIN), str(BUF.parent), os.environ.get("PATH", "")])
    return {**os.environ, "PATH": path}


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """Run the doc's checked commands in a fresh folder; (project folder, output)."""
    assert BUF.exists(), f"{BUF} missing: run `make install` (npm ci)"
    home = tmp_path_factory.mktemp("walkthrough")
    script = "set -euo pipefail\n" + "\n".join(checked_commands()) + "\n"
    run = subprocess.run(
        ["bash", "-c", script], cwd=home, env=tool_env(),
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    output = f"$ {script}\n--- stdout\n{run.stdout}\n--- stderr\n{run.stderr}"
    assert run.returncode == 0, output
    yield home / "projects" / NAME, output


def test_doc_checks_the_whole_round_trip() -> None:
    commands = checked_commands()
    assert commands == [
        f"openenv-grpc init {NAME} --dir projects",
        f"cd projects/{NAME}",
        "make proto",
        "python -m pytest -q",
        "buf lint",
    ]


def test_walkthrough_passes_the_projects_own_tests(walkthrough: tuple[Path, str]) -> None:
    project, output = walkthrough
    # The conformance suite (every check) and the game's tests (3) ran and passed.
    checks = sum(name.startswith("test_") for name in dir(EnvConformance))
    assert re.search(rf"\b{checks + 3} passed\b", output), output
    assert not re.search(r"\d+ (failed|errors?)\b", output), output
    generated = project / NAME / "v1"
    assert (generated / f"{NAME}_pb2.py").is_file() and (generated / f"{NAME}_pb2.pyi").is_file()
    assert "created" in output and f"projects/{NAME}" in output  # init said where


def test_generated_proto_follows_the_repo_conventions(walkthrough: tuple[Path, str]) -> None:
    project, _ = walkthrough
    proto = (project / "proto" / NAME / "v1" / f"{NAME}.proto").read_text()
    assert f"package {NAME}.v1;" in proto
    assert re.search(r"^lint:\n  use:\n    - STANDARD\n    - COMMENTS$", (
        project / "buf.yaml").read_text(), re.M)  # fmt: skip
    # The same checks fail on an uncommented field: buf lint really ran on this proto.
    broken = project.parent / "broken"
    (broken / "proto" / NAME / "v1").mkdir(parents=True)
    (broken / "buf.yaml").write_text((project / "buf.yaml").read_text())
    (broken / "proto" / NAME / "v1" / f"{NAME}.proto").write_text(
        proto.replace("  // The guessed number, from 1 to the episode's max_number.\n", "")
    )
    run = subprocess.run([str(BUF), "lint"], cwd=broken, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0, run.stdout
    assert 'Field "guess" should have a non-empty comment' in run.stdout, run.stdout


def test_installed_project_serves_by_name_and_its_healthcheck_passes(
    walkthrough: tuple[Path, str], tmp_path: Path
) -> None:
    project, _ = walkthrough
    site = tmp_path / "site"  # a --target folder: this venv stays as it was
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
         "--no-build-isolation", "--target", str(site), str(project)],
        check=True, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    listed = subprocess.run(
        [str(BIN / "openenv-grpc"), "list"], env={**os.environ, "PYTHONPATH": str(site)},
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.split()  # fmt: skip
    assert NAME in listed

    dockerfile = (project / "Dockerfile").read_text()
    assert json.loads(dockerfile.split("\nCMD ", 1)[1].splitlines()[0]) == [
        "openenv-grpc", "serve", NAME,
    ]  # fmt: skip
    assert re.search(r"^FROM \$\{BASE\}$", dockerfile, re.M)
    assert re.search(r"^ARG BASE=python:3\.\d+-slim$", dockerfile, re.M)
    assert re.search(r"^USER 10001$", dockerfile, re.M)
    for variable in ("HOST=0.0.0.0", "PORT=50051", "MAX_CONCURRENT_ENVS="):
        assert variable in dockerfile
    healthcheck = healthcheck_command(dockerfile)

    server = ServerProcess(NAME, pythonpath=[site])  # by entry-point name, as CMD does
    try:
        assert server.info().env_name == NAME
        probe = subprocess.run(
            healthcheck, env={**os.environ, "PORT": str(server.port)},
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert probe.returncode == 0, probe.stderr
        example = subprocess.run(
            [sys.executable, "-m", f"{NAME}.example", server.target],
            env={**os.environ, "PYTHONPATH": str(site)},
            check=True, capture_output=True, text=True, timeout=60,
        ).stdout  # fmt: skip
        assert example.splitlines() == doc_example_output()
    finally:
        server.stop()
    gone = subprocess.run(
        healthcheck, env={**os.environ, "PORT": str(server.port)},
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert gone.returncode != 0  # no server: unhealthy


def healthcheck_command(dockerfile: str) -> list[str]:
    """The HEALTHCHECK's exec-form command, with this interpreter as ``python``."""
    logical = dockerfile.replace("\\\n", " ")
    line = next(ln for ln in logical.splitlines() if ln.startswith("HEALTHCHECK "))
    command: list[str] = json.loads(line.split(" CMD ", 1)[1])
    assert command[:2] == ["python", "-c"] and "grpc_health" in command[2]
    return [sys.executable, *command[1:]]


def doc_example_output() -> list[str]:
    """The example output the doc promises (the block after 'by binary search:')."""
    text = DOC.read_text()
    block = text.split("by binary search:\n\n```\n", 1)[1].split("```", 1)[0]
    return block.splitlines()


def test_refuses_to_overwrite_an_existing_project(walkthrough: tuple[Path, str]) -> None:
    project, _ = walkthrough
    before = sorted(p.relative_to(project) for p in project.rglob("*"))
    run = subprocess.run(
        [str(BIN / "openenv-grpc"), "init", NAME, "--dir", str(project.parent)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2
    assert run.stderr.strip() == f"openenv-grpc: {project} already exists; not overwriting it"
    assert sorted(p.relative_to(project) for p in project.rglob("*")) == before
    assert [p.name for p in project.parent.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("Guess", "lower_snake_case"),
        ("my-Env", "lower_snake_case"),
        ("2048", "lower_snake_case"),
        ("a__b", "lower_snake_case"),
        ("trailing_", "lower_snake_case"),
        ("x" * 25, "longer than 24"),
        ("class", "keyword"),
        ("message", "keyword"),
        ("json", "standard or reserved"),
        ("tests", "standard or reserved"),
        ("echo", "already a registered environment"),
        ("grpc", "importable module"),
        ("openenv_grpc", "importable module"),
    ],
)
def test_bad_names_are_refused(tmp_path: Path, name: str, why: str) -> None:
    with pytest.raises(ScaffoldError, match=why):
        validate_name(name)
    run = subprocess.run(
        [str(BIN / "openenv-grpc"), "init", name, "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2 and why in run.stderr, run.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_every_template_renders_completely(tmp_path: Path) -> None:
    project = scaffold("a_b2", tmp_path / "new" / "dir")  # missing parents are made
    assert sorted(str(p.relative_to(project)) for p in project.rglob("*") if p.is_file()) == (
        sorted(render(dest, ProjectNames.of("a_b2").values()) for dest in FILES.values())
    )
    for path in project.rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert not re.search(r"\{\{\s*[A-Za-z_]", text), f"placeholder left in {path}"
    assert "class AB2Environment(" in (project / "a_b2" / "environment.py").read_text()
    assert "package a_b2.v1;" in (project / "proto" / "a_b2" / "v1" / "a_b2.proto").read_text()
    assert 'a_b2 = "a_b2.environment:AB2Environment"' in (project / "pyproject.toml").read_text()


def test_generated_python_passes_ruff_for_short_and_long_names(tmp_path: Path) -> None:
    for name in ("x", "abcdefghij_klmnopqrs_tuv"):
        project = scaffold(name, tmp_path)
        for command in ("ruff check --quiet .", "ruff format --check --quiet ."):
            run = subprocess.run(
                [str(BIN / "ruff"), *shlex.split(command)[1:]], cwd=project,
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert run.returncode == 0, f"{name}: {command}\n{run.stdout}{run.stderr}"
