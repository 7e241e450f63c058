"""``openenv-grpc init NAME [--dir DIR]``: the subcommand, wired into the main CLI.

The main parser calls :func:`add_init_command` with its subparsers; the parsed namespace
carries :func:`run_init` as ``handler``.
"""

from __future__ import annotations

import argparse
import sys

from openenv_grpc.scaffold.project import ScaffoldError, scaffold

__all__ = ["add_init_command", "run_init"]


def add_init_command(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``init`` subcommand to ``subparsers``.

    Returns:
        The subcommand's parser (its namespace has ``handler=run_init``).
    """
    init = subparsers.add_parser(
        "init",
        help="scaffold a new environment project",
        description="Write a new, self-contained environment project into DIR/NAME: a "
        ".proto, a Makefile that generates its Python code, the environment class (a "
        "number-guessing game to start from), typed clients, conformance tests, a "
        "pyproject.toml registering the env as NAME, and a Dockerfile. NAME may be "
        "kebab-case (my-env): the package is then my_env. Refuses to overwrite an "
        "existing folder.",
    )
    init.add_argument(
        "name",
        metavar="NAME",
        help="env name, lower_snake_case or kebab-case (my_env or my-env); its Python and "
        "proto package is the name with '_' for '-' (my_env)",
    )
    init.add_argument(
        "--dir",
        dest="directory",
        metavar="DIR",
        default=".",
        help="folder to create NAME/ in; made if missing (default: .)",
    )
    init.set_defaults(handler=run_init)
    return init


def run_init(args: argparse.Namespace) -> int:
    """Scaffold the project ``args`` names and print the next steps.

    Returns:
        0 when the project was written, 2 for a bad name or an existing folder, 1 when
        writing failed.
    """
    try:
        project = scaffold(args.name, args.directory)
    except ScaffoldError as exc:
        print(f"openenv-grpc: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"openenv-grpc: cannot write the project: {exc}", file=sys.stderr)
        return 1
    print(f"openenv-grpc: created {project}")
    print("next steps:")
    print(f"  cd {project}")
    print("  pip install -e '.[dev]'   # in a venv that has openenv-grpc (it is on no index)")
    print("  make proto                # generate the Python code from the .proto")
    print("  python -m pytest          # conformance suite + game tests")
    return 0
