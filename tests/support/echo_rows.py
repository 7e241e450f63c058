"""Echo actions and observations for vector tests, one row per env."""

from __future__ import annotations

from typing import Any

from openenv_grpc_envs.echo import EchoAction


def say(*messages: str) -> list[EchoAction]:
    """One echo action per message, in env order."""
    return [EchoAction(message=m) for m in messages]


def echoed_pids(outcome: Any) -> list[int]:
    """The process ids a ``pid`` step echoed, one per row."""
    return [int(o.echoed_message) for o in outcome.observations]
