"""Fixtures for tests/ only (the shared server fixtures live in the root conftest.py)."""

from support.pki import pki

__all__ = ["pki"]
