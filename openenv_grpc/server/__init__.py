"""The server side: configuration, the session runtime, and the process that hosts it."""

from openenv_grpc.server.app import EnvServer, serve
from openenv_grpc.server.config import ServerConfig
from openenv_grpc.server.model.spec import EnvSpec, ExecutionMode

__all__ = ["EnvServer", "EnvSpec", "ExecutionMode", "ServerConfig", "serve"]
