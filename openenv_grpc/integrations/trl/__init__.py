"""Sessions as TRL ``environment_factory`` environments (``pip install 'openenv-grpc[trl]'``).

::

    from openenv_grpc.integrations.trl import environment_factory
    from openenv_grpc_envs.wordle import WordleEnv

    factory = environment_factory("127.0.0.1:50051", WordleEnv)   # tool: guess(word)
    trainer = GRPOTrainer(..., environment_factory=factory)

Nothing here imports TRL: the objects only follow its contract (see
:mod:`openenv_grpc.integrations.trl.environment`).
"""

from openenv_grpc.integrations.trl.environment import SessionEnvironment
from openenv_grpc.integrations.trl.factory import EnvironmentFactory, environment_factory

__all__ = ["EnvironmentFactory", "SessionEnvironment", "environment_factory"]
