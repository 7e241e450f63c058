"""Render a new environment project from the templates shipped in this package.

Templates are plain files in ``templates/`` with ``{{key}}`` placeholders, replaced by
:func:`render` (no template engine: nothing to learn, nothing to install). The project is
written to a temporary sibling folder and renamed into place, so a failure never leaves
half a project behind.
"""

from __future__ import annotations

import importlib.util
import keyword
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from openenv_grpc._version import __version__
from openenv_grpc.loader import available_envs

__all__ = [
    "FILES",
    "ProjectNames",
    "ScaffoldError",
    "package_name",
    "render",
    "scaffold",
    "validate_name",
]

_TEMPLATES = "openenv_grpc.scaffold.templates"
#: Template file (in ``templates/``) -> where it goes in the project, itself a template.
FILES: Mapping[str, str] = {
    "README.md.tmpl": "README.md",
    "pyproject.toml.tmpl": "pyproject.toml",
    "Makefile.tmpl": "Makefile",
    "buf.yaml.tmpl": "buf.yaml",
    "Dockerfile.tmpl": "Dockerfile",
    "dockerignore.tmpl": ".dockerignore",
    "gitignore.tmpl": ".gitignore",
    "env.proto.tmpl": "proto/{{name}}/v1/{{name}}.proto",
    "package_init.py.tmpl": "{{name}}/__init__.py",
    "environment.py.tmpl": "{{name}}/environment.py",
    "client.py.tmpl": "{{name}}/client.py",
    "example.py.tmpl": "{{name}}/example.py",
    "py.typed.tmpl": "{{name}}/py.typed",
    "v1_init.py.tmpl": "{{name}}/v1/__init__.py",
    "test_conformance.py.tmpl": "tests/test_conformance.py",
    "test_game.py.tmpl": "tests/test_game.py",
}

_MESSAGE_KINDS = ("Action", "Observation", "ResetOptions", "State")
# lower_snake_case or kebab-case: the package is the name with "_" for "-".
_NAME = re.compile(r"[a-z][a-z0-9]*([_-][a-z0-9]+)*")
_MAX_NAME = 24
_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
# Words protoc reads as keywords in a package name, and top-level packages protobuf owns.
_PROTO_RESERVED = frozenset(
    {
        "enum", "extend", "extensions", "false", "google", "import", "inf", "map", "max",
        "message", "nan", "oneof", "option", "optional", "package", "public", "repeated",
        "required", "reserved", "returns", "rpc", "service", "stream", "syntax", "to", "true",
        "weak",
    }
)  # fmt: skip


class ScaffoldError(Exception):
    """The project cannot be made: a bad name or an existing folder (message says which)."""


@dataclass(frozen=True, slots=True)
class ProjectNames:
    """Every spelling of the project's name the templates use.

    Attributes:
        name: The Python package and proto package root (``guess_game``).
        env: The env's name as given to ``init``: its ``Environment.name``, the entry
            point ``openenv-grpc serve`` finds it by, the project folder (``guess-game``
            or ``guess_game``).
        camel: The CamelCase prefix of its classes and messages (``GuessGame``).
        dist: The distribution name in pyproject.toml (``guess-game``).
        openenv_version: The openenv-grpc version the project depends on, at least.
    """

    name: str
    env: str
    camel: str
    dist: str
    openenv_version: str

    @classmethod
    def of(cls, name: str) -> ProjectNames:
        """The spellings of a name already checked by :func:`validate_name`."""
        package = package_name(name)
        camel = "".join(part[:1].upper() + part[1:] for part in package.split("_"))
        return cls(package, name, camel, package.replace("_", "-"), __version__)

    def values(self) -> dict[str, str]:
        """Placeholder -> value, for :func:`render`."""
        clients = [f"Async{self.camel}Env", f"{self.camel}Env"]
        messages = [f"{self.camel}{kind}" for kind in _MESSAGE_KINDS]
        exported = [*clients, f"{self.camel}Environment", *messages]
        return {
            "name": self.name,
            "env": self.env,
            "Class": self.camel,
            "dist": self.dist,
            "openenv_version": self.openenv_version,
            # Name lists whose sorted order depends on the name are sorted here, so the
            # generated code passes isort-style lint checks whatever the name.
            "client_imports": _lines(clients, "    {},"),
            "client_all": _lines(clients, '    "{}",'),
            "package_all": _lines(exported, '    "{}",'),
        }


