"""Testing helpers shipped with the library: a real server process, a real console
process and the conformance suite every environment runs (``EnvConformance``).

``EnvConformance`` is a pytest suite: it is imported on first use, so the process
helpers work where pytest is not installed (a training venv)."""

from typing import Any

from openenv_grpc.testing.console_process import ConsoleProcess
from openenv_grpc.testing.server_process import ServerProcess

__all__ = ["ConsoleProcess", "EnvConformance", "ServerProcess"]


def __getattr__(name: str) -> Any:
    if name == "EnvConformance":
        from openenv_grpc.testing.conformance import EnvConformance

        return EnvConformance
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
