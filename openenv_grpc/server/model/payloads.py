"""What a request may carry, checked before any env sees it: payloads of the declared
types, and the sizes a client chooses that the server would store or echo.

Both stream views check a request here (one place for each cap); the rest of a request is
bounded by ``--max-request-bytes`` alone.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import Message

from openenv_grpc.codec import MAX_TYPE_URL_BYTES, PayloadError, unpack
from openenv_grpc.v1 import session_pb2 as pb

__all__ = [
    "MAX_EPISODE_ID_BYTES",
    "MAX_RESET_OPTIONS_BYTES",
    "MAX_TYPE_URL_BYTES",
    "PayloadRefused",
    "decode_payload",
    "reset_problem",
]

#: A client-chosen episode id is echoed in every result of its episode: at most this many
#: UTF-8 bytes (a UUID is 36; 8 MB ids once cost 8 MB per step and per session).
MAX_EPISODE_ID_BYTES = 256
#: Reset options are handed to the env, which may keep them for the whole episode; env
#: configs are small, so this bounds what a session can make an env store per reset.
MAX_RESET_OPTIONS_BYTES = 64 * 1024


class PayloadRefused(ValueError):
    """A payload is not of its declared type, does not parse, or has a type url over
    :data:`MAX_TYPE_URL_BYTES` (the message says which; the request is INVALID_ARGUMENT)."""


def decode_payload(payload: Any, message_class: type[Message], what: str) -> Message:
    """Decode a request's ``payload`` (``what``: "action", ...) as ``message_class``.

    Raises:
        PayloadRefused: it cannot be.
    """
    try:
        return unpack(payload, message_class, what)
    except PayloadError as exc:
        raise PayloadRefused(str(exc)) from None


def reset_problem(reset: pb.ResetCommand) -> str | None:
    """What is over its cap in one env's reset (None: nothing), without the consequence
    (the caller says what was left undone)."""
    if reset.HasField("episode_id"):
        size = len(reset.episode_id.encode())
        if size > MAX_EPISODE_ID_BYTES:
            return f"episode_id is {size} bytes; at most {MAX_EPISODE_ID_BYTES} are allowed"
    if reset.HasField("options"):
        size = len(reset.options.value)
        if size > MAX_RESET_OPTIONS_BYTES:
            return f"reset options are {size} bytes; at most {MAX_RESET_OPTIONS_BYTES} are allowed"
    return None
