"""Channels and stubs for clients: what a target string becomes, with sane options."""

from __future__ import annotations

from typing import Any

import grpc

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "aio_channel", "channel_options", "sync_channel"]

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Message limits matching the server's, and keepalive so a dead server is noticed."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def aio_channel(target: str, **kwargs: Any) -> grpc.aio.Channel:
    """A plaintext asyncio channel to ``target`` ("host:port")."""
    return grpc.aio.insecure_channel(target, options=channel_options(**kwargs))


def sync_channel(target: str, **kwargs: Any) -> grpc.Channel:
    """A plaintext blocking channel to ``target`` ("host:port")."""
    return grpc.insecure_channel(target, options=channel_options(**kwargs))
