"""Testing helpers shipped with the library: a real server process, a real console
process and the conformance suite every environment runs (``EnvConformance``)."""

from openenv_grpc.testing.conformance import EnvConformance
from openenv_grpc.testing.console_process import ConsoleProcess
from openenv_grpc.testing.server_process import ServerProcess

__all__ = ["ConsoleProcess", "EnvConformance", "ServerProcess"]
