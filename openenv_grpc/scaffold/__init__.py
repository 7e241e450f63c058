"""``openenv-grpc init``: scaffold a new, self-contained environment project.

:func:`scaffold` writes the project (a ``.proto``, code generation, an environment class,
typed clients, conformance tests, packaging and a container recipe);
:func:`add_init_command` wires the subcommand into an argparse CLI.
"""

from openenv_grpc.scaffold.cli import add_init_command, run_init
from openenv_grpc.scaffold.project import ScaffoldError, scaffold, validate_name

__all__ = ["ScaffoldError", "add_init_command", "run_init", "scaffold", "validate_name"]
