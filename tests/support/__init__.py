"""Test-only environments and helpers; servers load them as ``support.envs:NAME``."""
