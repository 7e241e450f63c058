"""OpenEnv 0.10 environments written exactly as OpenEnv's template and docs teach
(``openenv init``'s echo env, one with nested and list fields, an MCP env), for the
bridge tests. They import only ``openenv`` and ``pydantic``: nothing of openenv-grpc."""
