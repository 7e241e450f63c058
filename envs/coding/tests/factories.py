"""Coding environments configured in code, served as ``module:factory`` by the tests."""

from __future__ import annotations

import functools

from openenv_grpc_envs.coding import CodingEnvironment, CodingSettings

#: Maxima given by the factory: the CODING_* variables are not read.
strict = functools.partial(
    CodingEnvironment, settings=CodingSettings(max_wall_ms=2000, max_processes=8)
)
