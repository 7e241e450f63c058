"""The openenv-grpc environment catalogue (imported as ``openenv_grpc_envs``)."""
