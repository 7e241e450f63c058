"""Trainer-side adapters: remote sessions as Gymnasium environments.

Optional: this package needs ``gymnasium`` and ``numpy`` (``pip install
'openenv-grpc[gymnasium]'``); the rest of ``openenv_grpc`` never imports it.

* :class:`RemoteGymnasiumEnv`: one session of the ``gymnasium`` env of the catalogue as a
  local ``gymnasium.Env`` (spaces rebuilt from the server's description).
* :class:`RemoteGymnasiumVectorEnv`: N such sessions over one ``grpc.aio`` channel as a
  ``gymnasium.vector.VectorEnv``, stepped concurrently, with Gymnasium's autoreset modes.
"""

from openenv_grpc_envs.gymnasium.adapters.gymnasium_env import RemoteGymnasiumEnv, reset_options
from openenv_grpc_envs.gymnasium.adapters.vector_env import RemoteGymnasiumVectorEnv

__all__ = ["RemoteGymnasiumEnv", "RemoteGymnasiumVectorEnv", "reset_options"]
