"""A web console to watch and play any env server: ``openenv-grpc console HOST:PORT``.

It is an ordinary gRPC client of the env server; its forms come from the Info RPC's
descriptors, so no env needs UI code. Needs the ``console`` extra (aiohttp, Pillow).
"""

from openenv_grpc.console.app import create_app
from openenv_grpc.console.run import run_console, serve_console
from openenv_grpc.console.target import EnvTarget

__all__ = ["EnvTarget", "create_app", "run_console", "serve_console"]
