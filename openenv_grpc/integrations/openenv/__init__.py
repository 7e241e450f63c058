"""OpenEnv environments served unchanged (``pip install 'openenv-grpc[openenv]'``).

::

    openenv-grpc serve --openenv my_env.server.app:app      # the string uvicorn takes
    openenv-grpc serve --openenv my_env.server.my_environment:MyEnvironment

or from Python::

    from openenv_grpc import serve
    from openenv_grpc.integrations.openenv import openenv_environment, serve_config

    env = openenv_environment(MyEnvironment)       # an openenv-grpc Environment class
    serve(env, serve_config(env))                   # capacity 1 unless concurrency-safe

See :mod:`openenv_grpc.integrations.openenv.environment` for how the contract maps,
:mod:`openenv_grpc.integrations.openenv.schema` for how pydantic types become protobuf
(JSON-typed fields: :data:`~openenv_grpc.integrations.openenv.schema.JSON_TYPE`),
:mod:`openenv_grpc.integrations.openenv.serving` for what ``--openenv`` accepts and
:mod:`openenv_grpc.integrations.openenv.parity` for comparing answers with OpenEnv's.
"""

# Before anything imports OpenEnv: a server's env processes leave out its web UI too.
from openenv_grpc.integrations.openenv_web_ui import leave_out_in_servers

leave_out_in_servers()

from openenv_grpc.integrations.openenv.client import described_session  # noqa: E402
from openenv_grpc.integrations.openenv.environment import (  # noqa: E402
    OpenEnvTypes,
    openenv_environment,
)
from openenv_grpc.integrations.openenv.serving import load_openenv_class, serve_config  # noqa: E402

__all__ = [
    "OpenEnvTypes",
    "described_session",
    "load_openenv_class",
    "openenv_environment",
    "serve_config",
]
