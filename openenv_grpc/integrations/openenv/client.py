"""Typed clients for a served env whose message classes this process does not have (a
bridged OpenEnv env's types exist only in its server): made from the Info RPC."""

from __future__ import annotations

import types
from typing import Any

import grpc

from openenv_grpc import AsyncSession, Session, fetch_info
from openenv_grpc.client.info import message_classes
from openenv_grpc.v1 import session_pb2 as pb

__all__ = ["described_session"]


def described_session(
    target: str | pb.InfoResponse,
    *,
    asynchronous: bool = False,
    credentials: grpc.ChannelCredentials | None = None,
    token: str | None = None,
) -> type[Any]:
    """A ``Session[A, O, S, R]`` (or ``AsyncSession``) subclass typed with the classes
    that ``target``'s Info describes; the classes are its ``Action``, ``Observation``,
    ``State`` and ``ResetOptions`` attributes::

        WarehouseEnv = described_session("127.0.0.1:50051")
        with WarehouseEnv("127.0.0.1:50051") as env:
            env.reset(seed=1, options=WarehouseEnv.ResetOptions(difficulty=2))

    Raises:
        grpc.RpcError: the Info call failed.
    """
    info = (
        target
        if isinstance(target, pb.InfoResponse)
        else fetch_info(target, credentials=credentials, token=token)
    )
    classes = message_classes(info)
    roles = (classes["action"], classes["observation"], classes["state"], classes["reset_options"])
    base = AsyncSession if asynchronous else Session
    name = "".join(part[:1].upper() + part[1:] for part in info.env_name.split("_")) or "Env"
    return types.new_class(
        f"{'Async' if asynchronous else ''}{name}Session",
        (base[roles],),
        exec_body=lambda ns: ns.update(
            Action=roles[0], Observation=roles[1], State=roles[2], ResetOptions=roles[3]
        ),
    )
