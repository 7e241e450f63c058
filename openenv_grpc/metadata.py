"""Names both ends of the protocol agree on: gRPC metadata keys, the service name, and
the line a server prints once it listens.

The server, the clients, the providers and the test helpers all take them from here, so
none of them has to import another's modules for a constant.
"""

import re

from openenv_grpc.v1 import session_pb2 as _pb

__all__ = [
    "ADMITTED_KEY",
    "AUTORESET_KEY",
    "AUTORESET_VALUES",
    "BATCH_KEY",
    "INFO_JSON",
    "INFO_KEY",
    "NUM_ENVS_KEY",
    "PROTOCOL",
    "RETRY_PUSHBACK_KEY",
    "SERVICE_NAME",
    "SERVING_LINE",
    "SESSION_ID_KEY",
    "serving_line",
]

#: Initial-metadata key the server sends once a session is admitted and its env exists;
#: the value is the environment's name.
ADMITTED_KEY = "openenv-env"

#: Call-metadata key of a VectorSession open: how many envs the stream holds (a decimal).
NUM_ENVS_KEY = "openenv-num-envs"

#: Call-metadata key of a VectorSession open: the autoreset mode (one of
#: :data:`AUTORESET_VALUES`; absent means ``next_step``).
AUTORESET_KEY = "openenv-autoreset"

#: The values :data:`AUTORESET_KEY` takes, as Gymnasium 1.x names its autoreset modes.
AUTORESET_VALUES = ("next_step", "same_step", "disabled")

#: Initial-metadata key of an admitted VectorSession: ``native`` when the env answers the
#: stream as one native batch (batch_action / batch_observation work), else ``loop``.
BATCH_KEY = "openenv-batch"

#: Call-metadata key of a Session or VectorSession open: the form of results' info the
#: client reads. :data:`INFO_JSON` asks for ``info_json`` (JSON text, ints kept); absent
#: or any other value: the ``google.protobuf.Struct`` every client reads.
INFO_KEY = "openenv-info"

#: The value of :data:`INFO_KEY` that asks for infos as JSON text.
INFO_JSON = "json"

#: Trailing-metadata key gRPC clients read as "retry after this many milliseconds".
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"

#: Initial-metadata key carrying the session's id, as it appears in the server's logs.
SESSION_ID_KEY = "openenv-session-id"

#: The full name of the env service ("openenv_grpc.v1.EnvService"), also the health
#: service name that goes NOT_SERVING on drain.
SERVICE_NAME: str = _pb.DESCRIPTOR.services_by_name["EnvService"].full_name

#: The core protocol package, e.g. "openenv_grpc.v1".
PROTOCOL: str = _pb.DESCRIPTOR.package

#: Matches the status line a server prints once it listens (groups: env, host, port);
#: providers, test helpers and tools wait for it.
SERVING_LINE = re.compile(r"openenv-grpc: serving (\S+) on (\S+):(\d+)")


def serving_line(env: str, host: str, port: int, suffix: str = "") -> str:
    """The status line :data:`SERVING_LINE` matches (``suffix``: e.g. " with 2 workers")."""
    return f"openenv-grpc: serving {env} on {host}:{port}{suffix}"
