"""Adapters made in Python (``openenv_environment(...)``) and served as an ordinary ENV,
without ``serve_config``: the capacity guard must hold on this path too."""

from openenv_grpc.integrations.openenv import openenv_environment
from support.openenv_envs.warehouse import PickAction, PickObservation, WarehouseEnvironment

warehouse_adapter = openenv_environment(
    WarehouseEnvironment, action=PickAction, observation=PickObservation
)
