"""The project templates of ``openenv-grpc init`` (data only: ``*.tmpl`` files).

A package, so that setuptools ships the folder (see ``package-data`` in pyproject.toml).
"""
