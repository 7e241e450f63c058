"""The docs tell the truth about what they name: every ``pip install 'openenv-grpc[...]'``
names extras that exist, and docs/modules.md's table lists every server and client
module (a row per room of the server)."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
#: An install line (it may wrap in a docstring): pip install [options] 'openenv-grpc[a,b]'.
EXTRA = re.compile(r"pip\s+install\s+(?:-\S+\s+)*[`'\"]*openenv-grpc\[([^\]]+)\]")


def extras() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return set(project["project"]["optional-dependencies"])


def documents() -> list[Path]:
    """Markdown, Python sources and templates a user reads install lines in."""
    skip = {".venv", "node_modules", "build", ".git"}
    found = []
    for pattern in ("*.md", "*.py", "*.tmpl", "Makefile", "Dockerfile", "*.sh"):
        for path in ROOT.rglob(pattern):
            if not skip.intersection(path.relative_to(ROOT).parts) and path != Path(__file__):
                found.append(path)
    return found


def test_every_named_extra_exists() -> None:
    known = extras()
    named: dict[str, set[str]] = {}
    for path in documents():
        for match in EXTRA.finditer(path.read_text(encoding="utf-8", errors="replace")):
            for extra in match.group(1).split(","):
                named.setdefault(extra.strip(), set()).add(str(path.relative_to(ROOT)))
    assert named, "no install line found: the pattern is wrong"
    missing = {extra: sorted(paths) for extra, paths in named.items() if extra not in known}
    assert not missing, f"extras named but not in pyproject.toml: {missing}"


def test_module_table_lists_every_server_and_client_module() -> None:
    readme = (ROOT / "docs" / "modules.md").read_text(encoding="utf-8")
    server = ROOT / "openenv_grpc" / "server"
    rooms = [f"server/{p.name}" for p in server.iterdir() if (p / "__init__.py").exists()]
    assert len(rooms) >= 4, rooms
    for package in ("server", *rooms, "client"):
        row = next(line for line in readme.splitlines() if f"`openenv_grpc/{package}/`" in line)
        modules = {
            p.stem for p in (ROOT / "openenv_grpc" / package).glob("*.py") if p.stem != "__init__"
        }
        listed = set(re.findall(r"`([a-z_]+)`", row))
        assert modules <= listed, f"{package}: not in docs/modules.md's table: {modules - listed}"