def _lines(names: list[str], pattern: str) -> str:
    return "\n".join(pattern.format(name) for name in sorted(names))


def package_name(name: str) -> str:
    """The Python and proto package of the env ``name``: ``my-env`` -> ``my_env``.

    Returns:
        ``name`` with each ``-`` replaced by ``_``.
    """
    return name.replace("-", "_")


def validate_name(name: str) -> None:
    """Check that ``name`` can be an env name and, with ``_`` for ``-``, a Python package
    and a proto package.

    Raises:
        ScaffoldError: it is neither lower_snake_case nor kebab-case, is too long, its
            package is a Python or protobuf keyword or names a module this Python can
            already import, or it names an env already registered under the
            ``openenv_grpc.envs`` entry points.
    """
    if not _NAME.fullmatch(name):
        raise ScaffoldError(
            f"invalid name {name!r}: use lower_snake_case or kebab-case, a letter first "
            "(lower-case letters and digits, words joined by single '_' or '-'; e.g. "
            "'guess_game' or 'guess-game', whose Python package is guess_game)"
        )
    if len(name) > _MAX_NAME:
        raise ScaffoldError(f"invalid name {name!r}: longer than {_MAX_NAME} characters")
    package = package_name(name)
    spelled = repr(name) if package == name else f"{name!r} (package {package!r})"
    if keyword.iskeyword(package) or package in _PROTO_RESERVED:
        raise ScaffoldError(f"invalid name {spelled}: a Python or protobuf keyword")
    if package in sys.stdlib_module_names or package in {"test", "tests", "proto"}:
        raise ScaffoldError(f"name {spelled} clashes with a standard or reserved module")
    if name in available_envs():
        raise ScaffoldError(f"name {name!r} is already a registered environment")
    try:
        # The project's package would shadow (or be shadowed by) an importable one.
        taken = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        taken = True
    if taken:
        raise ScaffoldError(f"name {spelled} clashes with an importable module of that name")


def render(text: str, values: Mapping[str, str]) -> str:
    """Replace each ``{{key}}`` in ``text`` with ``values[key]``.

    Text such as ``{{.State}}`` (a Docker template) is not a placeholder and stays.

    Returns:
        The rendered text.

    Raises:
        KeyError: a placeholder has no value (a bug in a template).
    """

    def substitute(match: re.Match[str]) -> str:
        key = match.group(1)
        if key not in values:
            raise KeyError(f"template placeholder {{{{{key}}}}} has no value")
        return values[key]

    return _PLACEHOLDER.sub(substitute, text)


def scaffold(name: str, directory: str | os.PathLike[str] = ".") -> Path:
    """Write a new environment project called ``name`` into ``directory/name`` (its
    package is :func:`package_name` of ``name``).

    ``directory`` is created if missing; ``directory/name`` must not exist.

    Returns:
        The project's folder.

    Raises:
        ScaffoldError: the name is invalid (see :func:`validate_name`) or the folder exists.
        OSError: the folder could not be written.
    """
    validate_name(name)
    parent = Path(directory)
    target = parent / name
    if target.exists() or target.is_symlink():
        raise ScaffoldError(f"{target} already exists; not overwriting it")
    parent.mkdir(parents=True, exist_ok=True)
    values = ProjectNames.of(name).values()
    templates = resources.files(_TEMPLATES)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=parent))
    try:
        for template, destination in FILES.items():
            path = staging / render(destination, values)
            path.parent.mkdir(parents=True, exist_ok=True)
            text = templates.joinpath(template).read_text(encoding="utf-8")
            path.write_text(render(text, values), encoding="utf-8")
        staging.chmod(0o755)  # mkdtemp makes it 0700; a project is not secret
        # rename() refuses a non-empty target, so a folder that appeared meanwhile survives.
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
