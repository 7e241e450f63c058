"""Trainer-side adapters: remote sessions as Gymnasium environments.

Optional: this package needs ``gymnasium`` and ``numpy`` (the ``[gymnasium]`` extra:
``pip install -e '.[gymnasium]'`` in a checkout, or the wheel of ``make dist`` with it);
the rest of ``openenv_grpc`` never imports it.

* :class:`RemoteGymnasiumEnv`: one session of the ``gymnasium`` env of the catalogue as a
  local ``gymnasium.Env`` (spaces rebuilt from the server's description).
* :class:`RemoteGymnasiumVectorEnv`: N remote envs as one ``gymnasium.vector.VectorEnv``
  (one vector stream by default, or N sessions), with Gymnasium's autoreset modes.
* :mod:`.registration`: importing this package registers ``openenv-grpc/<id>`` ids, so
  ``gymnasium.make("openenv-grpc/CartPole-v1", target=...)`` and ``gymnasium.make_vec``
  build the adapters; without an import, Gymnasium's ``module:id`` form imports it:
  ``gymnasium.make("openenv_grpc_envs.gymnasium.adapters:openenv-grpc/CartPole-v1", ...)``.
"""

from openenv_grpc_envs.gymnasium.adapters.gymnasium_env import RemoteGymnasiumEnv, reset_options
from openenv_grpc_envs.gymnasium.adapters.registration import register_envs
from openenv_grpc_envs.gymnasium.adapters.vector_env import RemoteGymnasiumVectorEnv

__all__ = ["RemoteGymnasiumEnv", "RemoteGymnasiumVectorEnv", "register_envs", "reset_options"]

register_envs()
