"""Bridges to other ecosystems, each an optional extra the core never imports.

- :mod:`openenv_grpc.integrations.trl`: sessions as TRL ``environment_factory``
  environments (``pip install 'openenv-grpc[trl]'``).
- :mod:`openenv_grpc.integrations.openenv`: OpenEnv environments served unchanged
  (``pip install 'openenv-grpc[openenv]'``).
"""
