"""What a request may carry, checked before any env sees it: payloads of the declared
types, and the caps on what a client chooses that the server would store or echo."""

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

#: A client's episode id is echoed in every result of its episode.
MAX_EPISODE_ID_BYTES = 256
#: An env may keep its reset options for the whole episode.
MAX_RESET_OPTIONS_BYTES = 64 * 1024


class PayloadRefused(ValueError):
    """A payload is not of its declared type, does not parse, or its type url is too long."""


def decode_payload(payload: Any, message_class: type[Message], what: str) -> Message:
    """Raises PayloadRefused: ``payload`` (``what``: "action", ...) is no ``message_class``."""
    try:
        return unpack(payload, message_class, what)
    except PayloadError as exc:
        raise PayloadRefused(str(exc)) from None


def reset_problem(reset: pb.ResetCommand) -> str | None:
    """What is over its cap in one env's reset (None: nothing)."""
    if reset.HasField("episode_id"):
        size = len(reset.episode_id.encode())
        if size > MAX_EPISODE_ID_BYTES:
            return f"episode_id is {size} bytes; at most {MAX_EPISODE_ID_BYTES} are allowed"
    if reset.HasField("options"):
        size = len(reset.options.value)
        if size > MAX_RESET_OPTIONS_BYTES:
            return f"reset options are {size} bytes; at most {MAX_RESET_OPTIONS_BYTES} are allowed"
    return None
