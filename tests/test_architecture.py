"""Dependencies run one way: the periphery imports the core, never the reverse.

Core: the env contract, the codec, the wire names, the server, the client (and the
generated messages they share). Periphery: providers, the console, the scaffold, the test
helpers, the CLI and any integration package. Every import of every library module is read
with ``ast`` -- also those inside functions, under ``TYPE_CHECKING``, and module names
given to ``importlib.import_module`` as literals -- so a back-edge cannot hide in a lazy
import.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

LIBRARY = Path(__file__).resolve().parent.parent / "openenv_grpc"

#: Top-level parts of the library that are core; everything else is periphery.
CORE = {
    "__init__", "_version", "environment", "codec", "metadata", "loader", "tools",
    "server", "client", "v1",
}  # fmt: skip
PERIPHERY = {"providers", "console", "scaffold", "testing", "cli", "__main__", "integrations"}

#: (importer part, imported part) pairs that must never occur, beyond core -> periphery.
FORBIDDEN = {
    ("client", "server"),  # the two halves of the protocol share only core modules
    ("server", "client"),
    ("providers", "server"),  # a provider runs servers as processes, it never embeds one
}


def part_of(module: str) -> str | None:
    """The library part a dotted module name belongs to (None: not the library)."""
    names = module.split(".")
    if names[0] != "openenv_grpc":
        return None
    return names[1] if len(names) > 1 else "__init__"


def module_name(path: Path) -> str:
    relative = path.relative_to(LIBRARY.parent).with_suffix("")
    return ".".join(relative.parts)


def imports_of(path: Path, module: str) -> Iterator[tuple[int, str]]:
    """Every module that ``path`` (the source of ``module``) imports: (line, dotted name)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module.removesuffix(".__init__") if path.name == "__init__.py" else module
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield node.lineno, base
            for alias in node.names:  # `from openenv_grpc import providers` names a module
                yield node.lineno, f"{base}.{alias.name}"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value


def library_files() -> list[tuple[Path, str]]:
    """Every hand-written module of the library, with its dotted name."""
    paths = sorted(p for p in LIBRARY.rglob("*.py") if "_pb2" not in p.name)
    return [(p, module_name(p)) for p in paths]


def test_every_library_part_is_classified() -> None:
    parts = {part_of(module) for _, module in library_files()}
    unknown = parts - CORE - PERIPHERY
    assert not unknown, f"classify these parts as core or periphery: {sorted(unknown)}"


def back_edges(files: list[tuple[Path, str]]) -> list[str]:
    """``module:line imports name`` for every forbidden import in ``files``."""
    found = []
    for path, module in files:
        importer = part_of(module)
        for line, imported in imports_of(path, module):
            target = part_of(imported)
            if target is None:
                bad = imported.split(".")[0] == "openenv_grpc_envs" and importer in CORE
            else:
                bad = (importer in CORE and target in PERIPHERY) or (
                    importer,
                    target,
                ) in FORBIDDEN
            if bad:
                found.append(f"{module}:{line} imports {imported}")
    return found


def test_no_back_edges() -> None:
    """Core never imports periphery (nor an environment); the client and the server share
    only core modules; providers import no server module."""
    assert back_edges(library_files()) == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from openenv_grpc.providers.base import Provider", "openenv_grpc.providers.base"),
        ("import openenv_grpc.console.app", "openenv_grpc.console.app"),
        ("from openenv_grpc import providers", "openenv_grpc.providers"),
        ("def f():\n    from ..providers import local", "openenv_grpc.providers.local"),
        ("importlib.import_module('openenv_grpc.providers.docker_provider')",
         "openenv_grpc.providers.docker_provider"),
    ],
)  # fmt: skip
def test_the_walk_sees_every_kind_of_import(tmp_path: Path, source: str, expected: str) -> None:
    """The checker itself: a lazy, relative or importlib import is still an import, and a
    client module making it is a back-edge."""
    probe = tmp_path / "probe.py"
    probe.write_text(source + "\n", encoding="utf-8")
    module = "openenv_grpc.client.probe"
    assert expected in {name for _, name in imports_of(probe, module)}
    edge = f"{module}:{source.count(chr(10)) + 1} imports {expected}"
    assert edge in back_edges([(probe, module)])


# -- the server's rooms ---------------------------------------------------------------------

SERVER = LIBRARY / "server"

#: The server's rooms, from the bottom up: a module imports from its own room and the rooms
#: below it, never from one above (docs/architecture.md draws them).
ROOMS = ("process", "model", "local", "isolated", "stream")

#: Modules at the server's top level. The leaves are shared by every room and import no
#: other server module; the composition (``app``, ``service``, the package's face) sits
#: above every room.
LEAVES = {"errors", "config"}
COMPOSITION = {"app", "service", "__init__"}


def server_place(module: str) -> str | None:
    """The room (or top-level module) a dotted module name of the server is in."""
    names = module.split(".")
    if names[:2] != ["openenv_grpc", "server"]:
        return None
    if len(names) == 2:
        return "__init__"
    return names[2]


def test_the_server_is_rooms_and_a_few_top_modules() -> None:
    top = {p.stem for p in SERVER.glob("*.py")}
    rooms = {p.name for p in SERVER.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert top == LEAVES | COMPOSITION, f"a new top-level module belongs in a room: {top}"
    assert rooms == set(ROOMS)
    assert len(top) <= 8


def room_breaches(files: list[tuple[Path, str]]) -> list[str]:
    """``module:line imports name`` for every server import that runs against the rooms."""
    found = []
    for path, module in files:
        place = server_place(module)
        if place is None:
            continue
        for line, imported in imports_of(path, module):
            target = server_place(imported)
            if target is None or target == place:
                continue
            if place in LEAVES:
                bad = target != "errors" or place == "errors"  # config may word an error
            elif place in COMPOSITION:
                bad = target in COMPOSITION - {"app", "service"} and place != "__init__"
            else:
                bad = target in COMPOSITION or (
                    target in ROOMS and ROOMS.index(target) > ROOMS.index(place)
                )
            if bad:
                found.append(f"{module}:{line} imports {imported}")
    return found


def test_server_rooms_import_downwards_only() -> None:
    """process < model < local < isolated < stream < (app, service): no room imports one
    above it, the leaves import no room, nothing below imports the composition."""
    assert room_breaches(library_files()) == []


@pytest.mark.parametrize(
    ("module", "source", "bad"),
    [
        ("openenv_grpc.server.model.spec", "from openenv_grpc.server.stream import driver", True),
        ("openenv_grpc.server.stream.driver", "from openenv_grpc.server.model import spec", False),
        ("openenv_grpc.server.local.calls", "from openenv_grpc.server.app import EnvServer", True),
        ("openenv_grpc.server.errors", "from openenv_grpc.server.model.spec import EnvSpec", True),
        ("openenv_grpc.server.process.budget", "from openenv_grpc.server.errors import X", False),
    ],
)  # fmt: skip
def test_the_room_check_sees_a_breach(tmp_path: Path, module: str, source: str, bad: bool) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(source + "\n", encoding="utf-8")
    assert bool(room_breaches([(probe, module)])) is bad
