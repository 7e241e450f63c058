"""gRPC metadata keys both ends of the protocol agree on."""

__all__ = ["ADMITTED_KEY", "RETRY_PUSHBACK_KEY", "SESSION_ID_KEY"]

#: Initial-metadata key the server sends once a session is admitted and its env exists;
#: the value is the environment's name.
ADMITTED_KEY = "openenv-env"

#: Trailing-metadata key gRPC clients read as "retry after this many milliseconds".
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"

#: Initial-metadata key carrying the session's id, as it appears in the server's logs.
SESSION_ID_KEY = "openenv-session-id"
