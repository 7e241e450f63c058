"""Package discovery only (metadata lives in pyproject.toml).

The catalogue lives in envs/ but imports as ``openenv_grpc_envs`` (a bare ``envs`` package
would collide with others); setuptools' declarative find() cannot follow that mapping.
"""

from setuptools import find_packages, setup

catalogue = ["openenv_grpc_envs"] + [
    f"openenv_grpc_envs.{name}" for name in find_packages("envs", exclude=["*.tests", "tests"])
]
setup(
    packages=find_packages(include=["openenv_grpc", "openenv_grpc.*"]) + catalogue,
    package_dir={"openenv_grpc_envs": "envs"},
)
