"""One stream on any wire: its lifecycle and loop, the driver of its envs, the two views."""
